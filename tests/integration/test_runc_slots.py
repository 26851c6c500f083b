"""Network slots on the real host (backends/runc/slots.py): networked creates take a CNI attachment made ahead.

A sandbox made from a slot must be networked and isolated like one that ran
CNI itself (the address is the slot's, the host reaches it, another sandbox
does not), with and without user namespaces (the interface is moved into
runc's netns, or the slot's netns is joined as it is), and so must a fork
or a restore made from one (the interface moved into the netns CRIU made,
or the slot's netns joined by CRIU).  Removal and a clean
stop leave nothing; a crabd killed with -9 while it held unclaimed slots
leaves nothing once it started again (adoption tears them down, their
leases included).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.backends.runc import cni, slots
from crabd.daemon.app import instance_id
from crabd.errors import HostError
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.integration.conftest import daemon_with_config, instance_containers
from tests.integration.runc_layer import free_subnet
from tests.integration.test_isolation import _probe, _serve

pytestmark = [pytest.mark.integration, pytest.mark.docker]

NET = "crabslot"
CACHE = cni.DEFAULT_CACHE_DIR


def _toml(userns: bool, size: int = 2) -> str:
    return (
        f'[runtime]\nbackend = "runc+btrfs"\nuserns = {str(userns).lower()}\nwarm_network_slots = {size}\n'
        f'[network]\nname = "{NET}"\n'
    )


def _slot_ids(d: EmbeddedDaemon) -> set[str]:
    return {c for c in instance_containers(d.state_dir) if f"-{slots.SLOT_TAG}" in c}


def _wait_slots(d: EmbeddedDaemon, n: int, timeout: float = 60.0) -> set[str]:
    """The slot ids once ``n`` slots are complete (an ADD result kept for each)."""
    deadline = time.monotonic() + timeout
    while True:
        ready = {s for s in _slot_ids(d) if (CACHE / "results" / f"{s}.json").exists()}
        if len(ready) >= n:
            return ready
        assert time.monotonic() < deadline, f"{len(ready)} of {n} network slots made"
        time.sleep(0.1)


def _slot_ip(slot_id: str) -> str:
    return str(json.loads((CACHE / "results" / f"{slot_id}.json").read_text())["ips"][0]["address"]).split("/")[0]


def _leases(d: EmbeddedDaemon) -> list[str]:
    """host-local's leases held by this crabd's ids (its files: named by address, holding the CNI id)."""
    prefix = f"{instance_id(d.state_dir)}-"
    return [
        p.name for p in (CACHE / "ipam").rglob("*") if p.is_file() and p.read_text(errors="replace").startswith(prefix)
    ]


def _claims(d: EmbeddedDaemon) -> list[str]:
    d_ = CACHE / "claims"
    prefix = f"{instance_id(d.state_dir)}-"
    return [p.name for p in d_.iterdir() if p.name.startswith(prefix)] if d_.is_dir() else []


@pytest.fixture(scope="module", params=[True, False], ids=["userns", "no-userns"])
def daemon(request: pytest.FixtureRequest) -> Iterator[EmbeddedDaemon]:
    with daemon_with_config(_toml(request.param), NET) as d:
        yield d


def test_sandboxes_from_slots_are_networked_and_isolated_and_leave_nothing(daemon: EmbeddedDaemon) -> None:
    c = Client(daemon.socket)
    first = c.create("bookworm", network=True)  # no slot yet: it runs CNI, and starts the pool
    made = [first]
    try:
        ready = _wait_slots(daemon, 2)
        ips = {_slot_ip(s) for s in ready}
        a = c.create("bookworm", network=True)
        b = c.create("bookworm", network=True)
        made += [a, b]
        a_ip, b_ip = a.refresh().ip_address, b.refresh().ip_address
        assert {a_ip, b_ip} == ips, "the creates did not take the ready slots"
        assert not ready & _slot_ids(daemon), "a claimed slot's name is still there"
        # Configured as CNI configures it: the address on eth0, the default route through it (no `ip` in bookworm).
        shown = a.run(["cat", "/proc/net/route", "/proc/net/fib_trie"]).stdout.decode()
        assert "eth0\t00000000\t" in shown and f"|-- {a_ip}\n" in shown, shown
        # Networked: the host reaches a server in it; isolated: the other sandbox does not.
        _serve(b, "0.0.0.0", 8000)
        assert urllib.request.urlopen(f"http://{b_ip}:8000/", timeout=10).status == 200
        assert _probe(a, b_ip, 8000) == "ConnectionRefusedError"
        _serve(a, "0.0.0.0", 8000)
        assert urllib.request.urlopen(f"http://{a_ip}:8000/", timeout=10).status == 200
        assert _probe(first, a_ip, 8000) == "ConnectionRefusedError"
    finally:
        for sb in made:
            sb.remove(force=True)
    # Removal leaves nothing of the sandboxes: what is left are the pool's ready slots only.
    left = instance_containers(daemon.state_dir)
    assert left == _slot_ids(daemon) and len(left) <= 2, left
    assert _claims(daemon) == []
    assert len(_leases(daemon)) == len(left)


@pytest.mark.criu
def test_a_sandbox_from_a_slot_checkpoints_and_its_forks_and_restores_take_slots_too(daemon: EmbeddedDaemon) -> None:
    c = Client(daemon.socket)
    c.create("busybox", network=True).remove(force=True)  # the pool runs (from here on, whatever ran before)
    ips = {_slot_ip(s) for s in _wait_slots(daemon, 2)}
    sb = c.create("bookworm", network=True)
    clones: list[Sandbox] = []
    try:
        ip = sb.refresh().ip_address
        assert ip in ips
        _serve(sb, "0.0.0.0", 8000)
        # The moved-in interface is dumped like one CNI made there (userns: --empty-ns network).
        ck = sb.checkpoint(kind="full")
        assert ck.kind == "full"
        # A fork and a restore take slots too: the interface moved into the namespace CRIU made
        # (userns), or the slot's namespace joined by CRIU (no userns).
        ips = {_slot_ip(s) for s in _wait_slots(daemon, 2)}
        clones = sb.fork(1, ck)
        clone_ip = clones[0].info.ip_address
        assert clone_ip in ips and clone_ip != ip
        assert urllib.request.urlopen(f"http://{clone_ip}:8000/", timeout=10).status == 200
        assert urllib.request.urlopen(f"http://{ip}:8000/", timeout=10).status == 200
        sb.restore(ck)
        restored_ip = sb.refresh().ip_address
        assert restored_ip in ips - {clone_ip}, (restored_ip, ips)
        assert urllib.request.urlopen(f"http://{restored_ip}:8000/", timeout=10).status == 200
        shown = sb.run(["cat", "/proc/net/route"]).stdout.decode()
        assert "eth0\t00000000\t" in shown, shown
        assert _probe(sb, clone_ip, 8000) == "ConnectionRefusedError"
    finally:
        for x in [*clones, sb]:
            x.remove(force=True)


def test_a_crabd_killed_with_unclaimed_slots_leaves_nothing_once_restarted() -> None:
    with daemon_with_config(_toml(True, size=3), NET) as d:
        c = Client(d.socket)
        sb = c.create("busybox", network=True)
        cid = sb.refresh().container_id
        old = _wait_slots(d, 3)
        d.kill()
        assert old <= instance_containers(d.state_dir), "a kill -9 tore the slots down?"
        assert len(_leases(d)) == 4
        d.start()
        d.wait_settled()  # crabd serves first and adopts in the background (coordinator/adoption.py)
        # Adoption removed the slots nobody claimed (leases, netns, results); the sandbox lives on.
        assert instance_containers(d.state_dir) == {cid}
        assert len(_leases(d)) == 1
        assert c.get(sb.id).run(["true"]).exit_code == 0
        sb.remove(force=True)
        assert instance_containers(d.state_dir) == set() or _slot_ids(d) == instance_containers(d.state_dir)
        d.close()
        assert instance_containers(d.state_dir) == set()
        assert _leases(d) == [] and _claims(d) == []


def test_a_clean_stop_tears_the_ready_slots_down(tmp_path: Path) -> None:
    with daemon_with_config(_toml(True, size=2), NET) as d:
        c = Client(d.socket)
        c.create("busybox", network=True).remove(force=True)
        assert len(_wait_slots(d, 2)) == 2
        d.close()
        assert instance_containers(d.state_dir) == set()
        assert _leases(d) == []


def test_a_sandbox_subnet_routed_on_another_device_is_refused_and_nothing_is_made() -> None:
    """A networked create on a subnet the host routes elsewhere (a bridge left behind) fails clearly, makes nothing.

    Without the check the create succeeded and the host's connects to the
    sandbox failed with "No route to host": its packets left on the other device.
    """
    subnet = free_subnet(216)
    dummy = f"crableft{os.getpid() % 100000}"  # as a crabd's bridge left behind is: a bridge with no port
    subprocess.run(["ip", "link", "add", dummy, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", f"{subnet.network_address + 1}/24", "dev", dummy], check=True)
        subprocess.run(["ip", "link", "set", dummy, "up"], check=True)
        toml = f'[runtime]\nbackend = "runc+btrfs"\nsubnet = "{subnet}"\n[network]\nname = "crabclash"\n'
        with daemon_with_config(toml, "crabclash") as d, Client(d.socket) as c:
            with pytest.raises(HostError, match="already routed elsewhere") as info:
                c.create("busybox", network=True)
            assert f"{subnet} on {dummy}" in str(info.value) and "[runtime] subnet" in str(info.value.hint)
            assert c.list() == [] and instance_containers(d.state_dir) == set()
            assert subprocess.run(["ip", "link", "show", "crabclashr0"], capture_output=True).returncode != 0
            sb = c.create("busybox")  # a sandbox without a network does not need the subnet
            assert sb.run(["true"]).exit_code == 0
    finally:
        subprocess.run(["ip", "link", "del", dummy], check=False)
