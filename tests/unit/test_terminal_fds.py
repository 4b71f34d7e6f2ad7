"""Which descriptors the node accepts from the exec agent as a terminal's master
(:func:`weenv.node.runtime.agent.client.is_terminal_master`): the agent runs inside the
environment, so a descriptor it sends is checked before the node reads it."""

from __future__ import annotations

import os
import socket

from weenv.node.runtime.agent.client import is_terminal_master


def test_only_a_pseudo_terminal_master_is_taken_for_one(tmp_path):
    master, slave = os.openpty()
    r, w = os.pipe()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fifo_fd = os.open(fifo, os.O_RDWR)
    a, b = socket.socketpair()
    regular = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    try:
        assert is_terminal_master(master)
        for fd in (slave, r, w, fifo_fd, a.fileno(), regular):
            assert not is_terminal_master(fd)
    finally:
        for fd in (master, slave, r, w, fifo_fd, regular):
            os.close(fd)
        a.close()
        b.close()
