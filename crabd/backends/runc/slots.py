"""Network slots: CNI attachments made ahead, so that a networked create, restore or fork runs no plugins.

Running the CNI plugins is a networked create's largest step (docs/runc.md,
"Creating a sandbox": three plugin processes, host-local's lock and the
firewall plugin's iptables calls, 50-200 ms of a create on a 2-core host).  A slot is
that work done beforehand: a network namespace made by crabd (``lo`` up,
the sandbox sysctls set) with the CNI ADD done in it under the slot's own
id.  A slot's id is a container id of this instance,
``<instance>-warm<hex>-0``, so every piece of it (the named netns, the kept
CNI result) is found, listed and torn down by the same code as a
container's (:mod:`.cleanup`), and adoption after a crash removes a slot
nobody claimed like any other container no registry row names.

A slot serves one container, once.  The hand-over (:func:`take_netns`,
:func:`move_into`) first records the claim (``<cni cache>/claims/<container
id>``, :meth:`.cni.CniNetwork.take_over`), then moves the attachment, then
renames the kept result to the container's and unpins the slot's name.
From the record on, the container's teardown DELs under the slot's id, so
its lease and rules go with the container; a crash before the rename leaves
the slot's name as well, which is torn down on its own (DEL is idempotent).
A failed launch tears down the container and the slot: a slot is never put
back.

The two kinds of container take a slot differently:

* without a user namespace the container joins a netns crabd made, by path:
  the slot's namespace is pinned again under the container's name and
  joined as it is;
* with one (the default) the container's netns must be runc's own, made
  inside its user namespace (bundle.py: the kernel lets only that
  namespace's root mount sysfs, and CRIU refuses namespaces of another
  owner), so the slot's interface is moved into it after ``runc create``
  or, for a restore, after ``runc restore`` (whose CRIU made the namespace,
  empty), over rtnetlink (:mod:`.rtnl`: no `ip` processes).  A moved interface loses
  its addresses and routes (the kernel flushes them when a device leaves
  its namespace), so they are set again from the kept CNI result, as the
  bridge plugin set them: the addresses, the link up, the routes via the
  gateway.  Its MAC, and so the bridge's and the firewall's view of it, stays.

:class:`SlotPool` keeps up to ``size`` slots ready, made one at a time on a
thread of its own; it starts after the first claim (a crabd whose sandboxes
never ask for a network never makes one) and makes a slot whenever one was
taken and no start is running (the backend's ``idle``).  The pool's ids
are :meth:`SlotPool.held`: the backend leaves them out of its listings, so
neither adoption nor the recovery watch takes a slot in the making for a
leftover.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from crabd.backends.network import SANDBOX_SYSCTLS
from crabd.backends.runc import named_netns, rtnl
from crabd.backends.runc.cleanup import Layout
from crabd.backends.runc.cni import IFNAME, CniNetwork, CniResult
from crabd.backends.runc.naming import container_id
from crabd.errors import ContainerRuntimeError, CrabError
from crabd.util.threads import on_own_thread

log = logging.getLogger("crabd.runc.slots")

T = TypeVar("T")

#: A slot's sandbox part starts so: never a sandbox id crabd makes (those are hex).
SLOT_TAG = "warm"
SLOT_GENERATION = "0"
#: After a failed make, the filler waits this long (doubling up to the max) before it tries again.
RETRY_S = 0.5
RETRY_MAX_S = 30.0
#: How often a waiting filler looks again whether the backend is idle (it is also poked when a start ends).
IDLE_POLL_S = 0.1
#: After a start ended, how long nothing else must start before the pool makes a slot (the create's rest runs).
QUIET_S = 0.3
#: How long :meth:`SlotPool.close` waits for a slot in the making.
CLOSE_WAIT_S = 30.0


@dataclass(frozen=True)
class Slot:
    """A ready slot: its id (a container id of this instance), its pinned netns, and its CNI ADD result."""

    id: str
    netns: Path
    network: CniResult


def new_slot_id(instance: str) -> str:
    return container_id(instance, SLOT_TAG + secrets.token_hex(5), SLOT_GENERATION)


def make_slot(layout: Layout, network: CniNetwork, slot_id: str) -> Slot:
    """A slot: a netns (``lo`` up, sysctls set) pinned at the slot's name, attached to the network."""
    ns = named_netns.create(slot_id, layout.netns, SANDBOX_SYSCTLS)
    try:
        result = network.add(slot_id, ns)
    except BaseException:
        named_netns.remove(slot_id, layout.netns)
        raise
    return Slot(slot_id, ns, result)


def destroy_slot(layout: Layout, network: CniNetwork, slot_id: str) -> list[str]:
    """DEL the slot's attachment and unpin its netns (each tolerates a missing piece); the errors."""
    errors = []
    for step in (
        lambda: network.delete(slot_id, named_netns.path_of(slot_id, layout.netns)),
        lambda: named_netns.remove(slot_id, layout.netns),
    ):
        try:
            step()
        except (ContainerRuntimeError, OSError) as exc:
            errors.append(f"{slot_id}: {exc}")
    return errors


def take_netns(layout: Layout, network: CniNetwork, slot: Slot, cid: str) -> CniResult:
    """Make the slot's attachment ``cid``'s, its namespace already pinned as ``cid``'s (``named_netns.bind``).

    For a container without a user namespace, which joins that namespace by
    path.  The caller pins it under ``cid`` first: that refuses a taken id
    before any record of the owner's is touched.
    """
    network.take_over(slot.id, cid)
    network.adopt_result(slot.id, cid)
    named_netns.remove(slot.id, layout.netns)  # the container's pin keeps the namespace
    return slot.network


def _config(result: CniResult) -> tuple[list[ipaddress.IPv4Interface], list[tuple[ipaddress.IPv4Network, str]]]:
    """The bridge plugin's configuration of the container's interface, from its result: (addresses, routes).

    IPv4 only (the network is; the sandboxes have IPv6 off).  A route
    without its own gateway goes via the address's, as the plugin does it.
    """
    addrs = []
    for entry in result.raw.get("ips") or ():
        addr = ipaddress.ip_interface(str(entry["address"]))
        if isinstance(addr, ipaddress.IPv4Interface):
            addrs.append(addr)
    routes = []
    for route in result.raw.get("routes") or ():
        dst = ipaddress.ip_network(str(route["dst"]))
        via = route.get("gw") or result.gateway
        if isinstance(dst, ipaddress.IPv4Network) and via:
            routes.append((dst, str(via)))
    return addrs, routes


def move_into(layout: Layout, network: CniNetwork, slot: Slot, cid: str) -> CniResult:
    """Move the slot's interface into the netns pinned as ``cid`` and configure it there (module docstring)."""
    network.take_over(slot.id, cid)
    target = named_netns.path_of(cid, layout.netns)
    addrs, routes = _config(slot.network)

    def work() -> None:
        # One throwaway thread, in the slot's netns and then in the container's (rtnl.py: a netlink
        # socket acts where its thread is).
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
        try:
            named_netns.enter(slot.netns)
            rtnl.request(rtnl.move_link(socket.if_nametoindex(IFNAME), fd), f"move {IFNAME} into {cid}")
        finally:
            os.close(fd)
        named_netns.enter(target)
        index = socket.if_nametoindex(IFNAME)
        for addr in addrs:
            rtnl.request(rtnl.add_address(index, addr), f"address {addr} on {IFNAME}")
        rtnl.request(rtnl.link_up(index), f"{IFNAME} up")
        for dst, via in routes:
            rtnl.request(rtnl.add_route(index, dst, ipaddress.IPv4Address(via)), f"route {dst} via {via}")

    try:
        on_own_thread(work, "crab-slot")
    except OSError as exc:
        raise ContainerRuntimeError(f"network slot {slot.id} not moved into {cid}: {exc}", container=cid) from exc
    network.adopt_result(slot.id, cid)
    named_netns.remove(slot.id, layout.netns)  # empty now: the namespace goes with its pin
    return slot.network


def first_try_only(launch: Callable[..., T], slot: Slot | None) -> Callable[..., T]:
    """``launch`` given ``slot=slot`` on its first call only, ``slot=None`` on any later one.

    A failed launch tore its slot down (a slot is never put back), so a second
    try (an eager restore after a lazy one failed: lazy_restores.py) runs the
    CNI step itself.
    """
    left = [slot]

    def run(*args: Any, **kwargs: Any) -> T:
        given, left[0] = left[0], None
        return launch(*args, slot=given, **kwargs)

    return run


class SlotPool:
    """Up to ``size`` ready slots, made by ``make(id)`` on a thread of its own; ``destroy(id)`` tears one down.

    Thread-safe.  :meth:`claim` takes a ready slot (or None); the claimer
    calls :meth:`done` once the slot is the container's or destroyed.
    """

    def __init__(
        self,
        size: int,
        *,
        new_id: Callable[[], str],
        make: Callable[[str], Slot],
        destroy: Callable[[str], list[str]],
        idle: Callable[[], bool] = lambda: True,
        quiet_s: float = 0.0,
    ) -> None:
        self.size = size
        self._idle = idle
        self._quiet_s = quiet_s
        self._poked = 0.0
        self._new_id = new_id
        self._make = make
        self._destroy = destroy
        self._cond = threading.Condition()
        self._ready: list[Slot] = []
        #: Every id whose pieces may exist and are the pool's or a claimer's (ready, in the making, claimed).
        self._held: set[str] = set()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._in_making: str | None = None
        self.made = 0
        self.failed = 0

    def held(self) -> frozenset[str]:
        with self._cond:
            return frozenset(self._held)

    def ready(self) -> int:
        with self._cond:
            return len(self._ready)

    def claim(self) -> Slot | None:
        """A ready slot, now the caller's (None if none is ready); starts the filler on first use."""
        with self._cond:
            if self._closed or self.size <= 0:
                return None
            if self._thread is None:
                self._thread = threading.Thread(target=self._fill, name="crab-slots", daemon=True)
                self._thread.start()
            slot = self._ready.pop(0) if self._ready else None
            self._cond.notify_all()
            return slot

    def done(self, slot_id: str) -> None:
        """The claimed slot is the container's now, or destroyed: its id is no longer the pool's."""
        with self._cond:
            self._held.discard(slot_id)

    def poke(self) -> None:
        """A start ended: the backend may be idle now, or after ``quiet_s`` more of nothing."""
        with self._cond:
            self._poked = time.monotonic()
            self._cond.notify_all()

    def _may_make(self) -> bool:
        return (
            len(self._ready) + self._making() < self.size
            and time.monotonic() - self._poked >= self._quiet_s
            and self._idle()
        )

    def _next(self) -> str | None:
        """The id of the next slot to make, held already; None once closed.

        Only while ``idle()`` and ``quiet_s`` after the last start ended: a
        slot made while a create runs (its start, and then its init's
        handshake, session and baseline checkpoint) would take the cores
        from it (the CNI plugins are most of a networked create's CPU) and
        save nothing.  Under a sustained load the pool drains and creates
        run CNI themselves, as without it; a burst after a pause finds it
        full.  :meth:`poke` wakes it up; it also looks again every IDLE_POLL_S.
        """
        with self._cond:
            while not self._closed and not self._may_make():
                self._cond.wait(IDLE_POLL_S)
            if self._closed:
                return None
            sid = self._new_id()
            self._held.add(sid)  # before any piece of it exists: listings leave it out
            self._in_making = sid
            return sid

    def _making(self) -> int:
        return int(self._in_making is not None)

    def _fill(self) -> None:
        backoff = RETRY_S
        while (sid := self._next()) is not None:
            try:
                slot = self._make(sid)
            except (CrabError, OSError) as exc:
                log.warning("network slot not made", extra={"slot": sid, "error": str(exc)})
                left = self._destroy(sid)
                with self._cond:
                    self._in_making = None
                    self.failed += 1
                    if not left:
                        self._held.discard(sid)  # else kept out of listings: adoption at the next start takes it
                    self._cond.wait(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                continue
            backoff = RETRY_S
            with self._cond:
                self._in_making = None
                self.made += 1
                if not self._closed:
                    self._ready.append(slot)
                    self._cond.notify_all()
                    continue
            self._destroy_held(sid)

    def _destroy_held(self, sid: str) -> list[str]:
        errors = self._destroy(sid)
        if errors:
            log.warning("network slot not torn down", extra={"slot": sid, "errors": errors})
        with self._cond:
            self._held.discard(sid)
        return errors

    def close(self) -> list[str]:
        """Stop making slots and tear down the ready ones; the errors (what is left, adoption removes later)."""
        with self._cond:
            self._closed = True
            ready, self._ready = self._ready, []
            self._cond.notify_all()
            thread = self._thread
        errors: list[str] = []
        for slot in ready:
            errors += self._destroy_held(slot.id)
        if thread is not None:
            thread.join(CLOSE_WAIT_S)  # a slot in the making is torn down by the filler itself
        return errors
