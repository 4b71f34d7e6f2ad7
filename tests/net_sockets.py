"""The internet sockets a set of processes holds, read from ``/proc`` (no ``ss``
needed): each process's socket inodes (``/proc/PID/fd``) looked up in its network
namespace's tables (``/proc/PID/net/tcp``, ``tcp6``, ``udp``, ``udp6``).

Used to check that a test cluster keeps to loopback: :func:`beyond_loopback`
lists the sockets that listen on, are bound to, or talk to an address outside
127.0.0.0/8 and ::1 (a wildcard bind, ``0.0.0.0`` or ``::``, is outside: it
accepts from every interface).  Only processes in this process's network
namespace are looked at: an environment's own namespace is its business.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

TABLES = ("tcp", "tcp6", "udp", "udp6")
TCP_LISTEN = 0x0A


@dataclass(frozen=True)
class Socket:
    pid: int
    command: str
    table: str
    local: tuple[str, int]
    remote: tuple[str, int]
    state: int

    @property
    def listening(self) -> bool:
        return (self.table.startswith("tcp") and self.state == TCP_LISTEN) or (
            self.table.startswith("udp") and self.remote[1] == 0
        )

    def __str__(self) -> str:
        what = "listens on" if self.listening else "talks"
        peer = "" if self.listening else f" -> {self.remote[0]}:{self.remote[1]}"
        return f"pid {self.pid} ({self.command}) {self.table} {what} {self.local[0]}:{self.local[1]}{peer}"


def parse_address(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` (IPv4) or 32 hex digits ``:PORT`` (IPv6) as in ``/proc/net/tcp``:
    each 32-bit word in the host's byte order (little-endian here)."""
    hex_addr, hex_port = text.split(":")
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(hex_port, 16)


def parse_table(text: str) -> dict[int, tuple[tuple[str, int], tuple[str, int], int]]:
    """Inode -> (local, remote, state) of one ``/proc/PID/net/{tcp,tcp6,udp,udp6}``."""
    out = {}
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        inode = int(f[9])
        if inode:  # 0: a socket no process holds any more (TIME_WAIT)
            out[inode] = (parse_address(f[1]), parse_address(f[2]), int(f[3], 16))
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def sockets_of(pids) -> list[Socket]:
    """The internet sockets of ``pids`` that live in this process's network namespace
    (processes gone meanwhile are skipped)."""
    mine = os.readlink("/proc/self/ns/net")
    out = []
    for pid in sorted(set(pids)):
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != mine:
                continue
            command = open(f"/proc/{pid}/comm").read().strip()
            inodes = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
            if not inodes:
                continue
            for table in TABLES:
                for inode, (local, remote, state) in parse_table(open(f"/proc/{pid}/net/{table}").read()).items():
                    if inode in inodes:
                        out.append(Socket(pid, command, table, local, remote, state))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def beyond_loopback(sockets: list[Socket]) -> list[Socket]:
    """The sockets bound to a non-loopback (or wildcard) address, or connected to one.
    A UDP socket not bound to a port (port 0) and connected nowhere is none of these."""
    out = []
    for s in sockets:
        if s.local[1] == 0 and s.remote[1] == 0:
            continue
        if not is_loopback(s.local[0]) or (s.remote[1] != 0 and not is_loopback(s.remote[0])):
            out.append(s)
    return out


def descendants(pids) -> set[int]:
    """``pids`` and every process below them (by parent pid, read once from ``/proc``)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parent[int(d)] = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out = set(pids)
    grew = True
    while grew:
        more = {p for p, pp in parent.items() if pp in out and p not in out}
        out |= more
        grew = bool(more)
    return out
