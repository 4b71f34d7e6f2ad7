"""Byte-level formats weenv builds as data: overlay mount plans, FUSE protocol
structs, the Connect protocol's envelopes and error codes and the envd proto
messages the E2B endpoints speak."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from weenv.errors import ERROR_KINDS, InvalidInputError, MountError, NotFoundError
from weenv.host.mounts import MS_NODEV, MS_NOSUID, MS_RDONLY, erofs_spec, overlay_escape, overlay_spec
from weenv.node.data.fuse import protocol as fp
from weenv.server.e2b import connect
from weenv.server.e2b.proto import build, filesystem_pb, process_pb


# --- mount plans -----------------------------------------------------------------------------
def _unescape_split(text: str, sep: str, *, keep_escapes: bool = False) -> list[str]:
    """Split as the kernel does (at unescaped ``sep``), then drop the escapes."""
    parts, cur, i = [], "", 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            cur += text[i : i + 2] if keep_escapes else text[i + 1]
            i += 2
            continue
        if text[i] == sep:
            parts.append(cur)
            cur = ""
        else:
            cur += text[i]
        i += 1
    return parts + [cur]


def test_overlay_lists_the_top_group_first():
    spec = overlay_spec(["/g/base", "/g/deps", "/g/task"], "/e/upper", "/e/work", "/e/root")
    # nosuid,nodev on the host side: a setuid file or device node made inside is inert outside
    assert (spec.fstype, spec.source, spec.target, spec.flags) == (
        "overlay",
        "overlay",
        "/e/root",
        MS_NOSUID | MS_NODEV,
    )
    opts = dict(o.split("=", 1) for o in spec.options.split(","))
    assert opts == {"lowerdir": "/g/task:/g/deps:/g/base", "upperdir": "/e/upper", "workdir": "/e/work"}


@pytest.mark.parametrize("home", ["/h,ome", "/h:ome", "/h\\ome", "/a,b:c\\d,"])
def test_overlay_paths_with_separators_survive_the_kernels_split(home):
    lowers = [f"{home}/g1", f"{home}/g2"]
    spec = overlay_spec(lowers, Path(home) / "up", f"{home}/wk", f"{home}/root")
    options = _unescape_split(spec.options, ",")
    assert len(options) == 3, options
    parsed = dict(o.split("=", 1) for o in options)
    assert parsed["upperdir"] == f"{home}/up" and parsed["workdir"] == f"{home}/wk"
    lower_field = next(o for o in _unescape_split(spec.options, ",", keep_escapes=True) if o.startswith("lowerdir="))
    assert _unescape_split(lower_field.removeprefix("lowerdir="), ":") == lowers[::-1]


def test_overlay_escape_and_a_plan_without_lowers():
    assert overlay_escape("/plain/path") == "/plain/path"
    assert overlay_escape("a\\,b:c") == "a\\\\\\,b\\:c"
    with pytest.raises(MountError):
        overlay_spec([], "/u", "/w", "/t")


def test_an_erofs_plan_is_read_only_and_nodev():
    spec = erofs_spec(Path("/img/g.erofs"), Path("/mnt/g"))
    assert (spec.fstype, spec.source, spec.target) == ("erofs", "/img/g.erofs", "/mnt/g")
    assert spec.flags & MS_RDONLY and spec.flags & MS_NODEV and spec.flags & MS_NOSUID


# --- FUSE structs ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "s, size",
    [
        (fp.IN_HEADER, 40),
        (fp.OUT_HEADER, 16),
        (fp.INIT_OUT, 64),
        (fp.ATTR, 88),
        (fp.ENTRY_OUT, 40),
        (fp.ATTR_OUT, 16),
        (fp.OPEN_OUT, 16),
        (fp.READ_IN, 40),
        (fp.DIRENT, 24),
        (fp.KSTATFS, 80),
        (fp.NOTIFY_INVAL_INODE_OUT, 24),
    ],
)
def test_fuse_structs_have_the_kernels_sizes(s, size):
    assert s.size == size  # include/uapi/linux/fuse.h


def test_a_reply_is_a_header_and_payload_or_a_negative_errno():
    ok = fp.reply(42, b"payload")
    assert fp.OUT_HEADER.unpack(ok[0]) == (16 + 7, 0, 42) and ok[1] == b"payload"
    err = fp.reply(43, b"ignored", error=2)
    assert len(err) == 1 and fp.OUT_HEADER.unpack(err[0]) == (16, -2, 43)


def test_notifications_carry_their_code_and_unique_zero():
    assert fp.OUT_HEADER.unpack(fp.notify_resend()) == (16, fp.NOTIFY_RESEND, 0)
    head, body = fp.notify_inval_inode(9, 4096, -1)
    assert fp.OUT_HEADER.unpack(head) == (16 + 24, fp.NOTIFY_INVAL_INODE, 0)
    assert fp.NOTIFY_INVAL_INODE_OUT.unpack(body) == (9, 4096, -1)


@pytest.mark.parametrize("name", [b"a", b"1234567", b"12345678", b"x" * 255])
def test_dirents_are_padded_to_8_bytes(name):
    d = fp.dirent(5, 3, name, fp.DT_REG)
    assert len(d) % 8 == 0 and len(d) - (24 + len(name)) < 8
    assert fp.DIRENT.unpack(d[:24]) == (5, 3, len(name), fp.DT_REG) and d[24 : 24 + len(name)] == name
    assert d[24 + len(name) :] == b"\0" * (len(d) - 24 - len(name))


# --- Connect framing and errors ------------------------------------------------------------------
@pytest.mark.parametrize("payload", [b"", b"x", bytes(70000)])
def test_an_envelope_is_flags_and_a_big_endian_length(payload):
    env = connect.envelope(0x02, payload)
    assert env[0] == 0x02 and struct.unpack(">I", env[1:5])[0] == len(payload) and env[5:] == payload
    assert connect._unwrap(connect.envelope(0, payload)) == payload


@pytest.mark.parametrize(
    "body, code",
    [
        (b"", "invalid_argument"),
        (b"\0\0\0", "invalid_argument"),
        (connect.envelope(1, b"zz"), "unimplemented"),
        (connect.envelope(0, b"ab") + b"extra", "invalid_argument"),
        (connect.envelope(0, b"ab")[:-1], "invalid_argument"),
    ],
)
def test_a_bad_streaming_body_is_a_connect_error(body, code):
    with pytest.raises(connect.RpcError) as info:
        connect._unwrap(body)
    assert info.value.code == code


def test_weenv_errors_map_to_connect_codes_with_their_statuses():
    assert connect.as_rpc_error(NotFoundError("gone")).to_json() == {"code": "not_found", "message": "gone"}
    assert connect.as_rpc_error(InvalidInputError("bad")).code == "invalid_argument"
    for kind, cls in ERROR_KINDS.items():
        code = connect.as_rpc_error(cls("m")).code
        assert code in connect.CODE_STATUS and code == connect.KIND_CODES.get(kind, "internal")
    assert connect.as_rpc_error(RuntimeError("boom")).code == "internal"
    with pytest.raises(ValueError):
        connect.RpcError("no_such_code", "x")


@pytest.mark.parametrize(
    "content_type, name",
    [
        ("application/json", "json"),
        ("application/proto", "proto"),
        ("application/connect+json; charset=utf-8", None),
        ("Application/JSON", "json"),
        ("text/plain", None),
        ("application/xml", None),
    ],
)
def test_the_codec_follows_the_content_type(content_type, name):
    codec = connect._codec_of(content_type, "application/")
    assert (codec.name if codec else None) == name


def test_codecs_round_trip_a_message_and_refuse_garbage():
    msg = process_pb.ProcessConfig(cmd="/bin/sh", args=["-c", "echo hi"], envs={"A": "1"}, cwd="/w")
    for name in ("json", "proto"):
        codec = connect._Codec(name)
        assert codec.decode(codec.encode(msg), process_pb.ProcessConfig) == msg
    with pytest.raises(connect.RpcError, match="cannot decode"):
        connect._Codec("json").decode(b"{not json", process_pb.ProcessConfig)
    with pytest.raises(connect.RpcError):
        connect._Codec("proto").decode(b"\xff\xff\xff", process_pb.ProcessConfig)


# --- envd protos -------------------------------------------------------------------------------
def test_process_events_keep_their_oneofs_and_field_numbers():
    ev = process_pb.ProcessEvent(data=process_pb.ProcessEvent.DataEvent(stdout=b"out"))
    assert ev.WhichOneof("event") == "data" and ev.data.WhichOneof("output") == "stdout"
    wire = ev.SerializeToString()
    assert wire == b"\x12\x05\x0a\x03out"  # field 2 (data) holding field 1 (stdout)
    end = process_pb.ProcessEvent(end=process_pb.ProcessEvent.EndEvent(exit_code=-1, exited=True))
    assert process_pb.ProcessEvent.FromString(end.SerializeToString()).end.exit_code == -1  # sint32
    assert process_pb.Signal.Value("SIGNAL_SIGKILL") == 9


def test_optional_fields_know_whether_they_were_set():
    cfg = process_pb.ProcessConfig(cmd="x")
    assert not cfg.HasField("cwd")
    cfg.cwd = ""
    assert cfg.HasField("cwd")
    assert filesystem_pb.DESCRIPTOR.package == "filesystem"


def test_the_proto_subset_parser_refuses_what_it_does_not_know():
    with pytest.raises(SyntaxError):
        build("package t; message M { string x 1; }", "weenv/test/bad.proto")
