"""Startup files together (issue 18 item 2), on real mounts: a first start
records its prefetch profile; ``weenv update --profile`` rebuilds the base
group from the same tree with the files that profile read laid out first,
contiguous, in access order.  The tree reads back the same (names, modes,
sizes, content digests) and a cold start of the same command fetches fewer
chunks, counted by the node's cache (both starts are a template's first:
demand reads only, no replay)."""

from __future__ import annotations

import subprocess

from weenv.formats.manifest import Layout
from weenv.node.node import Node
from weenv.packaging.group import load_group
from weenv.packaging.profile import REF_KIND, ref_name
from weenv.packaging.template import load_template
from weenv.packaging.update import update_component
from weenv.store.file import FileStore

COMMAND = ["python3", "-c", "import json, email.parser, http.client, argparse; print('up')"]
TREE = (
    "cd / && find / -xdev \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o "
    "-printf '%p %y %m %s\\n' | sort | sha256sum && "
    "find / -xdev \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o -type f -print0 "
    "| sort -z | xargs -0 sha256sum | sha256sum"
)


def _cold_first_command(n: Node, template: str) -> tuple[int, str]:
    """Chunks a cold start of ``template`` fetched by the end of its first command, and its tree's digests."""
    n.drop_caches()
    before = n.cache.chunks_fetched
    env = n.create(template)
    r = n.exec(env.id, COMMAND)
    assert r.exit_code == 0 and r.stdout == b"up\n", r
    fetched = n.cache.chunks_fetched - before
    tree = n.exec(env.id, ["sh", "-c", TREE])
    assert tree.exit_code == 0, tree
    n.destroy(env.id)
    n.prefetch.wait_published()
    return fetched, tree.stdout.decode()


def test_a_group_rebuilt_with_its_profile_keeps_its_tree_and_a_cold_start_fetches_fewer_chunks(
    tmp_path, paths, shared_store, debian_root, leak_check
):
    root = tmp_path / "store"
    subprocess.run(["cp", "-al", str(shared_store.root), str(root)], check=True)
    subprocess.run(["rm", "-rf", str(root / "refs" / REF_KIND), str(root / "packs")], check=True)
    store = FileStore(root)
    old_digest, old = load_template(store, "task")
    with Node(paths, store=store, prefetch_pack_bytes=0) as n:
        before, old_tree = _cold_first_command(n, old_digest)
        assert store.get_ref(REF_KIND, ref_name(old_digest))  # the first start recorded its profile
        r = update_component(store, "task", "base", debian_root, paths=paths, profile=True)
        group = load_group(store, r.group_digest)
        assert r.group_digest != old.groups[0]
        assert group.layout == Layout(order="profile", profile=store.get_ref(REF_KIND, ref_name(old_digest)))
        assert load_group(store, old.groups[0]).layout == Layout()  # built before: tree order, still valid
        after, new_tree = _cold_first_command(n, r.template_digest)
    print(f"\nchunks fetched by the first command's cold start: tree order {before}, profile order {after}")
    assert new_tree == old_tree
    assert after < before, (before, after)
