"""The sandbox firewall rules and [network] settings, without touching iptables."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from crabd.backends import network
from crabd.backends.network import chain_names, jumps, restore_script
from crabd.config import NetworkConfig, parse_allow
from crabd.errors import HostError


def test_default_rules_reject_host_sandboxes_and_link_local() -> None:
    cfg = NetworkConfig()
    chain_in, chain_fwd = chain_names(cfg)
    lines = restore_script(cfg).splitlines()
    assert lines[:3] == ["*filter", f":{chain_in} - [0:0]", f":{chain_fwd} - [0:0]"]
    assert lines[-1] == "COMMIT"
    ins = [x for x in lines if x.startswith(f"-A {chain_in} ")]
    fwd = [x for x in lines if x.startswith(f"-A {chain_fwd} ")]
    # Replies first, then a catch-all reject: a sandbox reaches no host service.
    assert "ESTABLISHED" in ins[0] and ins[-1] == f"-A {chain_in} -j REJECT"
    assert f"-A {chain_fwd} -o crab0 -j REJECT" in fwd  # sandbox to sandbox
    assert f"-A {chain_fwd} -d 169.254.0.0/16 -j REJECT" in fwd
    assert fwd[-1] == f"-A {chain_fwd} -j RETURN"  # the rest goes on to Docker's chains
    assert jumps(cfg) == [
        ("INPUT", ["-i", "crab0", "-j", "CRAB-SANDBOX-IN"]),
        ("DOCKER-USER", ["-i", "crab0", "-j", "CRAB-SANDBOX-FWD"]),
    ]


def test_allow_entries_come_before_every_reject() -> None:
    cfg = NetworkConfig(name="t1", allow=("10.0.0.5:8000", "169.254.169.254"), deny=("169.254.0.0/16", "10.0.0.0/8"))
    lines = restore_script(cfg).splitlines()
    _, chain_fwd = chain_names(cfg)
    fwd = [x for x in lines if x.startswith(f"-A {chain_fwd} ")]
    allow_at = fwd.index(f"-A {chain_fwd} -d 169.254.169.254/32 -j RETURN")
    assert f"-A {chain_fwd} -d 10.0.0.5/32 -p tcp -m tcp --dport 8000 -j RETURN" in fwd
    assert all(allow_at < i for i, x in enumerate(fwd) if "REJECT" in x)
    assert f"-A {chain_fwd} -d 10.0.0.0/8 -j REJECT" in fwd
    assert "-o t10 " in "\n".join(fwd)


def test_parse_allow() -> None:
    assert parse_allow("192.168.1.7") == ("192.168.1.7/32", None)
    assert parse_allow("192.168.1.0/24:443") == ("192.168.1.0/24", 443)
    for bad in ("nope", "10.0.0.1:0", "10.0.0.1:70000", "10.0.0.1:x", "::1"):
        with pytest.raises(ValueError):
            parse_allow(bad)


def test_network_config_is_validated() -> None:
    for bad in (
        {"name": "Crab"},
        {"name": "waytoolongname"},
        {"name": "a-b"},
        {"allow": ["300.1.1.1"]},
        {"deny": ["x"]},
    ):
        with pytest.raises(ValidationError):
            NetworkConfig(**bad)
    assert NetworkConfig().isolate is True


#: /proc/net/route as this host kind prints it (x86: each address is its bytes as a little-endian word).
ROUTES = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
crabopar0\t009CD60A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
vpn0\t0000000A\t00000000\t0001\t0\t0\t0\t000000FF\t0\t0\t0
garbage line
"""


@pytest.fixture
def routes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "route"
    path.write_text(ROUTES)
    monkeypatch.setattr(network, "_ROUTES", path)
    return path


def test_host_routes_are_read_from_proc_net_route(routes: Path) -> None:
    got = [(str(dst), dev) for dst, dev in network.host_routes()]
    assert got == [
        ("0.0.0.0/0", "eth0"),
        ("10.214.156.0/24", "crabopar0"),
        ("172.17.0.0/16", "docker0"),
        ("10.0.0.0/8", "vpn0"),
    ]
    assert network.host_routes(Path("/proc/net/route"))[0][0].version == 4  # this host's own table parses


@pytest.mark.parametrize(
    ("subnet", "bridge", "clash"),
    [
        ("10.214.156.0/24", "crabopar0", None),  # its own bridge's route
        ("10.214.157.0/24", "crabx0", None),  # the default route and a VPN's 10/8 are broader: no clash
        ("10.214.156.0/24", "crabx0", "10.214.156.0/24 on crabopar0"),  # the same /24 on a bridge left behind
        ("10.214.0.0/16", "crabx0", "10.214.156.0/24 on crabopar0"),  # a part of it, more specific elsewhere
        ("172.17.5.0/24", "crabx0", None),  # docker0's /16 is broader
    ],
)
def test_a_subnet_routed_on_another_device_is_refused(
    routes: Path, subnet: str, bridge: str, clash: str | None
) -> None:
    if clash is None:
        network.require_subnet_free(subnet, bridge)
        return
    with pytest.raises(HostError, match="already routed elsewhere") as info:
        network.require_subnet_free(subnet, bridge)
    assert clash in str(info.value) and "[runtime] subnet" in str(info.value.hint)
    assert subnet in str(info.value)  # the message names the subnet asked for
