"""The protobuf messages of E2B's in-sandbox services (envd), built at import time.

The two services the ``e2b`` SDK calls inside a sandbox, ``process.Process`` and
``filesystem.Filesystem``, are defined in E2B's public ``spec/envd/process/process.proto``
and ``spec/envd/filesystem/filesystem.proto`` (github.com/e2b-dev/E2B).  The
schemas below restate the subset weenv serves, with the same packages, message
names, field names, numbers and types (the wire contract), in proto3 syntax.

No ``protoc`` step: :func:`build` parses that small proto3 subset (messages,
nested messages, enums, ``oneof``, ``optional``, ``repeated``, ``map<K, V>``,
message-typed fields, ``google.protobuf.Timestamp``) into a
``FileDescriptorProto`` and lets Google's ``protobuf`` runtime make the message
classes in a private descriptor pool, so binary and proto3-JSON encoding
(``json_format``) come from the protobuf library itself.

Use: ``process_pb.StartRequest``, ``filesystem_pb.EntryInfo`` ... (attributes of
:data:`process_pb` and :data:`filesystem_pb`, nested types as ``Outer.Inner``).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    message_factory,
    timestamp_pb2,
)

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "double": _F.TYPE_DOUBLE,
    "float": _F.TYPE_FLOAT,
    "int64": _F.TYPE_INT64,
    "uint64": _F.TYPE_UINT64,
    "int32": _F.TYPE_INT32,
    "uint32": _F.TYPE_UINT32,
    "sint32": _F.TYPE_SINT32,
    "sint64": _F.TYPE_SINT64,
    "bool": _F.TYPE_BOOL,
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
}

PROCESS_PROTO = """
// process.Process: commands inside the sandbox.
package process;

enum Signal { SIGNAL_UNSPECIFIED = 0; SIGNAL_SIGTERM = 15; SIGNAL_SIGKILL = 9; }

message PTY {
  message Size { uint32 cols = 1; uint32 rows = 2; }
  Size size = 1;
}
message ProcessConfig {
  string cmd = 1;
  repeated string args = 2;
  map<string, string> envs = 3;
  optional string cwd = 4;
}
message ProcessSelector { oneof selector { uint32 pid = 1; string tag = 2; } }
message ProcessInfo { ProcessConfig config = 1; uint32 pid = 2; optional string tag = 3; }
message ProcessInput { oneof input { bytes stdin = 1; bytes pty = 2; } }

message ProcessEvent {
  message StartEvent { uint32 pid = 1; }
  message DataEvent { oneof output { bytes stdout = 1; bytes stderr = 2; bytes pty = 3; } }
  message EndEvent { sint32 exit_code = 1; bool exited = 2; string status = 3; optional string error = 4; }
  message KeepAlive {}
  oneof event { StartEvent start = 1; DataEvent data = 2; EndEvent end = 3; KeepAlive keepalive = 4; }
}

message ListRequest {}
message ListResponse { repeated ProcessInfo processes = 1; }
message StartRequest { ProcessConfig process = 1; optional PTY pty = 2; optional string tag = 3; optional bool stdin = 4; }
message StartResponse { ProcessEvent event = 1; }
message ConnectRequest { ProcessSelector process = 1; }
message ConnectResponse { ProcessEvent event = 1; }
message UpdateRequest { ProcessSelector process = 1; optional PTY pty = 2; }
message UpdateResponse {}
message SendInputRequest { ProcessSelector process = 1; ProcessInput input = 2; }
message SendInputResponse {}
message StreamInputRequest {
  message StartEvent { ProcessSelector process = 1; }
  message DataEvent { ProcessInput input = 2; }
  message KeepAlive {}
  oneof event { StartEvent start = 1; DataEvent data = 2; KeepAlive keepalive = 3; }
}
message StreamInputResponse {}
message SendSignalRequest { ProcessSelector process = 1; Signal signal = 2; }
message SendSignalResponse {}
message CloseStdinRequest { ProcessSelector process = 1; }
message CloseStdinResponse {}
"""

FILESYSTEM_PROTO = """
// filesystem.Filesystem: the sandbox's files (contents go over envd's HTTP /files).
package filesystem;

enum FileType { FILE_TYPE_UNSPECIFIED = 0; FILE_TYPE_FILE = 1; FILE_TYPE_DIRECTORY = 2; FILE_TYPE_SYMLINK = 3; }
enum EventType {
  EVENT_TYPE_UNSPECIFIED = 0; EVENT_TYPE_CREATE = 1; EVENT_TYPE_WRITE = 2;
  EVENT_TYPE_REMOVE = 3; EVENT_TYPE_RENAME = 4; EVENT_TYPE_CHMOD = 5;
}

message EntryInfo {
  string name = 1;
  FileType type = 2;
  string path = 3;
  int64 size = 4;
  uint32 mode = 5;
  string permissions = 6;
  string owner = 7;
  string group = 8;
  google.protobuf.Timestamp modified_time = 9;
  optional string symlink_target = 10;
  map<string, string> metadata = 11;
  bool is_symlink = 12;
}

message StatRequest { string path = 1; }
message StatResponse { EntryInfo entry = 1; }
message MakeDirRequest { string path = 1; }
message MakeDirResponse { EntryInfo entry = 1; }
message MoveRequest { string source = 1; string destination = 2; }
message MoveResponse { EntryInfo entry = 1; }
message ListDirRequest { string path = 1; uint32 depth = 2; }
message ListDirResponse { repeated EntryInfo entries = 1; }
message RemoveRequest { string path = 1; }
message RemoveResponse {}
message WatchDirRequest { string path = 1; bool recursive = 2; bool include_entry = 3; bool allow_network_mounts = 4; }
message CreateWatcherRequest { string path = 1; bool recursive = 2; bool include_entry = 3; bool allow_network_mounts = 4; }
message CreateWatcherResponse { string watcher_id = 1; }
message FilesystemEvent { string name = 1; EventType type = 2; optional EntryInfo entry = 3; }
message WatchDirResponse {
  message StartEvent {}
  message KeepAlive {}
  oneof event { StartEvent start = 1; FilesystemEvent filesystem = 2; KeepAlive keepalive = 3; }
}
message GetWatcherEventsRequest { string watcher_id = 1; }
message GetWatcherEventsResponse { repeated FilesystemEvent events = 1; }
message RemoveWatcherRequest { string watcher_id = 1; }
message RemoveWatcherResponse {}
"""

_TOKEN = re.compile(r"//[^\n]*|[A-Za-z_][\w.]*|\d+|[{}<>;=,]")


class _Parser:
    """A recursive-descent parser of the proto3 subset used above."""

    def __init__(self, text: str, file: descriptor_pb2.FileDescriptorProto):
        self.toks = [t for t in _TOKEN.findall(text) if not t.startswith("//")]
        self.i = 0
        self.file = file

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expect: str | None = None) -> str:
        tok = self.toks[self.i]
        if expect is not None and tok != expect:
            raise SyntaxError(f"proto: expected {expect!r}, got {tok!r} (token {self.i})")
        self.i += 1
        return tok

    def parse(self) -> None:
        while self.peek() is not None:
            kw = self.take()
            if kw == "package":
                self.file.package = self.take()
                self.take(";")
            elif kw == "message":
                self.message(self.file.message_type.add(), self.file.package)
            elif kw == "enum":
                self.enum(self.file.enum_type.add())
            else:
                raise SyntaxError(f"proto: unexpected {kw!r}")

    def enum(self, e: descriptor_pb2.EnumDescriptorProto) -> None:
        e.name = self.take()
        self.take("{")
        while self.peek() != "}":
            v = e.value.add(name=self.take())
            self.take("=")
            v.number = int(self.take())
            self.take(";")
        self.take("}")

    def message(self, m: descriptor_pb2.DescriptorProto, scope: str) -> None:
        m.name = self.take()
        full = f"{scope}.{m.name}"
        self.take("{")
        while self.peek() != "}":
            tok = self.peek()
            if tok == "message":
                self.take()
                self.message(m.nested_type.add(), full)
            elif tok == "enum":
                self.take()
                self.enum(m.enum_type.add())
            elif tok == "oneof":
                self.take()
                index = len(m.oneof_decl)
                m.oneof_decl.add(name=self.take())
                self.take("{")
                while self.peek() != "}":
                    self.field(m, oneof_index=index)
                self.take("}")
            else:
                self.field(m)
        self.take("}")

    def field(self, m: descriptor_pb2.DescriptorProto, oneof_index: int | None = None) -> None:
        label, optional = _F.LABEL_OPTIONAL, False
        if self.peek() in ("repeated", "optional"):
            optional = self.take() == "optional"
            label = _F.LABEL_OPTIONAL if optional else _F.LABEL_REPEATED
        typ = self.take()
        if typ == "map":
            self.take("<")
            key = self.take()
            self.take(",")
            value = self.take()
            self.take(">")
            name = self.take()
            entry = m.nested_type.add(name="".join(p.title() for p in name.split("_")) + "Entry")
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL, type=_SCALARS[key], json_name="key")
            self._typed(entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL, json_name="value"), value)
            f = m.field.add(name=name, label=_F.LABEL_REPEATED, type=_F.TYPE_MESSAGE, type_name=entry.name)
        else:
            name = self.take()
            f = m.field.add(name=name, label=label)
            self._typed(f, typ)
        self.take("=")
        f.number = int(self.take())
        self.take(";")
        f.json_name = _camel(name)
        if oneof_index is not None:
            f.oneof_index = oneof_index
        elif optional:  # proto3 `optional`: a synthetic one-field oneof, declared last
            f.proto3_optional = True
            f.oneof_index = len(m.oneof_decl)
            m.oneof_decl.add(name=f"_{name}")

    @staticmethod
    def _typed(f: descriptor_pb2.FieldDescriptorProto, typ: str) -> None:
        if typ in _SCALARS:
            f.type = _SCALARS[typ]
        else:  # a message or enum, resolved by the pool relative to the scope
            f.type_name = typ


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _fix_synthetic_oneofs(m: descriptor_pb2.DescriptorProto) -> None:
    """protobuf requires synthetic (proto3 ``optional``) oneofs after the real ones."""
    real = [i for i, o in enumerate(m.oneof_decl) if not o.name.startswith("_")]
    synthetic = [i for i, o in enumerate(m.oneof_decl) if o.name.startswith("_")]
    order = real + synthetic
    if order != list(range(len(order))):
        remap = {old: new for new, old in enumerate(order)}
        decls = [descriptor_pb2.OneofDescriptorProto(name=m.oneof_decl[i].name) for i in order]
        del m.oneof_decl[:]
        m.oneof_decl.extend(decls)
        for f in m.field:
            if f.HasField("oneof_index"):
                f.oneof_index = remap[f.oneof_index]
    for nested in m.nested_type:
        _fix_synthetic_oneofs(nested)


def _resolve_enum_kinds(file: descriptor_pb2.FileDescriptorProto) -> None:
    """Mark fields naming an enum of this file as TYPE_ENUM, the others TYPE_MESSAGE."""
    enums = {e.name for e in file.enum_type}

    def visit(m: descriptor_pb2.DescriptorProto) -> None:
        local = enums | {e.name for e in m.enum_type}
        for f in m.field:
            if f.type_name and not f.type:
                f.type = _F.TYPE_ENUM if f.type_name in local else _F.TYPE_MESSAGE
        for nested in m.nested_type:
            visit(nested)

    for m in file.message_type:
        visit(m)


_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)


def build(text: str, filename: str) -> SimpleNamespace:
    """Message and enum classes of the proto3 ``text`` (see the module docstring),
    registered in this module's private pool as ``filename``.

    Returns a namespace: ``ns.Message`` for each top-level message (nested ones
    are attributes of their parent class: ``ns.ProcessEvent.StartEvent``),
    ``ns.Enum`` as the enum's ``EnumTypeWrapper`` (``.Value(name)``), and
    ``ns.DESCRIPTOR`` (the ``FileDescriptor``).  Raises ``SyntaxError`` for text
    outside the subset.
    """
    file = descriptor_pb2.FileDescriptorProto(name=filename, syntax="proto3")
    _Parser(text, file).parse()
    if "google.protobuf.Timestamp" in text:
        file.dependency.append(timestamp_pb2.DESCRIPTOR.name)
    _resolve_enum_kinds(file)
    for m in file.message_type:
        _fix_synthetic_oneofs(m)
    fd = _POOL.Add(file) or _POOL.FindFileByName(filename)
    from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

    ns = SimpleNamespace(DESCRIPTOR=fd)
    for name, desc in fd.message_types_by_name.items():
        setattr(ns, name, message_factory.GetMessageClass(desc))
    for name, desc in fd.enum_types_by_name.items():
        setattr(ns, name, EnumTypeWrapper(desc))
    return ns


process_pb = build(PROCESS_PROTO, "weenv/e2b/envd/process.proto")
filesystem_pb = build(FILESYSTEM_PROTO, "weenv/e2b/envd/filesystem.proto")
