"""The sandbox firewall rules and [network] settings, without touching iptables."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from crabd.backends.network import chain_names, jumps, restore_script
from crabd.config import NetworkConfig, parse_allow


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
