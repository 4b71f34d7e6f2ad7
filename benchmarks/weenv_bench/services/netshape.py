"""A far-away store, modelled: a TCP proxy on loopback that adds a latency to
every answer and bounds its bandwidth, for benchmarks (``weenv bench cluster``).

The model (:class:`LinkModel`), applied to the bytes the upstream (the store)
sends back; what the client sends goes through at once:

- ``latency_s``: every piece of an answer is delivered no earlier than
  ``latency_s`` after it left the upstream.  Pieces are pipelined, so one
  request-answer exchange costs ``latency_s`` more than on loopback (a
  store's time to first byte: tens of ms for S3 or a registry in another
  zone), however long the answer;
- ``conn_bytes_per_s``: one connection's answers at most this fast (S3 and
  registries cap one GET's throughput; a client opens several connections
  to go faster); None: no bound;
- ``total_bytes_per_s``: all connections together at most this fast (the
  store's egress, or the cluster's link to it, shared by every node); None:
  no bound.

Bytes are delivered in arrival order per connection at
``max(left + latency, when the connection's and the link's earlier bytes have
gone) + size / rate``.  The proxy buffers what the upstream sends ahead of the
model (no back-pressure: fine for answers of a few MiB).

Run as a process of its own (its own interpreter lock, beside the nodes it
serves): ``python -m weenv_bench.services.netshape --upstream HOST:PORT
--latency-ms 20 --conn-mib-s 64 --total-mib-s 128 --port-file PATH``; it
writes the port it listens on (127.0.0.1) to ``PATH`` once it accepts, and
its counters (answers' bytes, connections) to ``PATH.stats`` as JSON on
SIGTERM and every second.  :class:`Shaper` starts and stops one
(:mod:`weenv_bench.services.process`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from weenv_bench.services import process

PIECE = 64 << 10
"""Bytes read from the upstream at a time (the model's unit of delivery)."""


@dataclass(frozen=True)
class LinkModel:
    """The modelled link to the store (see the module docstring).  Rates in bytes/s."""

    latency_s: float = 0.0
    conn_bytes_per_s: float | None = None
    total_bytes_per_s: float | None = None

    def __post_init__(self):
        if self.latency_s < 0 or any(r is not None and r <= 0 for r in (self.conn_bytes_per_s, self.total_bytes_per_s)):
            raise ValueError("a link model wants latency >= 0 and rates > 0 (None: no bound)")

    def describe(self) -> dict:
        """The model as JSON for a report (MiB/s, ms)."""
        mib = 1 << 20
        return {
            "latency_ms": self.latency_s * 1000,
            "conn_mib_s": None if self.conn_bytes_per_s is None else self.conn_bytes_per_s / mib,
            "total_mib_s": None if self.total_bytes_per_s is None else self.total_bytes_per_s / mib,
        }


class Link:
    """The shared state of the modelled link: when its earlier bytes have gone (monotonic s)."""

    def __init__(self, model: LinkModel):
        self.model = model
        self.free_at = 0.0
        self.bytes = 0
        self.connections = 0

    def schedule(self, left: float, n: int, conn_free: float) -> tuple[float, float]:
        """When ``n`` bytes that left the upstream at ``left`` are delivered, and
        when the connection is free again: ``(deliver_at, conn_free)``."""
        m = self.model
        start = max(left + m.latency_s, conn_free)
        conn_end = start + (n / m.conn_bytes_per_s if m.conn_bytes_per_s else 0.0)
        deliver = conn_end
        if m.total_bytes_per_s:
            link_start = max(start, self.free_at)
            self.free_at = link_start + n / m.total_bytes_per_s
            deliver = max(deliver, self.free_at)
        self.bytes += n
        return deliver, conn_end


async def _pipe_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(PIECE):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _pipe_down(link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        try:
            while data := await reader.read(PIECE):
                queue.put_nowait((loop.time(), data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait(None)

    reading = asyncio.create_task(read())
    conn_free = 0.0
    try:
        while (item := await queue.get()) is not None:
            left, data = item
            deliver, conn_free = link.schedule(left, len(data), conn_free)
            wait = deliver - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass
    finally:
        reading.cancel()
        writer.close()


async def serve(model: LinkModel, upstream: tuple[str, int], port_file: Path) -> None:
    link = Link(model)

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*upstream)
        except OSError:
            c_writer.close()
            return
        link.connections += 1
        await asyncio.gather(_pipe_up(c_reader, s_writer), _pipe_down(link, s_reader, c_writer))
        s_writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    stats = Path(str(port_file) + ".stats")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(port))
    os.replace(tmp, port_file)

    def dump() -> None:
        stats.write_text(
            json.dumps(
                {"answer_bytes": link.bytes, "connections": link.connections, "model": asdict(model), "at": time.time()}
            )
        )

    async with server:
        while not stop.is_set():
            dump()
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
        dump()


class Shaper:
    """A netshape process in front of ``upstream`` (``http://HOST:PORT``), files under ``root``.
    Use as a context manager; :attr:`endpoint` is the shaped address."""

    def __init__(self, upstream: str, model: LinkModel, root: Path):
        host, _, port = upstream.split("://", 1)[-1].rstrip("/").rpartition(":")
        self.upstream = (host, int(port))
        self.model = model
        self.root = Path(root)
        self.port_file = self.root / "netshape.port"
        self.log = self.root / "netshape.log"
        self.proc = None
        self.port: int | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        """The proxy's counters (last written; {} before)."""
        try:
            return json.loads(Path(str(self.port_file) + ".stats").read_text())
        except (OSError, ValueError):
            return {}

    def start(self) -> Shaper:
        m = self.model
        argv = [
            sys.executable,
            "-m",
            "weenv_bench.services.netshape",
            "--upstream",
            f"{self.upstream[0]}:{self.upstream[1]}",
            "--port-file",
            str(self.port_file),
            "--latency-ms",
            str(m.latency_s * 1000),
        ]
        if m.conn_bytes_per_s:
            argv += ["--conn-mib-s", str(m.conn_bytes_per_s / (1 << 20))]
        if m.total_bytes_per_s:
            argv += ["--total-mib-s", str(m.total_bytes_per_s / (1 << 20))]
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc = process.spawn(argv, self.log, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            process.wait_ready(self.proc, self.port_file.exists, what="netshape", log=self.log, timeout=20)
        except BaseException:
            self.stop()
            raise
        self.port = int(self.port_file.read_text())
        return self

    def stop(self) -> None:
        """SIGTERM by PID (it writes its counters), SIGKILL after 5 s; reaped.  Idempotent."""
        if self.proc is None:
            return
        try:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        finally:
            self.proc = None

    def __enter__(self) -> Shaper:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="netshape", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="HOST:PORT")
    p.add_argument("--port-file", required=True, type=Path)
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--conn-mib-s", type=float, default=None)
    p.add_argument("--total-mib-s", type=float, default=None)
    a = p.parse_args(argv)
    host, _, port = a.upstream.rpartition(":")
    mib = 1 << 20
    model = LinkModel(
        a.latency_ms / 1000,
        a.conn_mib_s * mib if a.conn_mib_s else None,
        a.total_mib_s * mib if a.total_mib_s else None,
    )
    asyncio.run(serve(model, (host, int(port)), a.port_file))


if __name__ == "__main__":
    main()
