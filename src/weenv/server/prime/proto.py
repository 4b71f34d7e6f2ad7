"""The protobuf messages of the prime-sandboxes command service, built at import time.

The ``prime-sandboxes`` client runs a command as one server-streaming Connect
call, ``command_session.CommandSession/Start``, in binary protobuf.  The
schema below restates the subset weenv serves (``Start`` and ``Connect``, the
streams of start, data, end and keepalive events; ``SendInput`` and
``SendSignal`` for a live process, named by its session) with the client's package, message
names, field names, numbers and types: the wire contract.  Built as E2B's
envd schemas are (:func:`weenv.server.e2b.proto.build`, no ``protoc`` step).
"""

from __future__ import annotations

from weenv.server.e2b.proto import build

COMMAND_SESSION_PROTO = """
// command_session.CommandSession: one command inside the sandbox, its output streamed.
package command_session;

message PTY {
  message Size { uint32 cols = 1; uint32 rows = 2; }
  Size size = 1;
}
message CommandSpec {
  string cmd = 1;
  repeated string args = 2;
  map<string, string> envs = 3;
  optional string cwd = 4;
  optional string user = 5;
}
message CommandSessionEvent {
  message StartEvent { uint32 pid = 1; }
  message DataEvent { oneof output { bytes stdout = 1; bytes stderr = 2; bytes pty = 3; } }
  message EndEvent { sint32 exit_code = 1; bool exited = 2; string status = 3; optional string error = 4; }
  message KeepAlive {}
  oneof event { StartEvent start = 1; DataEvent data = 2; EndEvent end = 3; KeepAlive keepalive = 4; }
}
enum Signal { SIGNAL_UNSPECIFIED = 0; SIGNAL_SIGTERM = 15; SIGNAL_SIGKILL = 9; }
message CommandSessionSelector { oneof selector { uint32 pid = 1; string session_uuid = 3; } }
message CommandInput { oneof input { bytes stdin = 1; bytes pty = 2; } }
message StartRequest { CommandSpec command = 1; optional PTY pty = 2; optional bool stdin = 4; optional string session_uuid = 5; }
message StartResponse { CommandSessionEvent event = 1; }
message ConnectRequest { CommandSessionSelector session = 1; }
message ConnectResponse { CommandSessionEvent event = 1; }
message SendInputRequest { CommandSessionSelector session = 1; CommandInput input = 2; optional string input_uuid = 3; }
message SendInputResponse {}
message SendSignalRequest { CommandSessionSelector session = 1; Signal signal = 2; optional string signal_uuid = 3; }
message SendSignalResponse {}
"""

command_pb = build(COMMAND_SESSION_PROTO, "weenv/prime/command_session.proto")
