"""Group manifest schema versions on a real node: a group published by a weenv
before v2 (schema version 1) still starts; builds write v2
(:mod:`weenv.formats.manifest`)."""

from __future__ import annotations

from weenv.formats.manifest import GROUP_MEDIA_TYPE_V1, GroupManifest, canonical_json
from weenv.packaging.group import load_group
from weenv.packaging.template import create_template, load_template


def test_a_v1_group_still_starts(node, shared_store):
    _digest, task = load_template(shared_store, "task")
    base = load_group(shared_store, task.groups[0])
    assert base.schema_version == 2 and base.layout is not None  # what builds write
    fields = base.model_dump(exclude={"schema_version", "media_type", "layout"})
    v1 = GroupManifest(schema_version=1, **fields)
    assert v1.media_type == GROUP_MEDIA_TYPE_V1 and "layout" not in canonical_json(v1).decode()
    v1_digest = shared_store.put_manifest(canonical_json(v1))
    assert load_group(shared_store, v1_digest).schema_version == 1
    create_template(shared_store, "v1task", [v1_digest, task.groups[1]])
    env = node.create("v1task")
    try:
        r = node.exec(env.id, ["python3", "-c", "print(open('/workspace/hello.py').read().strip())"])
        assert (r.exit_code, r.stdout) == (0, b"print('hello from the task')\n")
    finally:
        node.destroy(env.id)
        shared_store.delete_ref("templates", "v1task")
