"""A command's output log (:class:`weenv.node.runtime.process.OutputLog`): bounded
retention, readers that attach, close."""

from __future__ import annotations

from weenv.api.models import ProcessEvent
from weenv.node.runtime.process import OutputLog


def test_output_log_drops_unread_and_waits_for_readers():
    log = OutputLog(retain_bytes=10)
    for _ in range(5):
        log.append(ProcessEvent(type="stdout", data=b"12345"))
    assert log.dropped == 15
    r = log.attach()
    assert [e.data for e in log.read(r, 0)] == [b"12345", b"12345"]
    log.close()
    assert log.read(r, 0) is None
