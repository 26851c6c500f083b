"""Connections to a sandbox's init through spare sockets made in its namespace (crabd/util/netns.py: spares)."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from crabd.coordinator.livestatus import RunningStatus
from crabd.runtime import initsocket
from crabd.util import netns
from crabd.util.netns import Netns, SpareSockets


class CountingMaker(netns.NetnsSockets):
    """Runs each job at once in the calling thread's namespace, counting namespace entries."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[Netns] = []
        #: How many sockets each entry made.
        self.made: list[int] = []

    def submit(self, ns: Netns, make: Callable[[], Any]) -> Future[Any]:
        self.entries.append(ns)
        fut: Future[Any] = Future()
        fut.set_running_or_notify_cancel()
        fut.set_result(make())
        self.made.append(len(fut.result()))
        return fut


@pytest.fixture
def maker(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[CountingMaker, SpareSockets]]:
    counting = CountingMaker()
    spares = SpareSockets(counting, per_entry=4)
    monkeypatch.setattr(initsocket, "netns_spares", spares)
    monkeypatch.setattr(netns, "spares", spares)  # what livestatus forgets through
    yield counting, spares
    spares.close()


@pytest.fixture
def listener() -> Iterator[tuple[str, socket.socket]]:
    """An abstract unix listener standing in for a sandbox's init."""
    name = f"crab-test-spares-{os.getpid()}-{id(object())}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + name)
    srv.listen(64)
    yield name, srv
    srv.close()


def connect(ns: Netns, name: str) -> socket.socket:
    return asyncio.run(initsocket.socket_in_netns(ns, name, 1.0))


def test_a_namespace_is_entered_once_for_several_connections(
    maker: tuple[CountingMaker, SpareSockets], listener: tuple[str, socket.socket]
) -> None:
    counting, spares = maker
    name, srv = listener
    ns = Netns(12345, "c1")
    for _ in range(9):
        sock = connect(ns, name)
        peer, _ = srv.accept()
        sock.sendall(b"x")
        assert peer.recv(1) == b"x"  # each one a working connection of its own
        sock.close()
        peer.close()
    assert counting.entries == [ns, ns, ns]  # 9 connections, 4 sockets per entry
    assert len(spares) == 3


def test_a_spare_that_cannot_connect_takes_its_namespaces_other_spares_with_it(
    maker: tuple[CountingMaker, SpareSockets], listener: tuple[str, socket.socket]
) -> None:
    _, spares = maker
    name, srv = listener
    ns, other = Netns(12345, "c1"), Netns(23456, "c2")
    connect(ns, name).close()
    connect(other, name).close()
    assert len(spares) == 6
    srv.close()  # the init is gone
    with pytest.raises(ConnectionRefusedError):
        connect(ns, name)
    assert len(spares) == 3  # the other sandbox's stay
    assert spares.take(ns) is None


def test_dropping_a_containers_status_closes_its_spares(maker: tuple[CountingMaker, SpareSockets]) -> None:
    _, spares = maker
    spares.make(Netns(1, "c1")).result().close()
    spares.make(Netns(2, "c2")).result().close()
    held = list(spares._spares["c1"][1])
    RunningStatus().drop("c1")
    assert held and all(s.fileno() == -1 for s in held)  # closed: they no longer hold the namespace
    assert spares.take(Netns(1, "c1")) is None
    assert spares.take(Netns(2, "c2")) is not None


def test_a_batch_made_across_a_forget_is_not_kept() -> None:
    """The sandbox may be gone by the time its batch is made: only the caller's socket is handed over."""
    pending: list[tuple[Callable[[], Any], Future[Any]]] = []

    class Later(netns.NetnsSockets):
        def submit(self, ns: Netns, make: Callable[[], Any]) -> Future[Any]:
            fut: Future[Any] = Future()
            pending.append((make, fut))
            return fut

    spares = SpareSockets(Later(), per_entry=4)
    first = spares.make(Netns(1, "c1"))
    spares.forget("c1")
    make, fut = pending.pop()
    fut.set_running_or_notify_cancel()
    fut.set_result(make())
    first.result().close()
    assert len(spares) == 0


def test_a_new_init_of_the_same_container_replaces_the_old_ones_spares(
    maker: tuple[CountingMaker, SpareSockets],
) -> None:
    _, spares = maker
    spares.make(Netns(1, "c1")).result().close()
    spares.make(Netns(2, "c1")).result().close()  # restarted in place: another init pid
    assert spares.take(Netns(1, "c1")) is None
    assert len(spares) == 3


def test_no_more_spares_are_kept_than_the_limit() -> None:
    """Each spare is a descriptor: a thousand sandboxes must not hold eight each."""
    counting = CountingMaker()
    spares = SpareSockets(counting, per_entry=8, limit=10)
    firsts = [spares.make(Netns(i, f"c{i}")).result() for i in range(1, 4)]
    assert len(spares) == 10  # 7 of the first batch, 3 of the second
    assert counting.made == [8, 4, 1]  # no batch larger than what may be kept of it
    assert spares.take(Netns(3, "c3")) is None
    for sock in firsts:
        sock.close()
    spares.forget("c1")
    assert len(spares) == 3
    spares.close()
    assert len(spares) == 0


def test_the_default_limit_is_a_share_of_the_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (800, 4096))
    assert netns.spare_limit() == 100
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1 << 20, 1 << 20))
    assert netns.spare_limit() == netns.MAX_SPARES
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY,) * 2)
    assert netns.spare_limit() == netns.MAX_SPARES
    counting = CountingMaker()
    monkeypatch.setattr(resource, "getrlimit", lambda _: (24, 24))  # room for 3
    spares = SpareSockets(counting, per_entry=8)
    spares.make(Netns(1, "c1")).result().close()
    assert counting.made == [4] and len(spares) == 3
    spares.close()
