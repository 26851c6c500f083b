"""The cluster registry's bookkeeping and placement, without Ray."""

from __future__ import annotations

import pytest

from crabd.cluster.hosts import HostAgent, agent_name, host_resource, node_resources, plain
from crabd.cluster.registry import Registry
from crabd.errors import NoCapacity
from crabd.models import CheckpointKind


def registry(**caps: int) -> Registry:
    r = Registry()
    for h, c in caps.items():
        r.add_host(h, c)
    return r


def test_place_spreads_fewest_loaded_first() -> None:
    r = registry(a=4, b=4, c=4)
    r.assign("s1", "a")
    r.assign("s2", "a")
    r.assign("s3", "b")
    assert r.place(5) == ["c", "b", "c", "a", "b"]
    # Nothing recorded by place itself.
    assert r.load("c") == 0


def test_place_ties_prefer_more_free_then_smaller_id() -> None:
    r = registry(b=2, a=2, c=5)
    assert r.place(3) == ["c", "a", "b"]
    assert r.place(3) == r.place(3)  # deterministic


def test_place_respects_capacity_exclude_and_dead_hosts() -> None:
    r = registry(a=1, b=3, c=3)
    r.assign("x", "b")
    assert r.place(3, exclude=["c"]) == ["a", "b", "b"]
    with pytest.raises(NoCapacity):
        r.place(4, exclude=["c"])
    assert r.mark_dead("b") == ["x"]
    assert r.place(4) == ["c", "a", "c", "c"]
    with pytest.raises(NoCapacity):
        r.place(5)
    assert r.place(0) == []


def test_hosts_and_sandbox_map() -> None:
    r = registry(a=2, b=1)
    r.assign("s1", "a")
    r.assign("s2", "a")
    r.assign("s2", "b")  # moved
    assert r.host_of("s2") == "b"
    assert r.sandboxes_on("a") == ["s1"]
    assert r.hosts() == {
        "a": {"capacity": 2, "alive": True, "load": 1, "free": 1},
        "b": {"capacity": 1, "alive": True, "load": 1, "free": 0},
    }
    assert r.remove_host("a") == ["s1"]
    assert r.host_of("s1") is None
    r.forget("s2")
    assert r.sandboxes_on("b") == []
    with pytest.raises(KeyError):
        r.assign("s3", "a")
    with pytest.raises(ValueError):
        r.add_host("bad id", 1)
    with pytest.raises(ValueError):
        r.place(-1)


def test_names_and_resources() -> None:
    assert host_resource("h-1") == agent_name("h-1") == "crab-host:h-1"
    assert node_resources("b") == {"crab-host:b": 1000.0}


def test_plain_makes_json_data() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Rec:
        kind: CheckpointKind
        out: bytes
        tags: dict[str, tuple[int, ...]]

    assert plain([Rec(CheckpointKind.FULL, b"hi\n", {"t": (1, 2)})]) == [
        {"kind": CheckpointKind.FULL.value, "out": "hi\n", "tags": {"t": [1, 2]}}
    ]


class _FakeClient:
    def __init__(self) -> None:
        self.closed = False

    def status(self) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(version="0.1.0", pid=42, sandboxes=3)

    def close(self) -> None:
        self.closed = True


def test_host_agent_info_without_ray() -> None:
    fake = _FakeClient()
    agent = HostAgent("a", "/tmp/none.sock", capacity=5, client=fake)  # type: ignore[arg-type]
    info = agent.info()
    assert info["host_id"] == "a"
    assert (info["sandboxes"], info["capacity"], info["free"]) == (3, 5, 2)
    assert info["node_id"] == ""
    agent.close()
    assert fake.closed


def test_an_unreachable_cluster_address_fails_fast_and_clearly() -> None:
    import socket
    import time

    from crabd.cluster.connect import _reachable
    from crabd.errors import HostUnavailable, InvalidRequest

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        t0 = time.monotonic()
        with pytest.raises(HostUnavailable, match=f"127.0.0.1:{port}"):
            _reachable(f"127.0.0.1:{port}")
        assert time.monotonic() - t0 < 5
    with pytest.raises(InvalidRequest, match="HOST:PORT"):
        _reachable("no-port-here")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        _reachable(f"127.0.0.1:{s.getsockname()[1]}")
