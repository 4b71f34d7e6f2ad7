"""Temporary probe (not committed)."""
import concurrent.futures
import time

from weenv.errors import CapacityError
from weenv.node.node import Node


def test_probe(paths, shared_store, leak_check):
    with Node(paths, store=shared_store, pool_size=0) as node:
        e = node.create("task")
        for _ in range(5):
            node.exec(e.id, "python3 hello.py")
            time.sleep(3)
        node.destroy(e.id)
        digest = shared_store.get_ref("templates", "task")
        node.provisioner.profiles.close()
        print("\nPROFILE", node.provisioner.profiles.get(digest))
    with Node(paths, store=shared_store, pool_size=1) as node:
        refused = []
        def one(_):
            try:
                return node.create("task")
            except CapacityError as exc:
                refused.append(str(exc))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            infos = [i for i in pool.map(one, range(8)) if i]
        print("ADMITTED", len(infos), "REFUSED", refused[:1])
        for i in infos:
            node.destroy(i.id)
        node.pool.drain()
    name = digest.split(":")[1]
    shared_store.delete_ref("usage", name)
