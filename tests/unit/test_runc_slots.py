"""Network slots without root: the pool's filling, claiming and closing; the CNI hand-over records; the replay.

``tests/integration/test_runc_slots.py`` runs slots on the real host.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from crabd.backends import network
from crabd.backends.runc import bundle, cni, rtnl, slots
from crabd.errors import ContainerRuntimeError
from crabd.util import proc

RESULT = {
    "cniVersion": "1.0.0",
    "interfaces": [{"name": "crabr0"}, {"name": "veth1"}, {"name": "eth0", "mac": "cc:cc:cc:cc:cc:cc"}],
    "ips": [
        {"interface": 2, "address": "fd00::5/64"},
        {"interface": 2, "address": "10.9.0.5/24", "gateway": "10.9.0.1"},
    ],
    "routes": [{"dst": "0.0.0.0/0"}, {"dst": "192.168.7.0/24", "gw": "10.9.0.254"}, {"dst": "::/0"}],
}


def _slot(sid: str) -> slots.Slot:
    return slots.Slot(sid, Path("/run/crab/netns") / sid, cni.CniResult.parse(RESULT))


class Host:
    """What slots exist on a fake host: made, destroyed, and a switch to make ``make`` fail."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.alive: set[str] = set()
        self.destroyed: list[str] = []
        self.made = 0
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()
        self._n = 0

    def new_id(self) -> str:
        with self.lock:
            self._n += 1
            return f"inst-warm{self._n}-0"

    def make(self, sid: str) -> slots.Slot:
        self.gate.wait(10)
        if self.fail:
            raise ContainerRuntimeError("CNI ADD failed", container=sid)
        with self.lock:
            self.alive.add(sid)
            self.made += 1
        return _slot(sid)

    def destroy(self, sid: str) -> list[str]:
        with self.lock:
            self.alive.discard(sid)
            self.destroyed.append(sid)
        return []

    def pool(self, size: int) -> slots.SlotPool:
        return slots.SlotPool(size, new_id=self.new_id, make=self.make, destroy=self.destroy)


def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_nothing_is_made_before_the_first_claim_then_the_pool_fills_to_its_size() -> None:
    host = Host()
    pool = host.pool(3)
    time.sleep(0.1)
    assert host.made == 0 and pool.held() == frozenset()
    assert pool.claim() is None  # the first networked create runs CNI itself, and starts the filler
    _until(lambda: pool.ready() == 3)
    time.sleep(0.1)
    assert host.made == 3 and pool.held() == frozenset(host.alive)
    pool.close()


def test_a_claimed_slot_is_the_claimers_once_held_until_done_and_replaced() -> None:
    host = Host()
    pool = host.pool(2)
    pool.claim()
    _until(lambda: pool.ready() == 2)
    a = pool.claim()
    b = pool.claim()
    assert a is not None and b is not None and a.id != b.id
    # Still held (listings leave it out) while the claimer hands it over; replaced at once.
    assert {a.id, b.id} <= pool.held()
    _until(lambda: pool.ready() == 2)
    assert not {a.id, b.id} & {s.id for s in pool._ready}  # never handed out twice
    pool.done(a.id)
    pool.done(b.id)
    assert not {a.id, b.id} & pool.held()
    assert len(pool.held()) == 2 and host.made == 4
    pool.close()


def test_close_tears_down_the_ready_slots_and_claims_nothing_after() -> None:
    host = Host()
    pool = host.pool(2)
    pool.claim()
    _until(lambda: pool.ready() == 2)
    taken = pool.claim()
    assert taken is not None
    _until(lambda: pool.ready() == 2)
    assert pool.close() == []
    assert host.alive == {taken.id}  # the claimed one is its container's
    assert pool.held() == frozenset({taken.id})
    assert pool.claim() is None
    time.sleep(0.05)
    assert host.alive == {taken.id}


def test_a_slot_in_the_making_at_close_is_torn_down_not_kept() -> None:
    host = Host()
    pool = host.pool(1)
    host.gate.clear()  # the first make blocks
    pool.claim()
    _until(lambda: len(pool.held()) == 1)
    closer = threading.Thread(target=pool.close)
    closer.start()
    time.sleep(0.05)
    host.gate.set()
    closer.join(5)
    assert host.made == 1 and host.alive == set() and pool.held() == frozenset()


def test_a_failing_make_is_retried_with_backoff_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slots, "RETRY_S", 0.05)
    monkeypatch.setattr(slots, "RETRY_MAX_S", 0.2)
    host = Host()
    host.fail = True
    pool = host.pool(2)
    pool.claim()
    time.sleep(0.5)
    # A few tries in 0.5 s (0.05, 0.1, 0.2, 0.2 ...), not a busy loop; each one torn down.
    assert 2 <= pool.failed <= 8
    assert len(host.destroyed) == pool.failed and pool.held() == frozenset()
    host.fail = False
    _until(lambda: pool.ready() == 2)
    pool.close()
    assert host.alive == set()


def test_slots_are_made_only_while_the_backend_is_idle() -> None:
    host = Host()
    busy = threading.Event()
    busy.set()
    pool = slots.SlotPool(2, new_id=host.new_id, make=host.make, destroy=host.destroy, idle=lambda: not busy.is_set())
    pool.claim()
    time.sleep(0.2)
    assert host.made == 0  # a start runs: the cores are its
    busy.clear()
    pool.poke()
    _until(lambda: pool.ready() == 2)
    pool.close()


def test_after_a_start_the_pool_waits_for_a_quiet_spell() -> None:
    host = Host()
    pool = slots.SlotPool(1, new_id=host.new_id, make=host.make, destroy=host.destroy, quiet_s=0.4)
    pool.poke()  # a start just ended
    t0 = time.monotonic()
    pool.claim()
    _until(lambda: pool.ready() == 1)
    assert time.monotonic() - t0 >= 0.35


def test_size_zero_never_makes_a_slot() -> None:
    host = Host()
    pool = host.pool(0)
    assert pool.claim() is None
    time.sleep(0.05)
    assert host.made == 0
    pool.close()


def test_slot_ids_are_this_instances_container_ids_and_never_a_sandboxs() -> None:
    from crabd.backends.runc.naming import parse_id

    sid = slots.new_slot_id("inst")
    parsed = parse_id("inst", sid)
    assert parsed is not None and parsed[0].startswith(slots.SLOT_TAG) and parsed[1] == slots.SLOT_GENERATION
    assert slots.new_slot_id("inst") != sid


# --- the hand-over records (cni.py) ------------------------------------------------------


def test_a_taken_over_attachment_is_deleted_under_the_slots_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    net = cni.CniNetwork(cni.CniSettings(cache_dir=tmp_path))
    calls: list[tuple[str, str, str]] = []

    def fake_run(argv: list[str], **kw: object) -> proc.Completed:
        env = kw["env"]
        assert isinstance(env, dict)
        prev = json.loads(kw["input"]).get("prevResult")  # type: ignore[arg-type]
        calls.append((env["CNI_COMMAND"], env["CNI_CONTAINERID"], "prev" if prev else "none"))
        return proc.Completed(tuple(argv), 0, b"", b"")

    monkeypatch.setattr(proc, "run", fake_run)
    slot_result = net.settings.result_path("inst-warm1-0")
    slot_result.parent.mkdir(parents=True)
    slot_result.write_text(json.dumps(RESULT))
    assert net.cni_id("inst-sb-g") == "inst-sb-g"
    net.take_over("inst-warm1-0", "inst-sb-g")
    # Recorded, not yet renamed (a crash here): the container's DEL finds the slot's result all the same.
    assert net.cni_id("inst-sb-g") == "inst-warm1-0"
    cached = net.cached("inst-sb-g")
    assert cached is not None and str(cached.ip) == "10.9.0.5"
    net.adopt_result("inst-warm1-0", "inst-sb-g")
    assert not slot_result.exists() and net.attached() == ["inst-sb-g"]
    net.delete("inst-sb-g", None)
    assert calls == [("DEL", "inst-warm1-0", "prev"), ("DEL", "inst-warm1-0", "prev")]
    assert net.attached() == [] and not net.settings.claim_path("inst-sb-g").exists()
    assert net.cni_id("inst-sb-g") == "inst-sb-g"


def test_a_crash_between_record_and_rename_leaves_nothing_after_both_teardowns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = cni.CniNetwork(cni.CniSettings(cache_dir=tmp_path))
    monkeypatch.setattr(proc, "run", lambda argv, **kw: proc.Completed(tuple(argv), 0, b"", b""))
    net.settings.result_path("inst-warm1-0").parent.mkdir(parents=True)
    net.settings.result_path("inst-warm1-0").write_text(json.dumps(RESULT))
    net.take_over("inst-warm1-0", "inst-sb-g")
    # Adoption tears both ids down, in any order.
    net.delete("inst-sb-g", None)
    net.delete("inst-warm1-0", None)
    assert list((tmp_path / "results").iterdir()) == [] and list((tmp_path / "claims").iterdir()) == []


def test_the_moved_interface_is_configured_as_the_bridge_plugin_did() -> None:
    addrs, routes = slots._config(cni.CniResult.parse(RESULT))
    assert [str(a) for a in addrs] == ["10.9.0.5/24"]  # IPv4 only
    assert [(str(d), v) for d, v in routes] == [("0.0.0.0/0", "10.9.0.1"), ("192.168.7.0/24", "10.9.0.254")]


def _attrs(body: bytes) -> dict[int, bytes]:
    out, i = {}, 0
    while i < len(body):
        length, kind = struct.unpack_from("=HH", body, i)
        out[kind] = body[i + 4 : i + length]
        i += (length + 3) & ~3
    return out


def test_rtnetlink_requests_are_laid_out_as_the_kernel_reads_them() -> None:
    msg = rtnl.move_link(7, 42)
    length, kind, flags, _, _ = struct.unpack_from("=IHHII", msg)
    assert length == len(msg) and kind == rtnl.RTM_NEWLINK and flags & rtnl.NLM_F_ACK
    assert struct.unpack_from("=BBHiII", msg, 16)[3] == 7
    assert _attrs(msg[32:]) == {rtnl.IFLA_NET_NS_FD: struct.pack("=I", 42)}
    msg = rtnl.add_address(3, ipaddress.IPv4Interface("10.9.0.5/24"))
    assert struct.unpack_from("=BBBBI", msg, 16) == (socket.AF_INET, 24, 0, 0, 3)
    got = _attrs(msg[24:])
    assert got[rtnl.IFA_LOCAL] == got[rtnl.IFA_ADDRESS] == bytes([10, 9, 0, 5])
    assert got[rtnl.IFA_BROADCAST] == bytes([10, 9, 0, 255])
    msg = rtnl.add_route(3, ipaddress.IPv4Network("0.0.0.0/0"), ipaddress.IPv4Address("10.9.0.1"))
    assert struct.unpack_from("=BBBBBBBBI", msg, 16)[:2] == (socket.AF_INET, 0)
    got = _attrs(msg[28:])
    assert rtnl.RTA_DST not in got and got[rtnl.RTA_GATEWAY] == bytes([10, 9, 0, 1])
    assert got[rtnl.RTA_OIF] == struct.pack("=i", 3)
    assert len(rtnl.attr(1, b"abc")) == 8  # padded to 4
    ack = struct.pack("=IHHII", 36, rtnl.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -17) + b"\0" * 16
    assert rtnl.parse_ack(ack) == 17  # EEXIST
    assert rtnl.parse_ack(ack[:16] + struct.pack("=i", 0)) == 0
    with pytest.raises(ValueError):
        rtnl.parse_ack(b"\0" * 8)


def test_a_retried_launch_runs_without_the_slot_the_first_try_tore_down() -> None:
    slot = _slot("i-warm00-0")
    got: list[object] = []

    def launch(restore: str, slot: slots.Slot | None = None) -> str:
        got.append((restore, slot))
        return restore

    run = slots.first_try_only(launch, slot)
    assert run(restore="lazy") == "lazy"
    assert run(restore="eager") == "eager"
    assert got == [("lazy", slot), ("eager", None)]
    assert slots.first_try_only(launch, None)(restore="x") == "x" and got[-1] == ("x", None)


def test_the_conflist_is_written_when_it_differs_and_only_then(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    net = cni.CniNetwork(cni.CniSettings(cache_dir=tmp_path))
    monkeypatch.setattr(network, "require_bridge_netfilter", lambda: None)
    monkeypatch.setattr(network, "require_subnet_free", lambda subnet, bridge: None)
    monkeypatch.setattr(network, "install_rules", lambda *a, **kw: None)
    monkeypatch.setattr(proc, "run", lambda argv, **kw: proc.Completed(tuple(argv), 0, b"", b""))
    writes: list[Path] = []
    real = bundle.write_atomic

    def counted(path: Path, data: bytes, *a: object, **kw: object) -> None:
        writes.append(path)
        real(path, data)

    monkeypatch.setattr(bundle, "write_atomic", counted)
    path = tmp_path / f"{net.settings.name}.conflist"
    monkeypatch.setattr(cni, "RECHECK_S", 0.0)  # every call checks (the limit has its own test)
    net.ensure()
    want = path.read_bytes()
    assert json.loads(want) == cni.conflist(net.settings) and writes == [path]
    net.ensure()  # every later create: the same bytes, nothing written
    assert writes == [path]
    path.write_bytes(want.replace(b'"ipam"', b'"IPAM"'))  # changed behind crabd's back: repaired
    net.ensure()
    assert path.read_bytes() == want and len(writes) == 2
    path.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(want)
    path.symlink_to(elsewhere)  # a link is never read through, and is replaced, not written through
    net.ensure()
    assert not path.is_symlink() and path.read_bytes() == want and len(writes) == 3


def test_the_host_side_is_checked_at_most_once_per_recheck_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = cni.CniNetwork(cni.CniSettings(cache_dir=tmp_path))
    monkeypatch.setattr(network, "require_bridge_netfilter", lambda: None)
    monkeypatch.setattr(network, "require_subnet_free", lambda subnet, bridge: None)
    installs: list[str] = []
    monkeypatch.setattr(network, "install_rules", lambda cfg, **kw: installs.append(kw["forward_parent"]))
    ran: list[tuple[str, ...]] = []

    def fake_run(argv: list[str], **kw: object) -> proc.Completed:
        ran.append(tuple(argv))
        return proc.Completed(tuple(argv), 0, b"", b"")

    monkeypatch.setattr(proc, "run", fake_run)
    now = [1000.0]
    monkeypatch.setattr("crabd.backends.runc.cni.time", SimpleNamespace(monotonic=lambda: now[0]))
    net.ensure()
    assert installs == [cni.ADMIN_CHAIN] and len(ran) == 1  # iptables -L of the admin chain, then the rules
    now[0] += cni.RECHECK_S / 2
    net.ensure()  # a create soon after: trusted, nothing run
    assert len(installs) == 1 and len(ran) == 1
    now[0] += cni.RECHECK_S
    net.ensure()  # past the interval: looked at (and repaired) again
    assert len(installs) == 2 and len(ran) == 2
    monkeypatch.setattr(network, "remove_rules", lambda cfg, **kw: None)
    net.teardown()
    net.ensure()  # right after a teardown: installed again, whatever the clock says
    assert len(installs) == 3
