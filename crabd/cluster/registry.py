"""Which sandbox lives on which host, and where new sandboxes go.

:class:`Registry` is plain, deterministic Python (unit-tested without Ray);
:func:`start_registry` runs one as a named Ray actor (``crab-registry`` in
namespace ``crab``) so every driver sees the same map.  The registry holds
no sandbox state of its own: each host's crabd is the truth about its
sandboxes, and the map can be rebuilt from the agents' ``list()``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from crabd.cluster.hosts import NAMESPACE
from crabd.cluster.tls import check_host_id
from crabd.errors import CrabError, NoCapacity

REGISTRY_NAME = "crab-registry"
#: The resource Ray gives the head node only.
HEAD_NODE_RESOURCE = "node:__internal_head__"


@dataclass
class HostState:
    capacity: int
    alive: bool = True


@dataclass
class Placed:
    """Where one sandbox lives, and the last turn the cluster saw it end (what a lost host's recovery reports)."""

    host: str
    name: str = ""
    turn: int = 0


class Registry:
    """Hosts with their capacity, and sandbox id → host id."""

    def __init__(self) -> None:
        self._hosts: dict[str, HostState] = {}
        self._where: dict[str, Placed] = {}

    # --- hosts -----------------------------------------------------------------------
    def add_host(self, host_id: str, capacity: int) -> None:
        """Register ``host_id`` (or update its capacity; a host that comes back is alive again)."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, not {capacity}")
        self._hosts[check_host_id(host_id)] = HostState(capacity)

    def mark_dead(self, host_id: str) -> list[str]:
        """``host_id`` is gone: no new placements there; its sandboxes (to recover elsewhere), sorted."""
        self._host(host_id).alive = False
        return self.sandboxes_on(host_id)

    def remove_host(self, host_id: str) -> list[str]:
        """Forget ``host_id`` and its sandboxes; returns the sandboxes it had, sorted."""
        self._host(host_id)
        gone = self.sandboxes_on(host_id)
        for sb in gone:
            del self._where[sb]
        del self._hosts[host_id]
        return gone

    def host_known(self, host_id: str) -> bool:
        return host_id in self._hosts

    def hosts(self) -> dict[str, dict[str, Any]]:
        return {
            h: {"capacity": s.capacity, "alive": s.alive, "load": self.load(h), "free": self.free(h)}
            for h, s in sorted(self._hosts.items())
        }

    def load(self, host_id: str) -> int:
        self._host(host_id)
        return sum(1 for p in self._where.values() if p.host == host_id)

    def free(self, host_id: str) -> int:
        return max(0, self._host(host_id).capacity - self.load(host_id))

    # --- sandboxes -------------------------------------------------------------------
    def assign(self, sandbox_id: str, host_id: str, name: str = "", turn: int = 0) -> None:
        """Record that ``sandbox_id`` lives on ``host_id`` (a move replaces where it was)."""
        self._host(host_id)
        self._where[sandbox_id] = Placed(host_id, name, turn)

    def note_turn(self, sandbox_id: str, turn: int) -> None:
        """The cluster saw ``sandbox_id`` at ``turn`` (kept if it is the latest seen)."""
        placed = self._where.get(sandbox_id)
        if placed is not None and turn > placed.turn:
            placed.turn = turn

    def forget(self, sandbox_id: str) -> None:
        self._where.pop(sandbox_id, None)

    def host_of(self, sandbox_id: str) -> str | None:
        placed = self._where.get(sandbox_id)
        return None if placed is None else placed.host

    def placed(self, sandbox_id: str) -> dict[str, Any] | None:
        """Where ``sandbox_id`` lives, its name and last seen turn (None: not known here)."""
        p = self._where.get(sandbox_id)
        return None if p is None else {"host": p.host, "name": p.name, "turn": p.turn}

    def find(self, ref: str) -> str | None:
        """The id of the sandbox whose id or name is ``ref`` (None: not known here)."""
        if ref in self._where:
            return ref
        named = [sb for sb, p in self._where.items() if p.name == ref]
        return named[0] if len(named) == 1 else None

    def sandboxes_on(self, host_id: str) -> list[str]:
        return sorted(sb for sb, p in self._where.items() if p.host == host_id)

    # --- placement -------------------------------------------------------------------
    def place(self, n: int, exclude: Iterable[str] = ()) -> list[str]:
        """Host ids for ``n`` new sandboxes, one per sandbox, spread over alive hosts with free capacity.

        Each goes to the least-loaded eligible host at that moment (load
        counts the sandboxes placed earlier in this call); ties go to the host
        with more free capacity, then to the smaller host id, so the same
        state always gives the same answer.  Nothing is recorded: the caller
        :meth:`assign`-s each sandbox once its host has made it.  Raises
        NoCapacity when the eligible hosts' free capacity is below ``n``.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, not {n}")
        skip = set(exclude)
        load = {h: self.load(h) for h, s in self._hosts.items() if s.alive and h not in skip}
        free = {h: self._hosts[h].capacity - load[h] for h in load}
        total = sum(max(0, f) for f in free.values())
        if total < n:
            raise NoCapacity(
                f"cannot place {n} sandboxes: {total} free on {len(load)} live hosts (excluded: {sorted(skip)})",
                requested=n,
                free=total,
            )
        out: list[str] = []
        for _ in range(n):
            host = min((h for h in load if free[h] > 0), key=lambda h: (load[h], -free[h], h))
            out.append(host)
            load[host] += 1
            free[host] -= 1
        return out

    def _host(self, host_id: str) -> HostState:
        try:
            return self._hosts[host_id]
        except KeyError:
            raise KeyError(f"unknown host {host_id!r}") from None


def start_registry() -> Any:
    """Start the cluster's registry actor (or get the running one); its handle.  Needs ``ray.init``."""
    import ray

    return (
        ray.remote(Registry)
        .options(
            name=REGISTRY_NAME,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            # On the head node, which the cluster cannot lose without losing Ray itself: on any
            # other node the registry would die with the very host whose loss it must report.
            resources={HEAD_NODE_RESOURCE: 0.001},
            # One registry; a restart would start empty (rebuild from the agents' list()).
            max_restarts=0,
        )
        .remote()
    )


class RegistryProxy:
    """A :class:`Registry` Ray actor, called like the plain object (each call waits for its answer)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def __getattr__(self, name: str) -> Any:
        import ray

        method = getattr(self._handle, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return ray.get(method.remote(*args, **kwargs))
            except ray.exceptions.RayTaskError as exc:
                # The registry's own errors (NoCapacity, an unknown host) reach the caller as themselves.
                if isinstance(exc.cause, (CrabError, KeyError, ValueError)):
                    raise exc.cause from exc
                raise

        return call
