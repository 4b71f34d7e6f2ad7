"""A real ``weenv serve`` on loopback for the server and SDK tests.

:func:`start_daemon` runs ``python -m weenv serve --port 0`` as a subprocess
with its own ``WEENV_HOME`` (and the given store), waits for the TCP URL it
writes to ``run/api-url``; :meth:`Daemon.stop` stops it by its pid (SIGTERM)
and checks that it left nothing: no mount under its home, no runc container,
no cgroup of an environment the tests saw.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from weenv.config import Paths

CACHE = Path(os.environ.get("WEENV_CACHE", "/var/cache/weenv"))


class Daemon:
    def __init__(self, home: Path, proc: subprocess.Popen, url: str, key: str):
        self.home = home
        self.paths = Paths(home=home, cache=CACHE, store_url="")
        self.proc = proc
        self.url = url
        self.key = key
        self.ids: set[str] = set()
        """Environment ids the tests saw: checked for leftover cgroups at stop."""

    def http(self, key: str | None = "default", **kw) -> httpx.Client:
        headers = {} if key is None else {"x-api-key": self.key if key == "default" else key}
        headers.update(kw.pop("headers", {}))
        return httpx.Client(base_url=self.url + "/v1", headers=headers, timeout=kw.pop("timeout", 300), **kw)

    def unix_http(self) -> httpx.Client:
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.paths.socket)), base_url="http://weenv/v1", timeout=300
        )

    def track(self, *ids: str) -> None:
        self.ids.update(ids)

    def rss_peak_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")

    def log(self) -> str:
        return (self.home / "serve.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"weenv serve (pid {self.proc.pid}) ignored SIGTERM:\n{self.log()}") from None
        assert self.proc.returncode == 0, f"weenv serve exited {self.proc.returncode}:\n{self.log()}"
        with open("/proc/mounts") as f:
            left = [line.split()[1] for line in f if line.split()[1].startswith(str(self.home))]
        assert not left, f"mounts left: {left}"
        for runtime in ("runc", "crun"):  # each OCI runtime's state root in the home
            root = self.home / "run" / runtime
            if root.exists():
                out = subprocess.run([runtime, "--root", str(root), "list", "-q"], capture_output=True, text=True)
                assert out.stdout.strip() == "", f"{runtime} containers left: {out.stdout}"
        cgroups = [str(p) for i in self.ids for p in Path("/sys/fs/cgroup").glob(f"*/weenv-{i}")]
        assert not cgroups, f"cgroups left: {cgroups}"
        assert not self.paths.socket.exists()


def start_daemon(home: Path, store_url: str, *args: str, nofile: int | None = None) -> Daemon:
    """Start ``weenv serve --port 0 ARGS`` over ``store_url`` with home ``home``;
    ``nofile``: the soft RLIMIT_NOFILE it inherits (as a service manager's 1,024)."""

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, WEENV_HOME=str(home), WEENV_STORE=store_url, WEENV_CACHE=str(CACHE))
    env.pop("WEENV_API_URL", None)
    env.pop("WEENV_API_KEY", None)
    with open(home / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weenv", "serve", "--port", "0", *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
            preexec_fn=limit if nofile is not None else None,
        )
    url_file = home / "run" / "api-url"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"weenv serve exited {proc.returncode}:\n{(home / 'serve.log').read_text()}")
        if url_file.exists() and url_file.read_text().endswith("\n"):
            url = url_file.read_text().strip()
            try:
                if httpx.get(url + "/v1/health", timeout=2).status_code == 200:
                    key = (home / "run" / "api-key").read_text().strip()
                    return Daemon(home, proc, url, key)
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise AssertionError(f"weenv serve did not answer in 60 s:\n{(home / 'serve.log').read_text()}")


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set environment variables (``E2B_API_URL``...) for the block, then put back what was there."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def point_sdk_at(daemon: Daemon, monkeypatch) -> Daemon:
    """Point the SDK (``WEENV_API_URL``, ``WEENV_API_KEY``) at ``daemon`` over TCP for one test."""
    monkeypatch.setenv("WEENV_API_URL", daemon.url)
    monkeypatch.setenv("WEENV_API_KEY", daemon.key)
    return daemon
