"""Reading who listens where from /proc/net/{tcp,tcp6,udp,udp6} (tests/net_sockets.py,
which the cluster's loopback test uses), and weenv's test of a loopback Ray address."""

from __future__ import annotations

from net_sockets import Socket, beyond_loopback, parse_address, parse_table
from weenv.cluster.loopback import is_loopback_address

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def _line(local: str, remote: str, state: str, inode: int) -> str:
    return (
        f"   0: {local} {remote} {state} 00000000:00000000 00:00000000 00000000     0        0 {inode} "
        "1 0 100 0 0 10 0\n"
    )


def test_addresses_as_the_kernel_writes_them():
    assert parse_address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert parse_address("0202000C:0050") == ("12.0.2.2", 80)
    assert parse_address("00000000:0000") == ("0.0.0.0", 0)
    assert parse_address("00000000000000000000000001000000:0016") == ("::1", 22)
    assert parse_address("0000000000000000FFFF0000020200C0:01BB") == ("::ffff:c000:202", 443)  # ::ffff:192.0.2.2


def test_a_table_by_inode_without_sockets_no_process_holds():
    table = parse_table(
        HEADER + _line("0100007F:1F90", "00000000:0000", "0A", 11) + _line("0100007F:1F90", "0100007F:C000", "06", 0)
    )  # TIME_WAIT: no inode
    assert table == {11: (("127.0.0.1", 8080), ("0.0.0.0", 0), 0x0A)}


def _s(table: str, local: tuple, remote: tuple = ("0.0.0.0", 0), state: int = 0x0A) -> Socket:
    return Socket(1, "x", table, local, remote, state)


def test_what_is_beyond_loopback():
    inside = [
        _s("tcp", ("127.0.0.1", 80)),
        _s("tcp", ("127.0.0.5", 80)),
        _s("tcp6", ("::1", 80)),
        _s("tcp", ("127.0.0.1", 5000), ("127.0.0.1", 80), 0x01),
        _s("tcp6", ("::ffff:127.0.0.1", 5000), ("::ffff:127.0.0.1", 80), 0x01),
        _s("udp", ("0.0.0.0", 0), state=0x07),
    ]  # an unbound UDP socket: nowhere
    outside = [
        _s("tcp", ("0.0.0.0", 80)),
        _s("tcp6", ("::", 80)),
        _s("tcp", ("192.0.2.2", 80)),
        _s("tcp", ("127.0.0.1", 5000), ("192.0.2.2", 80), 0x01),
        _s("tcp6", ("::ffff:192.0.2.2", 5000), ("::ffff:192.0.2.2", 80), 0x01),
        _s("udp", ("0.0.0.0", 53), state=0x07),
    ]
    assert beyond_loopback(inside) == []
    assert beyond_loopback(outside) == outside
    assert "listens on 0.0.0.0:80" in str(outside[0]) and "-> 192.0.2.2:80" in str(outside[3])


def test_loopback_ray_addresses():
    for a in ("127.0.0.1:6379", "127.1.2.3:1", "localhost:6379", "[::1]:6379"):
        assert is_loopback_address(a), a
    for a in (None, "", "auto", "192.0.2.2:6379", "ray://127.0.0.1:10001x", "example.com:6379"):
        assert not is_loopback_address(a), a
