"""An environment's own nft table (:func:`weenv.node.runtime.network.egress_ruleset`):
the order of its verdicts, which allow entries open a local range, and the
name servers read from a resolver configuration."""

from __future__ import annotations

from weenv.node.runtime import network

ENV = "0123456789abcdef"


def _chain(script: str) -> list[str]:
    body = script.split("chain egress {", 1)[1]
    return [line.strip().split(" ", 2)[2] for line in body.splitlines() if line.strip().startswith("iifname")]


def _elements(script: str, name: str) -> str:
    block = script.split(f"set {name} {{", 1)[1].split("}\n", 1)[0]
    return block.split("elements = {", 1)[1].split("}", 1)[0].strip() if "elements" in block else ""


def test_local_ranges_drop_before_the_lists_and_only_named_entries_open_them():
    egress = network.Egress(internet=False, allow=("10.1.2.3/32", "0.0.0.0/0", "192.168.0.0/16"), deny=("1.2.3.0/24",))
    script = network.egress_ruleset(ENV, egress, network.LOCAL_RANGES + ("192.0.2.0/24",))
    assert _chain(script) == [  # no port-53 exception: DNS follows the policy (weenv.node.runtime.nameserver)
        "ip daddr @allow_local accept",
        "ct state established,related accept",
        "ip daddr @local drop",
        "ip daddr @allow accept",
        "ip daddr @allow_dns accept",  # after the local drop: a name's answer never opens the LAN
        "ip daddr @deny drop",
        "drop",
    ]
    assert "53" not in script
    assert _elements(script, "allow_local") == "10.1.2.3/32, 192.168.0.0/16"  # inside a local range: named
    assert "192.0.2.0/24" in _elements(script, "local") and "10.0.0.0/8" in _elements(script, "local")
    with_internet = network.egress_ruleset(ENV, network.Egress())
    assert _chain(with_internet)[-1] == "ip daddr @deny drop" and _elements(with_internet, "allow_local") == ""


def test_every_default_local_range_is_dropped():
    local = _elements(network.egress_ruleset(ENV, network.Egress()), "local")
    for cidr in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10", "127.0.0.0/8"):
        assert cidr in local


def test_name_servers_are_the_ipv4_nameserver_lines(tmp_path):
    conf = tmp_path / "resolv.conf"
    conf.write_text(
        "# comment\nsearch example\nnameserver 10.255.255.53\nnameserver ::1\nnameserver bad\n"
        "nameserver 192.0.2.1 # second\nnameserver 10.255.255.53\n"
    )
    assert network.name_servers(conf) == ("10.255.255.53", "192.0.2.1")
    assert network.name_servers(tmp_path / "missing") == ()


def test_domain_patterns_and_the_name_policy():
    from weenv.api.names import domain
    from weenv.node.runtime.nameserver import matches

    assert domain("Example.COM.") == "example.com" and domain("*.svc.weenv.test") == "*.svc.weenv.test"
    for bad in ("localhost", "10.0.0.1", "-a.com", "a..b", "*", "*.com.", "a b.com", "x" * 64 + ".com"):
        assert domain(bad) is None, bad
    assert matches("a.b.example.com", ("*.example.com",)) and not matches("example.com", ("*.example.com",))
    assert matches("example.com", ("example.com",)) and not matches("badexample.com", ("*.example.com",))
    assert not network.Egress(internet=True, deny=("0.0.0.0/0",)).names().open
    assert network.Egress(internet=True, deny=("1.2.3.0/24",)).names().open
    assert network.Egress(internet=False, domains=("a.com",)).names() == __import__(
        "weenv.node.runtime.nameserver", fromlist=["x"]
    ).NamePolicy(names=("a.com",), open=False)


def test_the_input_chain_drops_spoofed_sources_before_it_accepts_replies():
    """A spoofed source matching a host flow's conntrack entry passed the
    ``established`` accept (test_adversarial_builds has it with running code)."""
    body = network.ruleset().split("chain input {", 1)[1].split("}", 1)[0]
    rules = [line.strip() for line in body.splitlines() if line.strip().startswith("iifname")]
    assert rules == [
        'iifname "weenv*" fib saddr . iif oif missing drop',
        'iifname "weenv*" ct state established,related accept',
        'iifname "weenv*" drop',
    ]
