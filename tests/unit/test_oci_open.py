"""An ``oci://`` store opened with ``check=False`` (a node's): opening sends
nothing, so a daemon starts while its registry is down; the first operation
checks the registry (issue 13, finding 13).  Loopback only, no registry needed."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

from weenv.errors import StoreUnavailableError
from weenv.store import open_store

FAST = "connect_timeout=1&read_timeout=1&timeout=2&retries=1&backoff=0.01&probe_interval=0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unchecked_store_opens_while_nothing_listens_and_its_first_operation_fails_clearly():
    url = f"oci://127.0.0.1:{_free_port()}/repo?{FAST}"
    with pytest.raises(StoreUnavailableError, match="opening the store.*ConnectError"):
        open_store(url)  # checked (the default): fails at once
    started = time.monotonic()
    store = open_store(url, check=False)
    try:
        assert time.monotonic() - started < 0.5 and store.stats().requests == 0
        with pytest.raises(StoreUnavailableError, match="reading manifest template-task .*ConnectError"):
            store.resolve("templates", "task")
    finally:
        store.close()


def test_an_unchecked_store_refuses_a_server_that_is_not_a_registry_at_its_first_operation():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        store = open_store(f"oci://127.0.0.1:{server.server_address[1]}/repo?{FAST}", check=False)
        try:
            with pytest.raises(StoreUnavailableError, match="not an OCI registry"):
                store.resolve("templates", "task")
        finally:
            store.close()
    finally:
        server.shutdown()
        server.server_close()
