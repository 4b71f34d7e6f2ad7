"""E2B's PTY (``sandbox.pty``) driven by the official ``e2b`` SDK against a real
``weenv serve`` (issue 17): a real pseudo-terminal inside the sandbox (``tty``
names its ``/dev/pts``, ``stty size`` follows resize, line editing and Ctrl-C
work, input reaches the shell), connect to a running one, kill, the output
bound, bad sizes refused, and nothing left behind (processes in the sandbox,
terminal descriptors in the daemon).  The daemon fixture is test_e2b's (one
per module)."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from e2b import AsyncSandbox, CommandExitException, PtySize, Sandbox
from e2b.exceptions import InvalidArgumentException, SandboxException

from test_e2b import TEMPLATE, daemon  # noqa: F401  (the module's daemon fixture)


class Screen:
    """What a PTY wrote, read by a thread iterating its handle (the SDK's
    ``wait(on_pty=...)`` loop, with a way out: :meth:`leave`)."""

    def __init__(self, handle):
        self.handle = handle
        self.data = bytearray()
        self.lock = threading.Lock()
        self.result = None
        self.error: BaseException | None = None
        self._leave = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for _out, _err, pty in self.handle:
                if pty is not None:
                    self._add(pty)
                if self._leave.is_set():  # disconnect from the thread iterating the stream
                    self.handle.disconnect()
                    return
            self.result = self.handle.wait()  # the end event's result (or CommandExitException)
        except BaseException as exc:  # noqa: BLE001  # looked at by the test
            self.error = exc

    def leave(self, s: Sandbox) -> None:
        """Disconnect without killing: the next output (a newline typed) ends the loop."""
        self._leave.set()
        s.pty.send_stdin(self.handle.pid, b"\n")
        self.thread.join(20)
        assert not self.thread.is_alive()

    def _add(self, chunk: bytes) -> None:
        with self.lock:
            self.data += chunk

    def text(self) -> str:
        with self.lock:
            return self.data.decode(errors="replace")

    def expect(self, pattern: str, timeout: float = 20.0, start: int = 0) -> re.Match:
        """The first match of ``pattern`` in the output after offset ``start``."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern).search(self.text(), start)
            if m:
                return m
            assert time.monotonic() < deadline, f"no {pattern!r} in {self.text()[-2000:]!r}"
            time.sleep(0.05)

    def mark(self) -> int:
        return len(self.text())


def _daemon_tty_fds(daemon) -> list[str]:  # noqa: F811
    """The daemon's open descriptors that are terminals' masters."""
    pid = daemon.daemon.proc.pid
    out = []
    for n in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{n}")
        except OSError:
            continue
        if "ptmx" in link or "/dev/pts" in link:
            out.append(link)
    return out


def _procs(s: Sandbox) -> list[str]:
    """Command names of the sandbox's processes (but the one listing them)."""
    r = s.commands.run("for d in /proc/[0-9]*; do [ $$ = ${d#/proc/} ] || cat $d/comm 2>/dev/null; done", user="root")
    return [x for x in r.stdout.split() if x not in ("sh", "cat")]


def _shell(s: Sandbox, rows: int = 24, cols: int = 80, **kw) -> tuple:
    """A PTY shell of ``s`` that answered (its handle and its :class:`Screen`)."""
    h = s.pty.create(PtySize(rows=rows, cols=cols), timeout=kw.pop("timeout", 120), **kw)
    screen = Screen(h)
    s.pty.send_stdin(h.pid, b"echo up-$((1+2))\n")
    screen.expect(r"up-3")
    return h, screen


def _until_no_new_tty_fds(daemon, before: list[str]) -> None:  # noqa: F811
    deadline = time.monotonic() + 10
    while _daemon_tty_fds(daemon) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _daemon_tty_fds(daemon) == before


@pytest.fixture
def sandbox(daemon):  # noqa: F811
    s = Sandbox.create(TEMPLATE, timeout=180)
    yield s
    s.kill()


def test_pty_is_a_terminal_inside_that_resizes_edits_and_interrupts(sandbox):
    s = sandbox
    h = s.pty.create(PtySize(rows=24, cols=80), timeout=120)
    screen = Screen(h)
    s.pty.send_stdin(h.pid, b"tty; stty size; echo $((6*7))\n")
    screen.expect(r"/dev/pts/\d+")
    screen.expect(r"\b24 80\b")
    screen.expect(r"\b42\b")

    at = screen.mark()
    s.pty.resize(h.pid, PtySize(rows=40, cols=132))
    s.pty.send_stdin(h.pid, b"stty size\n")
    screen.expect(r"\b40 132\b", start=at)

    at = screen.mark()  # the terminal's line editing: a typo erased with DEL
    s.pty.send_stdin(h.pid, b"echo edXY\x7f\x7fited\n")
    screen.expect(r"edited\r\n", start=at)

    at = screen.mark()  # Ctrl-C interrupts the foreground job, not the shell
    s.pty.send_stdin(h.pid, b"sleep 100\n")
    time.sleep(0.5)
    t = time.monotonic()
    s.pty.send_stdin(h.pid, b"\x03")
    s.pty.send_stdin(h.pid, b"echo after-$((1+1))\n")
    screen.expect(r"after-2", start=at)
    assert time.monotonic() - t < 10

    at = screen.mark()  # a program that asks the terminal its size (tput) and sees it is one
    s.pty.send_stdin(h.pid, b"[ -t 0 ] && [ -t 1 ] && echo both-ttys; tput cols 2>/dev/null || stty size\n")
    screen.expect(r"both-ttys", start=at)
    screen.expect(r"\b132\b", start=at)

    s.pty.send_stdin(h.pid, b"exit 3\n")
    screen.thread.join(20)
    assert isinstance(screen.error, CommandExitException) and screen.error.exit_code == 3, screen.error


def test_pty_as_a_user_in_a_cwd_with_envs(sandbox):
    s = sandbox
    s.commands.run("mkdir -p /tmp/ptydir", user="root")
    h = s.pty.create(PtySize(rows=10, cols=50), cwd="/tmp/ptydir", envs={"PTYVAR": "v1"}, user="root", timeout=60)
    screen = Screen(h)
    s.pty.send_stdin(h.pid, b"echo $PTYVAR:$(pwd):$(id -u):$TERM\n")
    screen.expect(r"v1:/tmp/ptydir:0:xterm-256color")
    s.pty.send_stdin(h.pid, b"exit\n")
    screen.thread.join(20)
    assert screen.error is None and screen.result.exit_code == 0

    h = s.pty.create(PtySize(rows=10, cols=50), user="nobody", timeout=60)
    screen = Screen(h)
    s.pty.send_stdin(h.pid, b"echo me=$(id -un) owner=$(stat -c %U $(tty))\n")
    screen.expect(r"me=nobody owner=nobody")
    s.pty.kill(h.pid)
    screen.thread.join(20)


def test_connect_to_a_running_pty_and_kill_it_leaves_nothing(daemon, sandbox):  # noqa: F811
    s = sandbox
    before = _daemon_tty_fds(daemon)
    h, screen = _shell(s)
    s.pty.send_stdin(h.pid, b"sleep 1000 & echo started-$((2+3))\n")
    screen.expect(r"started-5")
    assert len(_daemon_tty_fds(daemon)) > len(before)
    screen.leave(s)

    again = s.pty.connect(h.pid, timeout=60)  # reconnect: what comes next arrives
    screen2 = Screen(again)
    s.pty.send_stdin(h.pid, b"echo back-$((3+4))\n")
    screen2.expect(r"back-7")
    assert "sleep" in _procs(s) and "bash" in _procs(s)

    assert s.pty.kill(h.pid) is True
    screen2.thread.join(20)
    assert isinstance(screen2.error, CommandExitException), screen2.error
    deadline = time.monotonic() + 10  # the shell and what it left running are gone
    while ("sleep" in (left := _procs(s)) or "bash" in left) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "sleep" not in left and "bash" not in left, left
    _until_no_new_tty_fds(daemon, before)
    assert s.pty.kill(h.pid) is False  # gone: not found


def test_destroying_the_sandbox_ends_its_pty(daemon):  # noqa: F811
    before = _daemon_tty_fds(daemon)
    s = Sandbox.create(TEMPLATE, timeout=120)
    _h, screen = _shell(s)
    s.kill()
    screen.thread.join(30)
    assert not screen.thread.is_alive() and isinstance(screen.error, SandboxException), screen.error
    _until_no_new_tty_fds(daemon, before)


def test_pty_output_is_bounded_like_command_output(daemon, sandbox):  # noqa: F811
    """A terminal writing 48 MiB to nobody: the daemon keeps its retained
    bytes (the oldest dropped, counted), not the whole output."""
    s = sandbox
    h, screen = _shell(s)
    screen.leave(s)
    rss = daemon.daemon.rss_peak_kib()
    s.pty.send_stdin(h.pid, b"head -c 50331648 /dev/zero | tr '\\0' x; echo; echo done-$((4*5))\n")
    with httpx.Client(base_url=daemon.daemon.url + "/v1", headers={"x-api-key": daemon.daemon.key}, timeout=30) as c:
        deadline = time.monotonic() + 90
        while True:
            info = c.get(f"/environments/{s.sandbox_id}/processes/{h.pid}").json()
            if info["output_dropped"] >= 40 << 20:
                break
            assert time.monotonic() < deadline, info
            time.sleep(0.5)
    assert daemon.daemon.rss_peak_kib() - rss < 32 << 10  # KiB: far below the 48 MiB written
    s.pty.kill(h.pid)


def test_bad_sizes_and_inputs_are_refused(sandbox):
    s = sandbox
    for rows, cols in ((0, 80), (24, 0), (24, 100_000), (100_000, 80)):
        with pytest.raises(InvalidArgumentException, match="PTY size"):
            s.pty.create(PtySize(rows=rows, cols=cols), timeout=30)
    h = s.pty.create(PtySize(rows=24, cols=80), timeout=60)
    screen = Screen(h)
    with pytest.raises(InvalidArgumentException, match="PTY size"):
        s.pty.resize(h.pid, PtySize(rows=0, cols=80))
    with pytest.raises(SandboxException, match="has a PTY"):  # stdin input to a terminal (as envd)
        s.commands.send_stdin(h.pid, "echo no\n")
    cmd = s.commands.run("cat", background=True, stdin=True)
    with pytest.raises(SandboxException, match="no PTY"):
        s.pty.send_stdin(cmd.pid, b"x")
    with pytest.raises(SandboxException, match="does not run on a terminal"):
        s.pty.resize(cmd.pid, PtySize(rows=24, cols=80))
    cmd.kill()
    s.pty.kill(h.pid)
    screen.thread.join(20)


def test_async_pty_on_data(daemon):  # noqa: F811
    async def main():
        s = await AsyncSandbox.create(TEMPLATE, timeout=120)
        try:
            got = bytearray()
            h = await s.pty.create(PtySize(rows=30, cols=100), on_data=got.extend, timeout=60)
            await s.pty.send_stdin(h.pid, b"stty size; exit 0\n")
            result = await h.wait()
            assert result.exit_code == 0
            assert b"30 100" in got
        finally:
            await s.kill()

    asyncio.run(main())


def test_streamed_input_reaches_a_pty_and_a_stdin(sandbox):
    """``stream_input`` (envd's client-streaming StreamInput): chunks in order."""
    s = sandbox
    h, screen = _shell(s)
    s.pty.stream_input(h.pid, [b"echo stre", "amed-", b"$((5*5))\n"])
    screen.expect(r"streamed-25")
    cmd = s.commands.run("cat", background=True, stdin=True)
    s.commands.stream_input(cmd.pid, ["one ", b"two\n"])
    s.commands.close_stdin(cmd.pid)
    assert cmd.wait().stdout == "one two\n"
    sleeper = s.commands.run("sleep 30", background=True)
    with pytest.raises(SandboxException, match="no PTY"):  # the same checks as SendInput's
        s.pty.stream_input(sleeper.pid, [b"x"])
    sleeper.kill()
    s.pty.kill(h.pid)
    screen.thread.join(20)
