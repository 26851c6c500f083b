"""Networked sandboxes cannot reach each other or the host; capabilities are trimmed.

The daemon here uses its own network name (``crabiso``), so its bridge and
iptables chains are its own, and the module removes them at the end.  No
packet is sent off this machine: the only targets are another sandbox, a
listener of this test on the bridge's gateway address, and loopback.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crabd.backends.limits import SANDBOX_CAPABILITIES
from crabd.backends.network import bridge_name, chain_names
from crabd.backends.runc.cni import ADMIN_CHAIN
from crabd.config import CrabConfig, NetworkConfig
from crabd.daemon.assembly import runc_network
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from crabd.util.cgroups import is_docker_id
from tests.integration.conftest import container_gateway, daemon_with_config

NET = NetworkConfig(name="crabiso")

# Bit numbers from include/uapi/linux/capability.h.
_CAP_BITS = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "FOWNER": 3,
    "FSETID": 4,
    "KILL": 5,
    "MKNOD": 27,
    "SETGID": 6,
    "SETUID": 7,
    "NET_BIND_SERVICE": 10,
}

# Tries a TCP connect from inside a sandbox; prints "open" or the error's name.
PROBE = (
    "import socket, sys\n"
    "s = socket.socket(); s.settimeout(3)\n"
    "try:\n"
    "    s.connect((sys.argv[1], int(sys.argv[2]))); print('open')\n"
    "except OSError as e:\n"
    "    print(type(e).__name__)\n"
)


def runc_net() -> NetworkConfig:
    return runc_network(CrabConfig.model_validate({"network": NET.model_dump()}))


@pytest.fixture(scope="module")
def daemon() -> Iterator[EmbeddedDaemon]:
    with daemon_with_config(f'[network]\nname = "{NET.name}"\n', NET.name) as d:
        yield d


def _probe(sb: Sandbox, host: str, port: int) -> str:
    r = sb.run(["python3", "-c", PROBE, host, str(port)], timeout=20)
    return r.stdout.decode().strip()


def _serve(sb: Sandbox, bind: str, port: int) -> None:
    """An HTTP server in ``sb`` on ``bind:port``, listening once this returns.

    It waits for the socket in LISTEN state (``0A`` in /proc/net/tcp) rather
    than a fixed sleep: python3's start-up on a loaded 2-CPU host was seen to
    take longer than 0.7 s, and the test's first connection was refused.
    """
    listening = f":{port:04X} 00000000:0000 0A"
    with sb.turn():
        sb.session.run(
            f"(setsid python3 -m http.server {port} --bind {bind} >/dev/null 2>&1 </dev/null &) ; "
            f"i=0; until grep -q '{listening}' /proc/net/tcp || [ $i -ge 150 ]; do sleep 0.1; i=$((i+1)); done"
        )
        assert listening in sb.run(["cat", "/proc/net/tcp"]).stdout.decode(), f"no server on {bind}:{port}"


@pytest.fixture
def host_listener(make_sandbox: Callable[..., Sandbox]) -> Iterator[tuple[str, int, list[object]]]:
    """A TCP listener of this test on the sandbox bridge's gateway (a host address)."""
    probe = make_sandbox("busybox", network=True)
    srv = socket.socket()
    srv.bind((container_gateway(probe.info.container_id), 0))
    srv.listen()
    accepted: list[object] = []

    def accept() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            accepted.append(c)

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[0], srv.getsockname()[1], accepted
    srv.close()


def test_sandboxes_do_not_reach_each_other_or_the_host(make_sandbox: Callable[..., Sandbox], client: Client) -> None:
    a = make_sandbox("bookworm", network=True)
    b = make_sandbox("bookworm", network=True)
    _serve(b, "0.0.0.0", 8000)
    b_ip = b.refresh().ip_address
    # The host still reaches a sandbox (how tests and tools talk to servers inside).
    assert urllib.request.urlopen(f"http://{b_ip}:8000/", timeout=10).status == 200
    assert _probe(a, b_ip, 8000) == "ConnectionRefusedError"  # was "open" on Docker's default bridge
    # A sandbox's own loopback is untouched.
    _serve(a, "127.0.0.1", 8001)
    assert _probe(a, "127.0.0.1", 8001) == "open"


def test_sandbox_cannot_reach_host_services(
    make_sandbox: Callable[..., Sandbox], host_listener: tuple[str, int, list[object]]
) -> None:
    a = make_sandbox("bookworm", network=True)
    host, port, accepted = host_listener
    assert _probe(a, host, port) == "ConnectionRefusedError"
    time.sleep(0.2)
    assert accepted == []
    # A host process can connect there itself: the listener is live.
    with socket.create_connection((host, port), timeout=5):
        pass


def test_rules_installed_idempotently_and_cover_link_local(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox", network=True)
    make_sandbox("busybox", network=True)  # a second ensure must not add a second jump
    # The Docker backend's bridge network, or the runc backend's CNI network ("<name>r", hooked from CNI-ADMIN).
    net, parent = (NET, "DOCKER-USER") if is_docker_id(sb.info.container_id) else (runc_net(), ADMIN_CHAIN)
    chain_in, chain_fwd = chain_names(net)
    bridge = bridge_name(net)
    rules = subprocess.run(["iptables", "-w", "-S"], capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert rules.count(f"-A INPUT -i {bridge} -j {chain_in}") == 1
    assert rules.count(f"-A {parent} -i {bridge} -j {chain_fwd}") == 1
    assert f"-A {chain_fwd} -d 169.254.0.0/16 -j REJECT --reject-with icmp-port-unreachable" in rules
    assert Path("/proc/sys/net/bridge/bridge-nf-call-iptables").read_text().strip() == "1"


def _status_field(sb: Sandbox, name: str) -> str:
    out = sb.run(["grep", f"^{name}:", "/proc/self/status"]).stdout.decode()
    return out.split(":", 1)[1].strip()


def test_capabilities_trimmed_and_no_new_privileges_survive_restore(make_sandbox: Callable[..., Sandbox]) -> None:
    want = sum(1 << _CAP_BITS[c] for c in SANDBOX_CAPABILITIES)
    sb = make_sandbox("bookworm", network=True)
    assert int(_status_field(sb, "CapBnd"), 16) == want
    assert int(_status_field(sb, "CapEff"), 16) == want
    assert _status_field(sb, "NoNewPrivs") == "1"
    with sb.turn():
        sb.session.run("sleep 1000 &")
    ck = sb.checkpoint(kind="full")
    sb.restore(ck)
    r = sb.session.run("grep -E '^(CapBnd|NoNewPrivs):' /proc/$!/status; jobs -p | wc -l")
    lines = dict(line.split(":", 1) for line in r.stdout.decode().strip().splitlines()[:2])
    assert int(lines["CapBnd"].strip(), 16) == want
    assert lines["NoNewPrivs"].strip() == "1"
    [clone] = sb.fork(1, ck)
    try:
        assert int(_status_field(clone, "CapEff"), 16) == want
        assert clone.refresh().ip_address and clone.refresh().ip_address != sb.refresh().ip_address
    finally:
        clone.remove()
