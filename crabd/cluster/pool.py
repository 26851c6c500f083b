"""How the cluster layer reaches each host's agent: the :class:`AgentPool` Protocol and its two backends.

* :class:`RayPool` calls the :class:`~crabd.cluster.hosts.HostAgent` actors
  by name over Ray.  Ray's own failures are translated here, at this one
  edge: a dead actor, an unreachable node or a call past its time limit
  becomes :class:`~crabd.errors.HostUnavailable` naming the host; an error
  crabd raised on the host (a :class:`~crabd.errors.CrabError`, which
  pickles with its data) is re-raised as itself.
* :class:`LocalPool` holds agents in this process (plain objects with the
  agent's methods): unit tests, and a single host without Ray.

Calls that fan out (a fork spread over hosts, recovering a lost host's
sandboxes on several) go through :meth:`AgentPool.gather`, which runs them
at once and returns each result or its error in order, so the caller can
undo the ones that succeeded when another failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from crabd.errors import CrabError, HostUnavailable

#: Seconds a call to an agent may take before its host counts as unavailable.  Generous: a fork
#: of several process checkpoints, or an import that fetches from the bucket, takes seconds.
CALL_TIMEOUT_S = 300.0
#: Seconds an agent has to answer a liveness probe (``info``).
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Call:
    """One method call on one host's agent."""

    host: str
    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


class AgentPool(Protocol):
    def hosts(self) -> list[str]:
        """The hosts whose agents this pool can reach by name (alive or not), sorted."""
        ...

    def call(self, call: Call, *, timeout: float = CALL_TIMEOUT_S) -> Any:
        """The result of ``call``; HostUnavailable when its host does not answer, or crabd's CrabError."""
        ...

    def gather(self, calls: Sequence[Call], *, timeout: float = CALL_TIMEOUT_S) -> list[Any]:
        """Run ``calls`` at once; each one's result, or the CrabError it failed with, in order."""
        ...


class LocalPool:
    """Agents in this process, by host id; a host in :attr:`down` answers nothing (as a lost node)."""

    def __init__(self, agents: Mapping[str, Any]) -> None:
        self.agents = dict(agents)
        self.down: set[str] = set()

    def hosts(self) -> list[str]:
        return sorted(self.agents)

    def call(self, call: Call, *, timeout: float = CALL_TIMEOUT_S) -> Any:
        agent = self.agents.get(call.host)
        if agent is None or call.host in self.down:
            raise HostUnavailable(f"host {call.host!r} does not answer", host=call.host, gone=True)
        return getattr(agent, call.method)(*call.args, **call.kwargs)

    def gather(self, calls: Sequence[Call], *, timeout: float = CALL_TIMEOUT_S) -> list[Any]:
        out: list[Any] = []
        for c in calls:
            try:
                out.append(self.call(c, timeout=timeout))
            except CrabError as exc:
                out.append(exc)
        return out


class RayPool:
    """The agents of a running Ray cluster (the caller has done ``ray.init``), found by name."""

    def __init__(self) -> None:
        self._handles: dict[str, Any] = {}

    def hosts(self) -> list[str]:
        from ray.util import list_named_actors

        from crabd.cluster.hosts import NAMESPACE, agent_prefix

        names = list_named_actors(all_namespaces=True)
        return sorted(
            n["name"].removeprefix(agent_prefix())
            for n in names
            if n.get("namespace") == NAMESPACE and n["name"].startswith(agent_prefix())
        )

    def _handle(self, host: str) -> Any:
        from crabd.cluster.hosts import get_host_agent

        handle = self._handles.get(host)
        if handle is None:
            try:
                handle = get_host_agent(host)
            except ValueError as exc:  # Ray: no live actor of that name
                raise HostUnavailable(f"host {host!r} has no agent in the cluster", host=host, gone=True) from exc
            self._handles[host] = handle
        return handle

    def _submit(self, call: Call) -> Any:
        return getattr(self._handle(call.host), call.method).remote(*call.args, **call.kwargs)

    def call(self, call: Call, *, timeout: float = CALL_TIMEOUT_S) -> Any:
        result = self.gather([call], timeout=timeout)[0]
        if isinstance(result, CrabError):
            raise result
        return result

    def gather(self, calls: Sequence[Call], *, timeout: float = CALL_TIMEOUT_S) -> list[Any]:
        import ray

        refs: list[Any] = []
        for c in calls:
            try:
                refs.append(self._submit(c))
            except CrabError as exc:
                refs.append(exc)
        out: list[Any] = []
        for c, ref in zip(calls, refs, strict=True):
            if isinstance(ref, CrabError):
                out.append(ref)
                continue
            try:
                out.append(ray.get(ref, timeout=timeout))
            except Exception as exc:  # translated here: Ray has many error types
                out.append(self._translate(c, exc))
        return out

    def _translate(self, call: Call, exc: Exception) -> CrabError:
        """A Ray failure of ``call`` as crab's error (crabd's own errors come through unchanged)."""
        from ray import exceptions as rex

        cause = getattr(exc, "cause", None)
        if isinstance(exc, rex.RayTaskError) and isinstance(cause, CrabError):
            return cause
        if isinstance(exc, CrabError):
            return exc
        if isinstance(exc, (rex.RayActorError, rex.GetTimeoutError, rex.NodeDiedError)):
            # The handle may point at a dead actor: look the name up again next time.
            self._handles.pop(call.host, None)
            return HostUnavailable(
                f"host {call.host!r} did not answer {call.method}: {type(exc).__name__}: {exc}",
                host=call.host,
                # Only a dead actor means the host is gone; a timeout or a transient loss may pass.
                gone=isinstance(exc, (rex.ActorDiedError, rex.NodeDiedError)),
            )
        return CrabError(f"the agent of host {call.host!r} failed {call.method}: {type(exc).__name__}: {exc}")
