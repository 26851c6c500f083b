"""One host of a crab cluster, as seen from Ray: the agent that owns that host's crabd client.

Every host runs its own crabd (own state dir, own Unix socket).  A
:class:`HostAgent` actor, pinned to that host's Ray node, is the only thing
in the cluster that talks to it; drivers anywhere reach the host through the
agent by name (``crab-host:<id>`` in namespace ``crab``).

:class:`HostAgent` is a plain class: unit tests use it without Ray, and
:func:`start_host_agent` makes it an actor at the call site.  Its methods
return plain JSON-able dicts, not SDK objects: a ``Sandbox`` holds a gRPC
channel (it cannot cross processes), and plain data keeps what Ray pickles
independent of the SDK's classes on the driver's side.

Pinning: each host's Ray node carries the custom resource ``crab-host:<id>``
(a large count, :data:`HOST_RESOURCE_UNITS`, so any number of actors and
tasks can ask for one unit); an actor that asks for one unit of it can only
be scheduled there.  ``max_restarts=0``: an agent is never restarted on
another node, because the crabd it talks to is on *this* host; its death is
the "host is gone" signal (:class:`ray.exceptions.ActorDiedError`).
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from crabd.cluster.tls import check_host_id

if TYPE_CHECKING:
    from crabd.sdk import Client

NAMESPACE = "crab"
HOST_RESOURCE_UNITS = 1000


def host_resource(host_id: str) -> str:
    """The Ray custom resource that marks ``host_id``'s node."""
    return f"crab-host:{check_host_id(host_id)}"


def agent_prefix() -> str:
    """What every agent's Ray actor name starts with (the host id follows)."""
    return "crab-host:"


def agent_name(host_id: str) -> str:
    """The Ray actor name of ``host_id``'s agent (in :data:`NAMESPACE`)."""
    return f"{agent_prefix()}{check_host_id(host_id)}"


def node_resources(host_id: str) -> dict[str, float]:
    """The ``resources`` to give ``host_id``'s Ray node (``ray start --resources`` or ``Cluster.add_node``)."""
    return {host_resource(host_id): float(HOST_RESOURCE_UNITS)}


def plain(value: Any) -> Any:
    """``value`` (an SDK record, or containers of them) as JSON-able data: dicts, lists, str, numbers."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


class HostAgent:
    """The cluster's handle on one host's crabd.

    ``capacity`` is how many sandboxes this host takes (crabd itself has no
    such limit to report yet); :meth:`info` reports what is free of it.
    """

    def __init__(self, host_id: str, socket_path: str, *, capacity: int = 8, client: Client | None = None) -> None:
        from crabd.sdk import Client

        self.host_id = check_host_id(host_id)
        self.socket_path = socket_path
        self.capacity = capacity
        self._client = client if client is not None else Client(socket_path)

    def node_id(self) -> str:
        """The Ray node this agent runs on ("" outside Ray)."""
        try:
            import ray
        except ImportError:
            return ""
        if not ray.is_initialized():
            return ""
        return str(ray.get_runtime_context().get_node_id())

    def info(self) -> dict[str, Any]:
        st = self._client.status()
        return {
            "host_id": self.host_id,
            "node_id": self.node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "socket": self.socket_path,
            "crabd_version": st.version,
            "crabd_pid": st.pid,
            "sandboxes": st.sandboxes,
            "capacity": self.capacity,
            "free": max(0, self.capacity - st.sandboxes),
        }

    def create(self, env: str, name: str = "", **options: Any) -> dict[str, Any]:
        """Create a sandbox (``options``: the rest of :class:`crabd.sdk.CreateOptions`); its info."""
        sb = self._client.create(env, name=name, **options)
        return {"host_id": self.host_id, **plain(sb.info)}

    def get(self, sandbox: str) -> dict[str, Any]:
        return {"host_id": self.host_id, **plain(self._client.get(sandbox).info)}

    def list(self) -> builtins.list[dict[str, Any]]:
        return [{"host_id": self.host_id, **plain(sb.info)} for sb in self._client.list()]

    def run(self, sandbox: str, command: str | builtins.list[str], *, timeout: float = 0.0) -> dict[str, Any]:
        """Run ``command`` (argv, or a string split like a shell would) in ``sandbox``; its result (text output)."""
        r = self._client.get(sandbox).run(command, timeout=timeout)
        return {**plain(r), "ok": r.ok}

    def step(self, sandbox: str, command: str, *, timeout: float = 0.0) -> dict[str, Any]:
        """Run ``command`` in the sandbox's session as one turn; its result and turn number.

        The turn's end is not waited for: crab decides and checkpoints it in
        the background (and uploads the checkpoint after), as in any turn.
        """
        sb = self._client.get(sandbox)
        turn = sb.begin_turn()
        try:
            r = sb.session.run(command, timeout=timeout)
        finally:
            sb.end_turn(decision=False)
        return {**plain(r), "ok": r.ok, "turn": turn.number}

    def checkpoint(self, sandbox: str, label: str = "") -> dict[str, Any]:
        return {"host_id": self.host_id, **plain(self._client.get(sandbox).checkpoint(label))}

    def fork(self, checkpoint_id: str, n: int = 1, name_prefix: str = "") -> builtins.list[dict[str, Any]]:
        return [
            {"host_id": self.host_id, **plain(sb.info)}
            for sb in self._client.fork(checkpoint_id, n, name_prefix=name_prefix)
        ]

    def fork_turn(self, sandbox: str, turn: int, n: int = 1, name_prefix: str = "") -> builtins.list[dict[str, Any]]:
        """``n`` forks of ``sandbox`` at the end of ``turn`` (made here: the sandbox lives on this host)."""
        return [
            {"host_id": self.host_id, **plain(sb.info)}
            for sb in self._client.get(sandbox).fork(n, name_prefix=name_prefix, turn=turn)
        ]

    def checkpoint_full(self, sandbox: str, label: str = "") -> dict[str, Any]:
        """A checkpoint with the sandbox's processes (what a migration moves)."""
        return {"host_id": self.host_id, **plain(self._client.get(sandbox).checkpoint(label, kind="full"))}

    def has_checkpoint(self, checkpoint_id: str) -> bool:
        """Whether this host's own store holds ``checkpoint_id`` (not only the bucket)."""
        return any(c.id == checkpoint_id and not c.remote_only for c in self._client.checkpoints())

    def checkpoints(self, *, include_remote: bool = False, sync: bool = False) -> builtins.list[dict[str, Any]]:
        """Every checkpoint this host's crabd lists (``sync``: re-read the bucket's manifests first; root only)."""
        if sync:
            self._client.sync_store()
        return [plain(c) for c in self._client.checkpoints(include_remote=include_remote)]

    def push(self, checkpoint_id: str) -> dict[str, Any]:
        pushed: dict[str, Any] = plain(self._client.push(checkpoint_id))
        return pushed

    def import_sandbox(self, checkpoint_id: str, last_turn: int = -1) -> dict[str, Any]:
        """Bring ``checkpoint_id``'s sandbox to this host, keeping its identity (a :class:`Recovered`, as data)."""
        done: dict[str, Any] = plain(self._client.import_sandbox(checkpoint_id, last_turn=last_turn))
        done["sandbox"]["host_id"] = self.host_id
        return done

    def stop(self, sandbox: str) -> dict[str, Any]:
        return {"host_id": self.host_id, **plain(self._client.get(sandbox).stop())}

    def restore(self, sandbox: str, checkpoint_id: str) -> dict[str, Any]:
        return {"host_id": self.host_id, **plain(self._client.get(sandbox).restore(checkpoint_id))}

    def remove(self, sandbox: str, keep_checkpoints: bool = False) -> None:
        self._client.get(sandbox).remove(keep_checkpoints=keep_checkpoints)

    def close(self) -> None:
        self._client.close()


def start_host_agent(host_id: str, socket_path: str, *, capacity: int = 8) -> Any:
    """Start ``host_id``'s agent on its node (the one with :func:`host_resource`); its Ray actor handle.

    The caller must be connected to the cluster (``ray.init``).  Fails
    (ValueError from Ray) when an agent of that name is alive already.
    """
    import ray

    actor_cls = ray.remote(HostAgent)
    return actor_cls.options(
        name=agent_name(host_id),
        namespace=NAMESPACE,
        # Node-bound: never restarted elsewhere, its death means the host is gone.
        max_restarts=0,
        # Ray's default is 1 CPU per actor *to schedule* it (0 while it runs); an agent
        # mostly waits on crabd, so it takes none and leaves the host's CPUs to tasks.
        num_cpus=0,
        resources={host_resource(host_id): 1},
        # Calls run one at a time per actor unless told otherwise; crabd serves many
        # requests at once, so let a slow checkpoint not queue a quick `list` behind it.
        max_concurrency=8,
        # Ray's default lifetime ties a named actor to the driver that made it; a host's
        # agent outlives the driver that started it.
        lifetime="detached",
    ).remote(host_id, socket_path, capacity=capacity)


def get_host_agent(host_id: str) -> Any:
    """The handle of ``host_id``'s running agent (ValueError from Ray when there is none)."""
    import ray

    return ray.get_actor(agent_name(host_id), namespace=NAMESPACE)
