"""The manifest formats (:mod:`weenv.formats.manifest`): digests of canonical
JSON, schema versions and media types, names, resources, runtime config and
the errors bad input gets."""

from __future__ import annotations

import hashlib
import json

import pytest
from pydantic import ValidationError

from weenv.errors import InvalidInputError
from weenv.formats.manifest import (
    GROUP_MEDIA_TYPE,
    GROUP_MEDIA_TYPE_V1,
    MAX_CPUS,
    MAX_MEMORY_BYTES,
    MAX_PIDS,
    MIN_MEMORY_BYTES,
    TEMPLATE_MEDIA_TYPE,
    ChunkRef,
    GroupManifest,
    Layout,
    Resources,
    RuntimeConfig,
    TemplateManifest,
    canonical_json,
    check_digest,
    check_name,
    manifest_kind,
    parse_group_manifest,
    parse_template_manifest,
    sha256_digest,
)

D0 = "sha256:" + "0" * 64
D1 = "sha256:" + "1" * 64


def chunk(size: int, fill: bytes = b"c") -> ChunkRef:
    data = fill * size
    return ChunkRef(
        digest=sha256_digest(data), size=size, stored_size=size // 2 + 1, stored_digest=sha256_digest(data + b"z")
    )


def group(sizes=(4096, 4096, 100), chunk_size=4096, **kw) -> GroupManifest:
    fields = dict(
        name="base",
        image_size=sum(sizes),
        chunk_size=chunk_size,
        chunks=[chunk(s, bytes([i + 65])) for i, s in enumerate(sizes)],
        file_count=3,
        created="2026-01-01T00:00:00Z",
    )
    fields.update(kw)
    return GroupManifest(**fields)


# --- digests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("data", [b"", b"abc", bytes(range(256)) * 7])
def test_sha256_digest_is_the_oci_form_of_hashlib_sha256(data):
    assert sha256_digest(data) == "sha256:" + hashlib.sha256(data).hexdigest()
    assert check_digest(sha256_digest(data)) == sha256_digest(data)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "sha256:",
        "sha256:" + "0" * 63,
        "sha256:" + "0" * 65,
        "sha256:" + "A" * 64,
        "sha512:" + "0" * 64,
        "0" * 64,
        " sha256:" + "0" * 64,
        "sha256:" + "0" * 64 + "\n",
        None,
        7,
    ],
)
def test_check_digest_refuses_what_is_not_a_sha256_digest(bad):
    with pytest.raises(InvalidInputError, match="not a sha256 digest"):
        check_digest(bad)


@pytest.mark.parametrize("good", ["a", "0", "debian-bookworm-python3", "a.b_c-d", "x" * 128])
def test_check_name_accepts_lowercase_names_up_to_128(good):
    assert check_name(good) == good


@pytest.mark.parametrize("bad", ["", "Upper", "-dash", ".dot", "_u", "a/b", "a b", "x" * 129, "é", "a\n", None])
def test_check_name_refuses_other_names(bad):
    with pytest.raises(InvalidInputError, match="bad name"):
        check_name(bad)


# --- canonical JSON ----------------------------------------------------------------------------
def test_canonical_json_sorts_keys_has_no_whitespace_and_keeps_unicode():
    m = group(source={"z": "ünï ✓", "a": "1"})
    text = canonical_json(m).decode()
    assert " " not in text.replace("ünï ✓", "") and "\n" not in text
    assert "ünï ✓" in text  # UTF-8, not \u escapes
    obj = json.loads(text)
    assert text == json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert list(obj) == sorted(obj) and list(obj["source"]) == ["a", "z"]


def test_a_manifests_digest_is_the_sha256_of_its_canonical_json_and_survives_a_round_trip():
    m = group()
    assert m.digest() == sha256_digest(canonical_json(m))
    again = parse_group_manifest(canonical_json(m))
    assert again == m and again.digest() == m.digest()
    pretty = json.dumps(json.loads(canonical_json(m)), indent=4).encode()  # whitespace does not matter
    assert parse_group_manifest(pretty).digest() == m.digest()


def test_any_field_change_changes_the_digest():
    m = group()
    digests = {
        m.digest(),
        group(name="other").digest(),
        group(version="2").digest(),
        group(file_count=4).digest(),
        group(source={"from": "x"}).digest(),
        group(created="2026-01-01T00:00:01Z").digest(),
        group(sizes=(4096, 4096, 101)).digest(),
    }
    assert len(digests) == 7


def test_template_digest_and_round_trip():
    t = TemplateManifest(name="t", groups=[D0, D1], created="2026-01-01T00:00:00Z")
    assert t.schema_version == 1 and t.media_type == TEMPLATE_MEDIA_TYPE
    again = parse_template_manifest(canonical_json(t))
    assert again == t and again.digest() == t.digest() == sha256_digest(canonical_json(t))
    reordered = TemplateManifest(name="t", groups=[D1, D0], created=t.created)  # bottom-to-top order counts
    assert reordered.digest() != t.digest()


def test_unset_default_command_is_left_out_so_old_digests_hold():
    t = TemplateManifest(name="t", groups=[D0], created="2026-01-01T00:00:00Z")
    assert "default_command" not in json.loads(canonical_json(t))["runtime"]
    with_cmd = TemplateManifest(
        name="t", groups=[D0], created=t.created, runtime=RuntimeConfig(default_command=["/bin/sh", "-c", "echo hi"])
    )
    assert json.loads(canonical_json(with_cmd))["runtime"]["default_command"] == ["/bin/sh", "-c", "echo hi"]
    assert with_cmd.digest() != t.digest()
    assert parse_template_manifest(canonical_json(with_cmd)) == with_cmd


# --- group manifest checks ---------------------------------------------------------------------
def test_group_defaults_schema_and_stored_size():
    m = group()
    assert (m.schema_version, m.media_type, m.block_size) == (2, GROUP_MEDIA_TYPE, 4096)
    assert m.layout == Layout(order="tree", profile=None)
    assert m.stored_size == sum(c.stored_size for c in m.chunks)
    assert group(sizes=(), chunk_size=4096).image_size == 0  # an empty image has no chunks


@pytest.mark.parametrize(
    "sizes, image_size, chunk_size",
    [
        ((4096, 100), 4000, 4096),  # the sum is not the image size
        ((100, 4096), 4196, 4096),  # a short chunk before the last
        ((4096, 5000), 9096, 4096),  # the last longer than a chunk
        ((4096, 0), 4096, 4096),  # an empty last chunk
        ((), 10, 4096),  # no chunks for a non-empty image
    ],
)
def test_chunks_must_tile_the_image(sizes, image_size, chunk_size):
    with pytest.raises(ValidationError, match="do not tile"):
        group(sizes=sizes, image_size=image_size, chunk_size=chunk_size)


@pytest.mark.parametrize(
    "change",
    [
        {"schema_version": 1},
        {"media_type": GROUP_MEDIA_TYPE_V1},
        {"media_type": TEMPLATE_MEDIA_TYPE},
        {"chunk_size": 0},
        {"layout": {"order": "profile"}},
        {"layout": {"order": "tree", "profile": D0}},
        {"layout": {"order": "size"}},
        {"image_size": -1},
        {"file_count": -1},
        {"name": "Bad"},
        {"extra": 1},
    ],
)
def test_parse_group_manifest_refuses_bad_fields_as_invalid_input(change):
    obj = json.loads(canonical_json(group()))
    obj.update(change)
    with pytest.raises(InvalidInputError, match="not a weenv group manifest"):
        parse_group_manifest(json.dumps(obj).encode())


# --- schema versions ---------------------------------------------------------------------------
V1_JSON = (
    b'{"block_size":4096,"chunk_size":4096,"chunks":[{"digest":"' + D0.encode() + b'","size":100,'
    b'"stored_digest":"' + D1.encode() + b'","stored_size":51}],"created":"2026-01-01T00:00:00Z",'
    b'"file_count":3,"image_size":100,"media_type":"application/vnd.weenv.group.v1+json","name":"base",'
    b'"schema_version":1,"source":{},"version":"latest"}'
)
"""A group manifest as weenv wrote them before v2 (its canonical JSON, byte for byte)."""


def test_a_v1_group_manifest_reads_and_keeps_its_digest():
    m = parse_group_manifest(V1_JSON)
    assert (m.schema_version, m.media_type, m.layout) == (1, GROUP_MEDIA_TYPE_V1, None)
    assert canonical_json(m) == V1_JSON and m.digest() == sha256_digest(V1_JSON)
    assert manifest_kind(V1_JSON) == "group"
    assert group(schema_version=1).media_type == GROUP_MEDIA_TYPE_V1  # the media type follows the version


def test_a_v2_group_manifest_carries_its_layout():
    tree = group()
    assert json.loads(canonical_json(tree))["layout"] == {"order": "tree", "profile": None}
    ordered = group(layout=Layout(order="profile", profile=D1))
    data = canonical_json(ordered)
    assert json.loads(data)["schema_version"] == 2 and manifest_kind(data) == "group"
    again = parse_group_manifest(data)
    assert again == ordered and again.layout.profile == D1 and again.digest() == ordered.digest() != tree.digest()


def test_a_v1_group_manifest_has_no_layout():
    with pytest.raises(ValidationError, match="version 1 group manifest has no layout"):
        group(schema_version=1, layout=Layout())


@pytest.mark.parametrize(
    "change",
    [
        {"schema_version": 3},
        {"schema_version": 0},
        {"schema_version": "2"},
        {"schema_version": True},
        {"schema_version": 3, "media_type": "application/vnd.weenv.group.v3+json"},
        {"media_type": "application/vnd.weenv.group.v3+json"},
    ],
)
def test_an_unknown_group_schema_version_is_named_with_the_digest_in_one_line(change):
    obj = json.loads(canonical_json(group()))
    obj.update(change)
    if "schema_version" not in change:
        del obj["schema_version"]
    data = json.dumps(obj).encode()
    assert manifest_kind(data) == "group"
    with pytest.raises(InvalidInputError) as e:
        parse_group_manifest(data, D0)
    message = str(e.value)
    shown = repr(change.get("schema_version", 3))
    assert message == (
        f"group manifest {D0} has schema version {shown}: this node reads versions 1, 2 (written by a newer weenv?)"
    )


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe"])
def test_parse_manifest_refuses_what_is_not_json_of_an_object(data):
    with pytest.raises(InvalidInputError):
        parse_group_manifest(data)
    with pytest.raises(InvalidInputError):
        parse_template_manifest(data)


def test_chunk_ref_fields_are_checked():
    with pytest.raises(ValidationError):
        ChunkRef(digest="sha256:x", size=1, stored_size=1, stored_digest=D0)
    with pytest.raises(ValidationError):
        ChunkRef(digest=D0, size=-1, stored_size=1, stored_digest=D0)
    with pytest.raises(ValidationError):
        ChunkRef(digest=D0, size=1, stored_size=1, stored_digest=D0, extra=2)


def test_manifests_are_frozen():
    m = group()
    with pytest.raises(ValidationError):
        m.name = "other"


# --- template manifest checks ------------------------------------------------------------------
@pytest.mark.parametrize(
    "change",
    [
        {"groups": []},
        {"groups": ["sha256:nope"]},
        {"schema_version": 2},
        {"media_type": GROUP_MEDIA_TYPE},
        {"prefetch": "x"},
        {"name": ""},
    ],
)
def test_parse_template_manifest_refuses_bad_fields(change):
    obj = json.loads(canonical_json(TemplateManifest(name="t", groups=[D0])))
    obj.update(change)
    with pytest.raises(InvalidInputError, match="not a weenv template manifest"):
        parse_template_manifest(json.dumps(obj).encode())


def test_manifest_kind_from_the_media_type():
    assert manifest_kind(canonical_json(group())) == "group"
    assert manifest_kind(canonical_json(TemplateManifest(name="t", groups=[D0]))) == "template"
    for bad in (b"[1]", b"not json", b'{"media_type": "application/x"}', b"{}"):
        with pytest.raises(InvalidInputError):
            manifest_kind(bad)


# --- resources and runtime config --------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [
        {"cpus": 0},
        {"cpus": -1},
        {"cpus": float("nan")},
        {"cpus": float("inf")},
        {"cpus": MAX_CPUS * 2},
        {"memory_bytes": MIN_MEMORY_BYTES - 1},
        {"memory_bytes": MAX_MEMORY_BYTES + 1},
        {"pids": 0},
        {"pids": MAX_PIDS + 1},
        {"gpus": 1},
    ],
)
def test_resources_out_of_range_are_refused(fields):
    with pytest.raises(ValidationError):
        Resources(**fields)


def test_resources_at_their_bounds_are_accepted():
    r = Resources(cpus=MAX_CPUS, memory_bytes=MAX_MEMORY_BYTES, pids=MAX_PIDS)
    assert (r.cpus, r.memory_bytes, r.pids) == (MAX_CPUS, MAX_MEMORY_BYTES, MAX_PIDS)
    r = Resources(cpus=0.001, memory_bytes=MIN_MEMORY_BYTES, pids=1)
    assert (r.cpus, r.memory_bytes, r.pids) == (0.001, MIN_MEMORY_BYTES, 1)


@pytest.mark.parametrize(
    "fields",
    [
        {"command": []},
        {"command": ["a\0b"]},
        {"default_command": ["x\0"]},
        {"user": "root"},
        {"user": "1:x"},
        {"user": "-1"},
        {"user": "12345678901"},
        {"working_dir": "rel"},
        {"working_dir": "/a\0b"},
        {"env": {"": "1"}},
        {"env": {"A=B": "1"}},
        {"env": {"A": "x\0"}},
        {"extra": True},
    ],
)
def test_runtime_config_refuses_bad_fields(fields):
    with pytest.raises(ValidationError):
        RuntimeConfig(**fields)


@pytest.mark.parametrize("user", ["0", "0:0", "1000:100", "4294967295:4294967295"])
def test_runtime_config_accepts_numeric_users(user):
    assert RuntimeConfig(user=user).user == user
