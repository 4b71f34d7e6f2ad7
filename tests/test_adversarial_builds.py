"""Running code against E2B's template builds and sandbox networking, as an attacker would.

A real ``weenv serve`` (its own home and store, a loopback registry with the
session's Debian image), driven by the ``e2b`` SDK and raw HTTP: build steps
that try to leave their tree or their step (background processes, devices,
symbolic links a later step follows, odd users and variables), cancelled and
concurrent builds, and sandboxes that try to reach the host, each other or
link-local addresses.  Each test asserts what must hold; nothing may be left
(mounts, work dirs, environments, processes).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from e2b import Sandbox, Template
from e2b.exceptions import BuildException

from e2b_fixture import E2B, e2b_daemon
from oci_push import e2b_base_image  # noqa: F401 - a fixture
from registry_fixture import oci_registry  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def base_image(e2b_base_image):  # noqa: F811
    return e2b_base_image


@pytest.fixture(scope="module")
def e2bd(tmp_path_factory, oci_registry):  # noqa: F811
    with e2b_daemon(tmp_path_factory.mktemp("e2b-adversarial"), oci_registry) as d:
        yield d


def _nothing_left(d: E2B) -> None:
    left = d.leftovers()
    assert left == {"mounts": [], "work": [], "environments": [], "cgroups": left["cgroups"]}, left
    assert not _host_processes("sleep 777"), _host_processes("sleep 777")


def _host_processes(marker: str) -> list[str]:
    """Command lines of the host's processes holding ``marker``."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and p.name != str(os.getpid()):
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd and "pytest" not in cmd:
                out.append(f"{p.name}: {cmd}")
    return out


def _request(c: httpx.Client, name: str) -> tuple[str, str]:
    r = c.post("/v3/templates", json={"name": name})
    assert r.status_code == 202, r.text
    return r.json()["templateID"], r.json()["buildID"]


def _wait(c: httpx.Client, tid: str, bid: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = c.get(f"/templates/{tid}/builds/{bid}/status", params={"logsOffset": 0, "limit": 100}).json()
        if s["status"] in ("ready", "error"):
            return s
        time.sleep(0.2)
    raise AssertionError(f"build {bid} still {s['status']}")


def _build(d: E2B, name: str, base: str, steps: list[dict], timeout: float = 180) -> dict:
    with d.api() as c:
        tid, bid = _request(c, name)
        r = c.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromImage": base, "steps": steps})
        if r.status_code != 202:
            return {"status": "refused", "code": r.status_code, "message": r.text}
        return _wait(c, tid, bid, timeout)


def run(cmd: str, user: str = "") -> dict:
    return {"type": "RUN", "args": [cmd, user] if user else [cmd]}


# --- processes a step leaves ------------------------------------------------------------------
def test_a_run_step_leaving_processes_ends_with_them_killed(e2bd, base_image):
    """A step whose command returned while what it started (a child holding
    its output, a ``setsid`` double fork) runs on: the step ends, they die."""
    slp = "sleep 7771.5 & (setsid sleep 7772.5 >/dev/null 2>&1 &); echo left"
    s = _build(e2bd, "t-bg", base_image, [run(slp)])
    assert s["status"] == "ready", s
    _nothing_left(e2bd)


# --- devices ------------------------------------------------------------------------------------
def test_a_run_step_cannot_read_a_host_disk_through_a_device_it_makes(e2bd, base_image):
    st = os.stat("/")
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    s = _build(
        e2bd,
        "t-mknod",
        base_image,
        [
            run(
                f"mknod /tmp/disk b {major} {minor}; head -c 4096 /tmp/disk | wc -c "
                f"| grep -qx 4096 && echo READ-THE-HOST-DISK''; exit 0",
                "root",
            )
        ],
    )
    assert s["status"] == "ready", s
    assert not any(e["message"] == "READ-THE-HOST-DISK" for e in s["logEntries"]), s["logEntries"]
    _nothing_left(e2bd)


# --- symbolic links a later step follows ---------------------------------------------------------
@pytest.mark.parametrize("link", ["/", "/proc/1/root", "../../../../../../..", "/proc/self/root"])
def test_workdir_and_user_through_a_link_stay_in_the_tree(e2bd, base_image, link):
    marker = f"weenv-escape-{os.getpid()}-{abs(hash(link)) % 10000}"
    steps = [
        run(f"rm -rf /home && ln -s {link} /home && ln -s {link} /w", "root"),
        {"type": "WORKDIR", "args": [f"/w/tmp/{marker}"]},
        {"type": "USER", "args": [marker[:30], "true"]},
        run("true"),
    ]
    s = _build(e2bd, f"t-link-{abs(hash(link)) % 10000}", base_image, steps)
    print(s["status"], s.get("reason", {}).get("message"))
    assert s["status"] == "ready" or s["reason"]["step"] != "1", s
    assert not Path(f"/tmp/{marker}").exists()
    assert not Path(f"/{marker[:30]}").exists()
    assert marker[:30] not in Path("/etc/passwd").read_text()
    _nothing_left(e2bd)


def test_copy_through_a_tmp_link_stays_in_the_tree(e2bd, base_image, tmp_path):
    (tmp_path / "f.txt").write_text("payload")
    tpl = (
        Template(file_context_path=str(tmp_path))
        .from_image(base_image)
        .run_cmd("rm -rf /tmp && ln -s /proc/1/cwd /tmp", user="root")
        .copy("f.txt", "/x/")
    )
    with pytest.raises(BuildException):
        Template.build(tpl, "t-copylink")
    _nothing_left(e2bd)


# --- odd users and variables -----------------------------------------------------------------------
@pytest.mark.parametrize("user", ["4294967296", "99999999999999999999", "0:99999999999", "-1"])
def test_a_user_out_of_range_fails_its_step(e2bd, base_image, user):
    s = _build(e2bd, f"t-user-{abs(hash(user)) % 10000}", base_image, [{"type": "USER", "args": [user]}, run("id")])
    assert s["status"] in ("error", "refused"), s
    _nothing_left(e2bd)


def test_variables_expanding_past_bounds_are_refused(e2bd, base_image):
    """Two ENV steps (A: 500 KB; B: 250,000 times ``$A``) made the daemon's
    build thread expand B to 125 GB: the whole daemon went out of memory.  Now
    refused at the request (400), before any build starts."""
    steps = [{"type": "ENV", "args": ["A", "x" * 500_000]}, {"type": "ENV", "args": ["B", "$A" * 250_000]}]
    s = _build(e2bd, "t-envbomb", base_image, steps)
    assert s["status"] == "refused" and s["code"] == 400 and "once expanded" in s["message"], s
    _nothing_left(e2bd)


def test_variable_names_that_no_command_could_get_are_refused(e2bd, base_image):
    """An ENV name holding ``=`` built a template no sandbox could start
    (its config refused the name at every create)."""
    s = _build(e2bd, "t-envodd", base_image, [{"type": "ENV", "args": ["C=D", "3"]}, run("env")])
    assert s["status"] == "refused" and s["code"] == 400 and "ENV variable name" in s["message"], s
    s = _build(e2bd, "t-envnl", base_image, [{"type": "ENV", "args": ["A\nB", "1\n2"]}, run("env")])
    assert s["status"] == "ready", s
    _nothing_left(e2bd)


# --- cancel -----------------------------------------------------------------------------------------
def test_deleting_a_template_whose_step_left_a_process_holding_its_output(e2bd, base_image):
    with e2bd.api() as c:
        tid, bid = _request(c, "t-cancel-bg")
        steps = [run("(sleep 7773.5 &); sleep 7774.5 & echo started; sleep 7775.5")]
        assert (
            c.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromImage": base_image, "steps": steps}).status_code
            == 202
        )
        deadline = time.monotonic() + 120
        while not _host_processes("sleep 7775.5") and time.monotonic() < deadline:  # the step runs
            time.sleep(0.1)
        assert _host_processes("sleep 7773.5") and _host_processes("sleep 7774.5"), "the step never started"
        t0 = time.monotonic()
        assert c.delete(f"/templates/{tid}").status_code == 204
        assert time.monotonic() - t0 < 30
    _nothing_left(e2bd)


def test_concurrent_builds_of_one_name(e2bd, base_image):
    with e2bd.api() as c:
        a = _request(c, "t-same")
        b = _request(c, "t-same")
        for i, (tid, bid) in enumerate((a, b)):
            steps = [run(f"echo {i} > /tmp/which; sleep 2")]
            assert (
                c.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromImage": base_image, "steps": steps}).status_code
                == 202
            )
        assert _wait(c, *a)["status"] == "ready" and _wait(c, *b)["status"] == "ready"
    s = Sandbox.create("t-same", timeout=60)
    try:
        assert s.files.read("/tmp/which").strip() in ("0", "1")
    finally:
        s.kill()
    _nothing_left(e2bd)


# --- spoofed sources --------------------------------------------------------------------------------
SPOOF = r"""
import socket, struct, sys, time
src, sport, dst, dport = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
payload = b"INJECTED"
udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, socket.inet_aton(src), socket.inet_aton(dst))
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
for _ in range(20):
    s.sendto(ip + udp, (dst, 0))
    time.sleep(0.1)
print("sent")
"""


def test_a_step_cannot_inject_into_the_hosts_flows_with_a_spoofed_source(e2bd, base_image):
    """A build step runs as root with Docker's capabilities (``CAP_NET_RAW``):
    a datagram from its veth carrying the source of a server the host talks to
    (here a UDP flow to 198.51.100.7:53, as the host's DNS queries are) matched
    the flow's conntrack entry, passed the input chain's ``established`` accept
    and reached the host's socket.  A source that does not route back through
    its veth is dropped before that accept."""
    import json
    import subprocess
    import threading

    peer = "198.51.100.7"  # TEST-NET-2: nothing answers
    route = json.loads(subprocess.run(["ip", "-j", "route", "get", peer], capture_output=True, text=True).stdout)
    me = route[0]["prefsrc"]
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((me, 0))
    sock.connect((peer, 53))
    port = sock.getsockname()[1]
    stop = threading.Event()

    def keep() -> None:  # the flow's conntrack entry stays
        while not stop.is_set():
            sock.send(b"query")
            stop.wait(1)

    t = threading.Thread(target=keep, daemon=True)
    t.start()
    try:
        script = SPOOF.replace("'", "'\\''")
        s = _build(e2bd, "t-spoof", base_image, [run(f"python3 -c '{script}' {peer} 53 {me} {port}", "root")])
        assert s["status"] == "ready", s
        sock.settimeout(2)
        try:
            got = sock.recv(100)
        except TimeoutError:
            got = b""
        assert got != b"INJECTED", "a spoofed datagram from a build step reached the host's socket"
    finally:
        stop.set()
        t.join()
        sock.close()
    _nothing_left(e2bd)


# --- reaching what the policy forbids -----------------------------------------------------------------
PROBE = r"""
import socket, struct, sys
def gateway():
    for line in open("/proc/net/route").read().splitlines()[1:]:
        f = line.split()
        if f[1] == "00000000":
            return socket.inet_ntoa(struct.pack("<L", int(f[2], 16)))
targets = [t.replace("GATEWAY", gateway()) for t in sys.argv[1:]]
for t in targets:
    host, port = t.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, int(port)))
        print("REACHED", t)
    except OSError as e:
        print("refused", t, e)
    finally:
        s.close()
"""


def test_a_step_and_a_sandbox_reach_neither_the_host_nor_each_other(e2bd, base_image):
    """From a build step (root, Docker's capabilities) and from a sandbox: the
    daemon's port on the host's address and on the veth's host end, a server in
    another sandbox, link-local metadata, the name server on another port."""
    import json
    import subprocess

    port = int(e2bd.daemon.url.rsplit(":", 1)[1])
    me = json.loads(
        subprocess.run(["ip", "-j", "route", "get", "198.51.100.7"], capture_output=True, text=True).stdout
    )[0]["prefsrc"]
    Template.build(Template().from_image(base_image).set_user("root"), "t-probe")
    other = Sandbox.create("t-probe", timeout=120, allow_internet_access=True)
    try:
        other.commands.run("python3 -m http.server 8000 --bind 0.0.0.0 >/dev/null 2>&1", background=True)
        addr = other.commands.run(
            'python3 -c "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); '
            "s.connect(('198.51.100.7', 9)); print(s.getsockname()[0])\""
        ).stdout.strip()
        up = (
            'python3 -c "import time, urllib.request as u\nfor _ in range(100):\n try:\n  u.urlopen('
            "'http://127.0.0.1:8000/'); break\n except OSError: time.sleep(0.2)\nelse: raise SystemExit(1)\""
        )
        assert other.commands.run(up).exit_code == 0  # the server answers inside its own sandbox
        targets = [
            f"{me}:{port}",
            f"GATEWAY:{port}",
            f"{addr}:8000",
            "169.254.169.254:80",
            f"127.0.0.1:{port}",
            "10.255.255.53:80",
        ]
        script = PROBE.replace("'", "'\\''")
        s = _build(e2bd, "t-probe-step", base_image, [run(f"python3 -c '{script}' {' '.join(targets)}", "root")])
        assert s["status"] == "ready", s
        lines = [e["message"] for e in s["logEntries"] if e["message"].startswith(("REACHED", "refused"))]
        assert len(lines) == len(targets) and not [m for m in lines if m.startswith("REACHED")], lines
        probe = Sandbox.create("t-probe", timeout=120, allow_internet_access=True)
        try:
            probe.files.write("/tmp/probe.py", PROBE)
            out = probe.commands.run(f"python3 /tmp/probe.py {' '.join(targets)}").stdout
            assert [m.split()[0] for m in out.splitlines()] == ["refused"] * len(targets), out
        finally:
            probe.kill()
    finally:
        other.kill()
    _nothing_left(e2bd)


# --- the port relay ----------------------------------------------------------------------------------
RAW_SERVER = r"""
import socket, sys, threading
answer = sys.argv[2].encode().decode("unicode_escape").encode("latin-1")
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(64)
held = []
while True:
    c, _ = s.accept()
    c.recv(65536)
    c.sendall(answer)
    held.append(c)
"""


@pytest.fixture(scope="module")
def relay_box(e2bd, base_image):
    Template.build(Template().from_image(base_image).set_user("root"), "t-relay")
    s = Sandbox.create("t-relay", timeout=300)
    s.files.write("/tmp/raw.py", RAW_SERVER)
    yield s
    s.kill()


def _raw(d: E2B, data: bytes, wait: float = 10) -> bytes:
    import socket

    host, port = d.daemon.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as c:
        c.sendall(data)
        out = b""
        try:
            while chunk := c.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def _api_answers(d: E2B) -> bool:
    try:
        with d.api() as c:
            return c.get("/templates", timeout=5).status_code == 200
    except httpx.TimeoutException:
        return False


@pytest.mark.parametrize(
    "method,answer",
    [
        ("CONNECT", "HTTP/1.1 200 OK\\r\\n\\r\\n"),
        ("GET", "HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: x\\r\\nConnection: upgrade\\r\\n\\r\\n"),
        ("GET", "HTTP/1.1 200 OK\\r\\nContent-Length: 3\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n0\\r\\n\\r\\n"),
        ("GET", "HTTP/1.1 200 OK\\r\\nX: " + "a" * 70000 + "\\r\\n\\r\\n"),
        ("GET", "HTTP/1.1 100 Continue\\r\\n\\r\\n" * 2000),
    ],
)
def test_a_sandbox_answering_odd_http_does_not_stall_the_daemon(e2bd, relay_box, method, answer):
    port = 8100 + abs(hash((method, answer))) % 800
    relay_box.commands.run(f"python3 /tmp/raw.py {port} '{answer}' >/dev/null 2>&1", background=True)
    time.sleep(1)
    target = "x:1" if method == "CONNECT" else "/"
    out = _raw(
        e2bd, f"{method} {target} HTTP/1.1\r\nHost: {port}-{relay_box.sandbox_id}.e2b.local\r\n\r\n".encode(), wait=8
    )
    assert _api_answers(e2bd), f"the daemon stopped answering after the relay got {answer[:60]!r} ({out[:200]!r})"
