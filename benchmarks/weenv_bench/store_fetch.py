"""Chunk fetch from a loopback OCI registry (``oci://``) and a loopback S3 server
(``s3://``, SeaweedFS) against the file store.

Input: real bytes, the files under ``/usr/lib/x86_64-linux-gnu`` (shared
libraries, data) concatenated and cut into 1 MiB chunks (``--chunks``, default
128), stored once in a :class:`~weenv.store.file.FileStore` and copied frame for
frame into an :class:`~weenv.store.oci.OciStore` on a docker-registry started
here (:mod:`weenv_bench.services.registry`) and an :class:`~weenv.store.s3.S3Store`
on a SeaweedFS started here (:mod:`weenv_bench.services.seaweedfs`).  Both stores' files are in the page
cache (each chunk is read once before timing), so the numbers compare the
access paths, not the disk.

Measured per store, for ``get_chunk(digest, stored_digest=...)`` (the node's
call, verified and decompressed): latency of one fetch at a time (p50, p99, ms)
and plaintext throughput (MiB/s) with 1 and ``--threads`` (default 8) fetchers.

Run: ``python -m weenv_bench.store_fetch [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from weenv.formats.manifest import ChunkRef
from weenv.store.base import Store
from weenv.store.file import FileStore
from weenv.store.oci import OciStore
from weenv.store.s3 import S3Store
from weenv_bench import machine
from weenv_bench.services.registry import Registry
from weenv_bench.services.seaweedfs import CREDENTIALS, Seaweed

MIB = 1 << 20
SOURCE = Path("/usr/lib/x86_64-linux-gnu")


def real_chunks(count: int, source: Path = SOURCE) -> list[bytes]:
    """``count`` 1 MiB chunks of the concatenated regular files under ``source``."""
    chunks, buf = [], bytearray()
    for dirpath, _dirs, files in sorted(os.walk(source)):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            try:
                with open(path, "rb") as f:
                    buf += f.read()
            except OSError:
                continue
            while len(buf) >= MIB:
                chunks.append(bytes(buf[:MIB]))
                del buf[:MIB]
                if len(chunks) == count:
                    return chunks
    raise SystemExit(f"only {len(chunks)} MiB under {source}")


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(store: Store, refs: list[ChunkRef], threads: int) -> dict:
    """Latency (one at a time) and throughput (1 and ``threads`` fetchers) of ``store``."""
    for r in refs:  # warm: page cache on both sides, connections open
        store.get_chunk(r.digest, stored_digest=r.stored_digest)
    latencies = []
    started = time.perf_counter()
    for r in refs:
        t = time.perf_counter()
        store.get_chunk(r.digest, stored_digest=r.stored_digest)
        latencies.append(time.perf_counter() - t)
    sequential = time.perf_counter() - started
    plaintext = sum(r.size for r in refs)
    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        list(pool.map(lambda r: store.get_chunk(r.digest, stored_digest=r.stored_digest), refs))
        parallel = time.perf_counter() - started
    return {
        "latency_p50_ms": round(statistics.median(latencies) * 1e3, 3),
        "latency_p99_ms": round(_percentile(latencies, 0.99) * 1e3, 3),
        "throughput_1_mib_s": round(plaintext / MIB / sequential, 1),
        f"throughput_{threads}_mib_s": round(plaintext / MIB / parallel, 1),
    }


def run(count: int, threads: int) -> dict:
    chunks = real_chunks(count)
    os.environ.update(CREDENTIALS)  # the S3 server's, as a user sets them
    with (
        tempfile.TemporaryDirectory(prefix="weenv-bench-store-") as tmp,
        Registry(Path(tmp) / "registry") as reg,
        Seaweed(Path(tmp) / "seaweedfs") as s3_server,
    ):
        file_store = FileStore(Path(tmp) / "store")
        refs = [file_store.put_chunk(c)[0] for c in chunks]
        remote = {"oci": OciStore(f"oci://{reg.address}/bench/chunks"), "s3": S3Store(s3_server.url("bench/chunks"))}
        try:
            results = {"file": measure(file_store, refs, threads)}
            for name, store in remote.items():
                for r in refs:
                    store._put("chunks", r.digest, file_store._get("chunks", r.digest))
                before = store.stats().requests
                results[name] = measure(store, refs, threads)
                results[name]["requests_per_fetch"] = round((store.stats().requests - before) / (3 * count), 2)
        finally:
            for store in remote.values():
                store.close()
    stored = sum(r.stored_size for r in refs)
    return {
        "summary": {
            "chunks": count,
            "chunk_bytes": MIB,
            "stored_fraction": round(stored / (count * MIB), 3),
            "file_p50_ms": results["file"]["latency_p50_ms"],
            "oci_p50_ms": results["oci"]["latency_p50_ms"],
            "oci_over_file_p50": round(results["oci"]["latency_p50_ms"] / results["file"]["latency_p50_ms"], 2),
            "s3_p50_ms": results["s3"]["latency_p50_ms"],
            "s3_over_file_p50": round(results["s3"]["latency_p50_ms"] / results["file"]["latency_p50_ms"], 2),
        },
        "stores": results,
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--chunks", type=int, default=128)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = run(args.chunks, args.threads)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
