"""Where a fork's time goes: per-phase wall and CPU of ``Node.fork(parent, N)`` (issue 16).

``PYTHONPATH=SRC python scripts/prof_fork.py [N] [--repeat K] [--parent-mb MB] [--profile OUT]``
(root; a temporary WEENV_HOME, the debootstrap cache in WEENV_CACHE).  The
setup is ``weenv bench fork``'s (Debian + python3, a parent that wrote
``--parent-mb`` MB, children with the bench's small resources, admission by
reservations).  Per fork it prints:

- the wall time and the parent's pause;
- CPU seconds over the fork: the node process (user + system, all its
  threads), its waited children (runc), the children's cgroups (``runc init``
  once in them, the exec agent, the first command) and the whole machine
  (``/proc/stat``: what is left is the kernel's work for others, e.g. kworkers);
- each create phase (:class:`~weenv.api.models.CreateTiming`) and each timed
  step inside it: median wall per child and the sum of the calling thread's
  CPU (``time.thread_time``) over the children.

``--profile OUT``: a cProfile of every child's create thread, summed
(``pstats``), the top functions by their own time printed and saved to OUT.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

STEPS: dict[str, list[tuple[float, float]]] = defaultdict(list)
_lock = threading.Lock()


def timed(owner, attr: str, key: str) -> None:
    """Wrap ``owner.attr`` so each call's (wall, this thread's CPU) goes to ``STEPS[key]``."""
    real = getattr(owner, attr)

    @functools.wraps(real)
    def wrapper(*args, **kw):
        w, c = time.perf_counter(), time.thread_time()
        try:
            return real(*args, **kw)
        finally:
            with _lock:
                STEPS[key].append((time.perf_counter() - w, time.thread_time() - c))

    setattr(owner, attr, wrapper)


def machine_busy() -> float:
    """CPU seconds the machine has spent not idle (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu() -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds (user + system, its threads' together) of every process now."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                head, rest = f.read().rsplit(b")", 1)
        except OSError:
            continue
        fields = rest.split()
        out[int(pid)] = (head.split(b"(", 1)[1].decode(errors="replace"), (int(fields[11]) + int(fields[12])) / tick)
    return out


def cgroup_cpu(env_id: str) -> float:
    for p in (
        f"/sys/fs/cgroup/cpuacct/weenv-{env_id}/cpuacct.usage",
        f"/sys/fs/cgroup/cpu,cpuacct/weenv-{env_id}/cpuacct.usage",
    ):
        try:
            return int(Path(p).read_text()) / 1e9
        except OSError:
            continue
    try:
        for line in Path(f"/sys/fs/cgroup/weenv-{env_id}/cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec"):
                return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return 0.0


def throttled(env_id: str) -> tuple[int, float]:
    """(periods throttled, seconds throttled) of the environment's cgroup."""
    for p in (
        f"/sys/fs/cgroup/cpu/weenv-{env_id}/cpu.stat",
        f"/sys/fs/cgroup/cpu,cpuacct/weenv-{env_id}/cpu.stat",
        f"/sys/fs/cgroup/weenv-{env_id}/cpu.stat",
    ):
        try:
            stat = dict(line.split() for line in Path(p).read_text().splitlines())
        except OSError:
            continue
        if "throttled_time" in stat:
            return int(stat["nr_throttled"]), int(stat["throttled_time"]) / 1e9
        return int(stat.get("nr_throttled", 0)), int(stat.get("throttled_usec", 0)) / 1e6
    return 0, 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int, nargs="?", default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--parent-mb", type=int, default=20)
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--workers", type=int)
    ap.add_argument(
        "--empty-uppers",
        action="store_true",
        help="an experiment, not a fork: children get an empty upper dir (a new subvolume) instead of "
        "a snapshot of the capture, to see what the per-child btrfs snapshot costs",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="weenv-prof-fork-") as tmp:
        work = Path(tmp)
        os.environ.setdefault("WEENV_CACHE", "/var/cache/weenv")
        import weenv.node.node as node_mod
        import weenv.node.runtime.container as container_mod
        from weenv.config import Paths
        from weenv.formats.manifest import RuntimeConfig
        from weenv.node.node import Node
        from weenv.node.provision.models import ProvisionConfig
        from weenv.packaging.debootstrap import debian_rootfs
        from weenv.packaging.group import build_group
        from weenv.packaging.template import create_template
        from weenv.store.file import FileStore
        from weenv_bench.fork import SMALL, _write_script

        cache = Paths.from_env().cache
        store = FileStore(work / "store")
        build_group(debian_rootfs(cache), store, name="base", workdir=work)
        create_template(store, "bench-fork", ["base"], runtime=RuntimeConfig(working_dir="/workspace"))
        with Node(Paths(work / "home", cache, store.url), store=store, pool_size=0,
                  provisioning=ProvisionConfig(admission="reservations")) as node:  # fmt: skip
            parent = node.create("bench-fork", resources=SMALL)
            r = node.exec(parent.id, ["sh", "-c", _write_script(args.parent_mb)])
            assert r.exit_code == 0, r.stderr
            if args.empty_uppers:
                disk = node.snapshotter.disk
                disk.clone = lambda source, env_dir, limit, name="disk": disk.make(env_dir, limit, name)
            for owner, attr, key in [
                (node.captures, "take", "capture"),
                (node.resolver, "load", "manifests"),
                (node.provisioner, "reserve", "reserve"),
                (node.provisioner, "attach", "attach"),
                (node.snapshotter.disk, "clone", "upper clone"),
                (node.snapshotter, "mount", "overlay mount"),
                (node.snapshotter.groups, "acquire_all", "group acquire (thread)"),
                (node_mod, "_check_command", "check command"),
                (container_mod, "write_bundle", "bundle write"),
                (container_mod, "lookup_user", "user lookup"),
                (container_mod, "agent_listen", "agent listen"),
                (node.containers.runc, "run_detached", "runc run"),
                (node.commands, "start", "first cmd start"),
                (node_mod, "collect", "first cmd collect"),
                (node_mod, "save_info", "save info"),
                (node.table, "add", "table add"),
            ]:  # fmt: skip
                timed(owner, attr, key)
            profile = cProfile.Profile() if args.profile else None
            profiles: list[cProfile.Profile] = []
            if profile is not None:
                real_child = node.forks.create_child

                def child(*a, **kw):
                    p = cProfile.Profile()
                    p.enable()
                    try:
                        return real_child(*a, **kw)
                    finally:
                        p.disable()
                        with _lock:
                            profiles.append(p)

                node.forks.create_child = child
            if args.workers:
                node.forks.workers = args.workers
            for rep in range(args.repeat):
                STEPS.clear()
                t_self, procs, busy = os.times(), process_cpu(), machine_busy()
                res = node.fork(parent.id, args.n)
                t1, procs1, busy1 = os.times(), process_cpu(), machine_busy()
                kids = [c for c in res.children if not isinstance(c, Exception)]
                errors = [c for c in res.children if isinstance(c, Exception)]
                cg = sum(cgroup_cpu(c.id) for c in kids)
                thr = [throttled(c.id) for c in kids]
                self_cpu = (t1.user - t_self.user) + (t1.system - t_self.system)
                kids_cpu = (t1.children_user - t_self.children_user) + (t1.children_system - t_self.children_system)
                print(
                    f"\n== fork {args.n} #{rep + 1}: {res.total_s:.3f} s wall, pause {res.pause_s * 1e3:.1f} ms,"
                    f" {len(errors)} failed {errors[:2]}"
                )
                print(f"CPU s: node process {self_cpu:.2f}, waited children (runc) {kids_cpu:.2f}, child cgroups "
                      f"{cg:.2f}, machine {busy1 - busy:.2f} (other {busy1 - busy - self_cpu - kids_cpu - cg:.2f});"
                      f" per child {(busy1 - busy) / max(1, len(kids)) * 1e3:.1f} ms")  # fmt: skip
                by_name: dict[str, float] = defaultdict(float)
                for pid, (name, v) in procs1.items():
                    if pid != os.getpid() and pid in procs:  # kworkers change their names with their work
                        by_name[name.split("-")[0] if name.startswith("kworker") else name] += v - procs[pid][1]
                top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
                print(
                    "other processes alive before and after (CPU s): "
                    + ", ".join(f"{k} {v:.2f}" for k, v in top if v > 0.005)
                )
                print(
                    f"throttled: {sum(1 for n, _ in thr if n)} of {len(kids)} children, {sum(n for n, _ in thr)} periods,"
                    f" {sum(s for _, s in thr):.2f} s in all"
                )
                phases = ["manifest_s", "reserve_s", "groups_s", "upper_s", "overlay_s", "runtime_s",
                          "first_command_s", "total_s"]  # fmt: skip
                for ph in phases:
                    xs = [getattr(c.timing, ph) or 0.0 for c in kids]
                    print(f"  phase {ph:18s} median {statistics.median(xs) * 1e3:7.1f} ms   max {max(xs) * 1e3:7.1f}")
                for key, vals in sorted(STEPS.items(), key=lambda kv: -sum(v[1] for v in kv[1])):
                    walls, cpus = [v[0] for v in vals], [v[1] for v in vals]
                    print(
                        f"  step {key:24s} n={len(vals):3d} median wall {statistics.median(walls) * 1e3:7.1f} ms"
                        f"  thread CPU sum {sum(cpus) * 1e3:7.0f} ms ({sum(cpus) / max(1, len(kids)) * 1e3:5.1f}/child)"
                    )
                t = time.perf_counter()
                for c in kids:
                    node.destroy(c.id)
                print(f"  destroy {len(kids)}: {time.perf_counter() - t:.2f} s")
            node.destroy(parent.id)
        if profiles:
            stats = pstats.Stats(profiles[0])
            for p in profiles[1:]:
                stats.add(p)
            stats.dump_stats(args.profile)
            stats.sort_stats("tottime").print_stats(35)
            stats.sort_stats("cumulative").print_stats(60)


if __name__ == "__main__":
    main()
