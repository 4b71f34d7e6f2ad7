"""Recipes: real builds (tree steps, run and pip steps in real build
environments), the per-component build cache, failures, and ``weenv update``.
Parsing is in ``tests/unit/test_recipe_parsing.py``."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from weenv.build.buildenv import NodeBuildEnvironments
from weenv.errors import InvalidInputError, NotFoundError
from weenv.host import mounts
from weenv.node.node import Node
from weenv.packaging.builder import StepFailedError, build_recipe
from weenv.packaging.group import load_group
from weenv.packaging.recipe import load_recipe
from weenv.packaging.template import load_template
from weenv.packaging.update import update_component
from weenv.packaging.upperdir import clean_upper


def write_recipe(directory: Path, text: str) -> Path:
    path = directory / "recipe.toml"
    path.write_text(text)
    return path


def build(store, paths, recipe_path):
    return build_recipe(load_recipe(recipe_path), store, paths, environments=NodeBuildEnvironments())


def group_names(store, template):
    _, t = load_template(store, template)
    return [load_group(store, g).name for g in t.groups]


# --- tree components: cache and update -----------------------------------------------------

TREE_RECIPE = """
[template]
name = "tree"
version = "1"
[[component]]
name = "base"
[[component.step]]
kind = "from_dir"
path = "base"
[[component]]
name = "tools"
[[component.step]]
kind = "copy"
src = "tool.sh"
dest = "/usr/local/bin/"
mode = "0755"
[[component]]
name = "task"
[[component.step]]
kind = "from_dir"
path = "task"
dest = "/workspace"
[[component.step]]
kind = "copy"
src = "extra"
dest = "/workspace/extra"
owner = "1000:1000"
"""


@pytest.fixture
def tree_recipe(tmp_path):
    d = tmp_path / "recipe"
    (d / "base" / "etc").mkdir(parents=True)
    (d / "base" / "etc" / "os-release").write_text("NAME=tiny\n")
    (d / "base" / "data.bin").write_bytes(os.urandom(3 << 20))
    (d / "tool.sh").write_text("#!/bin/sh\necho tool v1\n")
    (d / "task").mkdir()
    (d / "task" / "main.py").write_text("print('task')\n")
    (d / "extra").mkdir()
    (d / "extra" / "notes.txt").write_text("notes\n")
    return write_recipe(d, TREE_RECIPE)


def test_tree_recipe_builds_and_caches_per_component(tree_recipe, store, paths, leak_check):
    first = build(store, paths, tree_recipe)
    assert first.rebuilt == ["base", "tools", "task"] and first.template_changed
    assert group_names(store, "tree") == ["base", "tools", "task"]
    assert {n: store.get_ref("groups", n) for n in ("base", "tools", "task")} == {
        c.name: c.digest for c in first.components
    }
    assert first.bytes_published > 3 << 20  # the random base file does not compress

    again = build(store, paths, tree_recipe)
    assert again.rebuilt == [] and not again.template_changed and again.bytes_published == 0
    assert again.template_digest == first.template_digest

    # mtimes are not inputs: touching a file does not rebuild
    os.utime(tree_recipe.parent / "task" / "main.py", (1, 1))
    assert build(store, paths, tree_recipe).rebuilt == []

    (tree_recipe.parent / "tool.sh").write_text("#!/bin/sh\necho tool v2\n")
    third = build(store, paths, tree_recipe)
    # a tree-only component never sees the groups below: the task is not rebuilt
    assert third.rebuilt == ["tools"] and third.template_changed
    assert third.bytes_published < 64 << 10
    _, t1 = load_template(store, first.template_digest)
    _, t3 = load_template(store, third.template_digest)
    assert t3.groups[0] == t1.groups[0] and t3.groups[2] == t1.groups[2] and t3.groups[1] != t1.groups[1]
    assert not list((paths.home / "build").iterdir())


def test_copy_and_from_dir_results_inside_an_environment(tree_recipe, debian_root, store, paths, tmp_path, leak_check):
    # the tiny tree has no shell: stack it over a Debian base to look inside
    text = TREE_RECIPE.replace(
        '[[component]]\nname = "base"\n[[component.step]]\nkind = "from_dir"\npath = "base"\n',
        f'[[component]]\nname = "debian"\n[[component.step]]\nkind = "from_dir"\npath = "{debian_root}"\n'
        '[[component]]\nname = "base"\n[[component.step]]\nkind = "from_dir"\npath = "base"\n',
    )
    build(store, paths, write_recipe(tree_recipe.parent, text))
    with Node(paths, store=store) as node:
        env = node.create("tree")
        r = node.exec(
            env.id,
            "stat -c '%a %u:%g %n' /usr/local/bin/tool.sh /workspace/extra/notes.txt "
            "/workspace/main.py; tool.sh; cat /etc/os-release",
        )
        assert r.exit_code == 0, r
        assert r.stdout.decode().splitlines() == [
            "755 0:0 /usr/local/bin/tool.sh",
            "644 1000:1000 /workspace/extra/notes.txt",
            f"644 {os.getuid()}:{os.getgid()} /workspace/main.py",  # from_dir keeps owners
            "tool v1",
            "NAME=tiny",
        ]


def test_update_republishes_one_group(tree_recipe, store, paths, tmp_path, leak_check):
    first = build(store, paths, tree_recipe)
    new_tools = tmp_path / "tools-v2" / "usr" / "local" / "bin"
    new_tools.mkdir(parents=True)
    (new_tools / "tool.sh").write_text("#!/bin/sh\necho tool v2\n")
    r = update_component(store, "tree", "tools", tmp_path / "tools-v2", paths=paths)
    _, old = load_template(store, first.template_digest)
    _, new = load_template(store, "tree")
    assert r.template_digest == store.get_ref("templates", "tree") and r.previous_digest == first.template_digest
    assert (old.version, new.version, r.version) == ("1", "2", "2")
    assert new.groups[0] == old.groups[0] and new.groups[2] == old.groups[2]
    assert new.groups[1] == r.group_digest != old.groups[1]
    assert new.runtime == old.runtime
    assert 0 < r.bytes_published < 16 << 10 and r.chunks_written == 1 and r.seconds > 0
    with pytest.raises(InvalidInputError, match="no component 'nope'.*base, tools, task"):
        update_component(store, "tree", "nope", tmp_path / "tools-v2", paths=paths)
    with pytest.raises(NotFoundError):
        update_component(store, "missing", "tools", tmp_path / "tools-v2", paths=paths)
    with pytest.raises(InvalidInputError):
        update_component(store, "tree", "tools", tmp_path / "no-such-dir", paths=paths)
    assert store.get_ref("templates", "tree") == r.template_digest


def test_missing_source_is_a_clear_error(tmp_path, store, paths):
    path = write_recipe(
        tmp_path,
        '[template]\nname = "t"\n[[component]]\nname = "a"\n[[component.step]]\nkind = "from_dir"\npath = "nowhere"\n',
    )
    with pytest.raises(InvalidInputError, match="nowhere is not a directory"):
        build(store, paths, path)
    assert store.list_refs("templates") == {} and list(store.list_manifests()) == []


# --- build environments --------------------------------------------------------------------

RUN_RECIPE = """
[template]
name = "run"
[template.runtime]
working_dir = "/root"
[[component]]
name = "base"
[[component.step]]
kind = "from_dir"
path = "{debian}"
[[component]]
name = "patch"
[[component.step]]
kind = "from_dir"
path = "patch"
[[component]]
name = "dep"
[[component.step]]
kind = "run"
commands = [
  "cat /etc/patch > /etc/dep-saw-patch",
  "rm -r /usr/share/doc && mkdir -p /usr/share/doc/fresh && echo new > /usr/share/doc/fresh/f",
  "rm /etc/hostname && echo x > /etc/x",
  "mv /usr/share/man /usr/share/man2",
  "chmod 600 /etc/issue",
]
[[component]]
name = "indep"
independent = true
[[component.step]]
kind = "run"
commands = "mkdir -p /opt/tools && echo tool > /opt/tools/t"
[[component]]
name = "task"
[[component.step]]
kind = "copy"
src = "task.txt"
dest = "/root/task.txt"
"""


@pytest.fixture
def run_recipe(tmp_path, debian_root):
    d = tmp_path / "recipe"
    (d / "patch" / "etc").mkdir(parents=True)
    (d / "patch" / "etc" / "patch").write_text("patch v1\n")
    (d / "task.txt").write_text("the task\n")
    return write_recipe(d, RUN_RECIPE.format(debian=debian_root))


def test_run_steps_whiteouts_and_rebuilds(run_recipe, store, paths, leak_check):
    first = build(store, paths, run_recipe)
    assert first.rebuilt == ["base", "patch", "dep", "indep", "task"]
    with Node(paths, store=store) as node:
        env = node.create("run")
        r = node.exec(
            env.id,
            "ls -A /usr/share/doc; cat /etc/dep-saw-patch /etc/x /opt/tools/t task.txt; "
            "test -e /etc/hostname || echo no-hostname; test -d /usr/share/man || echo no-man; "
            "ls /usr/share/man2 | head -1; stat -c %a /etc/issue",
        )
        assert r.exit_code == 0, r
        # the opaque /usr/share/doc hides every lower entry; whiteouts hide deleted files
        assert r.stdout.decode().split() == [
            "fresh",
            "patch",
            "v1",
            "x",
            "tool",
            "the",
            "task",
            "no-hostname",
            "no-man",
            "cs",
            "600",
        ]
    dep = load_group(store, store.get_ref("groups", "dep"))
    assert dep.image_size < 8 << 20 < load_group(store, store.get_ref("groups", "base")).image_size

    # change the patch component: what runs on it is rebuilt; the independent one and
    # the tree-only task are not
    (run_recipe.parent / "patch" / "etc" / "patch").write_text("patch v2\n")
    second = build(store, paths, run_recipe)
    assert second.rebuilt == ["patch", "dep"]
    assert build(store, paths, run_recipe).rebuilt == []
    with Node(paths, store=store) as node:
        env = node.create("run")
        assert node.exec(env.id, ["cat", "/etc/dep-saw-patch"]).stdout == b"patch v2\n"
    assert not list((paths.home / "build").iterdir())


def test_pip_step_installs_a_real_package(debian_root, tmp_path, store, paths, leak_check):
    d = tmp_path / "recipe"
    d.mkdir()
    (d / "requirements.txt").write_text("six==1.17.0\n")
    path = write_recipe(
        d,
        f"""
[template]
name = "py"
[[component]]
name = "base"
[[component.step]]
kind = "from_dir"
path = "{debian_root}"
[[component]]
name = "deps"
[[component.step]]
kind = "pip"
requirements_file = "requirements.txt"
requirements = ["idna==3.10"]
""",
    )
    result = build(store, paths, path)
    assert result.rebuilt == ["base", "deps"]
    with Node(paths, store=store) as node:
        env = node.create("py")
        r = node.exec(env.id, ["python3", "-c", "import idna, six; print(six.__version__, idna.__file__)"])
        assert r.stdout.decode().split() == ["1.17.0", "/usr/local/lib/python3.11/dist-packages/idna/__init__.py"]
        r = node.exec(env.id, "ls -A /tmp; ls /usr/local/lib/python3.11/dist-packages | sort")
        assert ".weenv-pip" not in r.stdout.decode()  # the pip wheel and CA bundle stayed out
        assert "six.py" in r.stdout.decode().split()
    # the requirements file's content is an input
    (d / "requirements.txt").write_text("six==1.16.0\n")
    assert build(store, paths, path).rebuilt == ["deps"]


def test_failing_step_shows_output_and_publishes_nothing(debian_root, tmp_path, store, paths, leak_check):
    path = write_recipe(
        tmp_path,
        f"""
[template]
name = "bad"
[[component]]
name = "base"
[[component.step]]
kind = "from_dir"
path = "{debian_root}"
[[component]]
name = "broken"
[[component.step]]
kind = "run"
commands = ["echo first-ok", "echo to-stdout; echo to-stderr >&2; exit 3", "echo never"]
""",
    )
    before_manifests = set(store.list_manifests())
    with pytest.raises(StepFailedError) as info:
        build(store, paths, path)
    msg = str(info.value)
    assert "component 'broken', step 1 (run)" in msg and "exited 3" in msg and "nothing was published" in msg
    assert "to-stdout\nto-stderr" in msg and "never" not in msg
    assert info.value.component == "broken" and info.value.step == 1
    # no ref moved; the only new manifest is the base group, kept in the build cache
    assert store.list_refs("templates") == {} and store.list_refs("groups") == {}
    new = set(store.list_manifests()) - before_manifests
    assert [load_group(store, d).name for d in new] == ["base"]
    assert list(store.list_refs("buildcache").values()) == list(new)
    assert not list((paths.home / "build").iterdir())
    assert mounts.mounts_under(paths.home) == []


def test_cli_build_and_failure(tree_recipe, paths, tmp_path, leak_check):
    env = dict(os.environ, WEENV_HOME=str(paths.home))

    def weenv(*args):
        return subprocess.run(
            [sys.executable, "-m", "weenv", *args], capture_output=True, text=True, check=False, env=env
        )

    p = weenv("build", str(tree_recipe))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().startswith("sha256:") and "3 of 3 components rebuilt" in p.stderr
    said = p.stderr.splitlines()  # its progress on a pipe: a line per component's step, and its end
    assert [line for line in said if line.startswith("task") and line.endswith(("waiting", "built"))] == [
        "task: waiting",
        "task: built",
    ], said
    p = weenv("build", str(tree_recipe))
    assert "0 of 3 components rebuilt, 0 B published" in p.stderr and "unchanged" in p.stderr
    new = tmp_path / "t2" / "workspace"
    new.mkdir(parents=True)
    (new / "main.py").write_text("print('task 2')\n")
    p = weenv("update", "tree", "--component", "task", "--from-dir", str(tmp_path / "t2"))
    assert p.returncode == 0, p.stderr
    assert "template tree version 2: task" in p.stderr and "published in" in p.stderr
    said = p.stderr.splitlines()
    assert said[0].startswith("task 0/2: replacing group 2 of template tree"), said
    assert "task 2/2: template tree version 2 published" in said, said
    bad = write_recipe(
        tmp_path, '[template]\nname = "t"\n[[component]]\nname = "a"\n[[component.step]]\nkind = "teleport"\n'
    )
    p = weenv("build", str(bad))
    assert p.returncode == 1 and "weenv: error:" in p.stderr and "teleport" in p.stderr
    assert "Traceback" not in p.stderr


def test_clean_upper_of_a_real_overlay(node, tmp_path):
    """What overlayfs leaves in an upper dir on this kernel, and what clean_upper keeps."""
    env = node.create("task")
    r = node.exec(
        env.id,
        "rm /etc/hostname /etc/issue.net && rm -r /usr/share/doc && mkdir /usr/share/doc "
        "&& chmod 600 /etc/issue && echo new > /etc/new",
    )
    assert r.exit_code == 0, r
    upper = node.stop(env.id)
    try:
        seen = {}
        for dirpath, dirnames, filenames in os.walk(upper):
            for p in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                seen[os.path.relpath(p, upper)] = set(os.listxattr(p, follow_symlinks=False))
        # overlayfs's own bookkeeping, as found on Linux 6.18
        assert "trusted.overlay.origin" in seen["etc/issue"]
        assert "trusted.overlay.impure" in seen["etc"]
        assert os.lstat(upper / "etc" / "hostname").st_nlink > 1  # whiteouts share one inode
        stats = clean_upper(upper)
        assert (stats.whiteouts, stats.opaque_dirs) == (2, 1) and stats.xattrs_removed >= 3
        for dirpath, dirnames, filenames in os.walk(upper):
            for p in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                names = os.listxattr(p, follow_symlinks=False)
                assert [n for n in names if n.startswith("trusted.overlay.")] == (
                    ["trusted.overlay.opaque"] if p == str(upper / "usr" / "share" / "doc") else []
                ), p
        for name in ("hostname", "issue.net"):
            st = os.lstat(upper / "etc" / name)
            assert (st.st_rdev, st.st_nlink) == (0, 1) and stat.S_ISCHR(st.st_mode)
    finally:
        node.destroy(env.id)
