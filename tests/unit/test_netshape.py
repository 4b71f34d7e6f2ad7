"""The benchmarks' far-away store model (weenv_bench.services.netshape): a real
proxy process in front of a real HTTP server on loopback, timed."""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest

from weenv_bench.services.netshape import Link, LinkModel, Shaper

BODY = bytes(range(256)) * 1024  # 256 KiB


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("content-length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args):
        pass


@pytest.fixture
def upstream():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _get_s(client: httpx.Client, url: str) -> float:
    t = time.monotonic()
    r = client.get(url)
    assert r.status_code == 200 and r.content == BODY
    return time.monotonic() - t


def test_each_answer_costs_the_latency_and_its_bytes_at_the_rate(upstream, tmp_path):
    model = LinkModel(latency_s=0.1, conn_bytes_per_s=1 << 20)  # 256 KiB at 1 MiB/s: 0.25 s
    with Shaper(upstream, model, tmp_path) as shaper, httpx.Client() as client:
        _get_s(client, upstream)  # warm
        direct = _get_s(client, upstream)
        times = [_get_s(client, shaper.endpoint) for _ in range(3)]  # one kept-alive connection
    assert direct < 0.05
    for s in times:
        assert 0.33 < s < 0.6, times  # 0.1 + 0.25, not 0.1 per piece
    assert shaper.proc is None


def test_the_total_rate_is_shared_by_connections(upstream, tmp_path):
    model = LinkModel(latency_s=0.0, total_bytes_per_s=2 << 20)  # two answers of 256 KiB at 2 MiB/s: 0.25 s
    with Shaper(upstream, model, tmp_path) as shaper:
        clients = [httpx.Client() for _ in range(2)]
        try:
            t = time.monotonic()
            threads = [threading.Thread(target=_get_s, args=(c, shaper.endpoint)) for c in clients]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            both = time.monotonic() - t
        finally:
            for c in clients:
                c.close()
        time.sleep(1.2)
        assert shaper.stats()["answer_bytes"] >= 2 * len(BODY)
    assert 0.22 < both < 0.6


def test_schedule_pipelines_pieces():
    link = Link(LinkModel(latency_s=1.0, conn_bytes_per_s=100.0))
    deliver, free = link.schedule(0.0, 100, 0.0)
    assert (deliver, free) == (2.0, 2.0)
    deliver, free = link.schedule(0.5, 100, free)  # left while the first was on its way: no second latency
    assert (deliver, free) == (3.0, 3.0)
    with pytest.raises(ValueError):
        LinkModel(conn_bytes_per_s=0)
