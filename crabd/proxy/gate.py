"""What the OpenAI proxy needs from crabd, and what it counts.

The HTTP layer (``server.py``) talks to crabd only through :class:`TurnGate`,
so it can be tested against a fake, and crabd's side (``crabd/service/
llm_gate.py``) can change without touching HTTP code.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from crabd.models import Caller


class HeldTurn(Protocol):
    """One LLM request's turn end, running in the background while the request is upstream."""

    async def release(self) -> float:
        """Wait until the turn's checkpoint is durable or was skipped; the seconds waited.

        The gate promotes the checkpoint to urgent (the agent is now blocked
        on it).  A failed checkpoint does not raise (it is recorded
        elsewhere); ``CrabError`` is raised only if the turn could not be
        ended at all (e.g. ``SandboxDead``).
        """
        ...

    def abandon(self) -> None:
        """The client went away: drop the waiter.  The turn end and its checkpoint go on."""
        ...


class TurnGate(Protocol):
    """Who may end which sandbox's turn, and ending it."""

    def authorize(self, caller: Caller, sandbox_ref: str) -> str:
        """The id of sandbox ``sandbox_ref`` (id or name) if ``caller`` may use it.

        Raises ``SandboxNotFound``, ``PermissionDenied`` or ``InvalidRequest``.
        """
        ...

    def end_turn(self, sandbox_id: str) -> HeldTurn:
        """Start ending the sandbox's turn in the background; returns at once."""
        ...


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass
class ProxyMetrics:
    """The proxy's counters, rendered in Prometheus' text format by :meth:`render`.

    Labels stay low-cardinality on purpose: a route is one of a few names
    (never a sandbox or a raw path), a status an HTTP code or ``client_gone``.
    """

    #: (route, status) -> requests answered.
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: kind (unreachable, timeout, midstream) -> upstream failures.
    upstream_errors: Counter[str] = field(default_factory=Counter)
    held_seconds_total: float = 0.0
    held_count: int = 0
    in_flight: int = 0

    def count_request(self, route: str, status: int | str) -> None:
        self.requests[(route, str(status))] += 1

    def count_upstream_error(self, kind: str) -> None:
        self.upstream_errors[kind] += 1

    def observe_held(self, seconds: float) -> None:
        self.held_seconds_total += seconds
        self.held_count += 1

    def render(self) -> str:
        """The metrics as Prometheus text lines (ending in a newline)."""
        lines = [
            "# HELP crab_proxy_requests_total Requests the OpenAI proxy answered, by route and status.",
            "# TYPE crab_proxy_requests_total counter",
        ]
        for (route, status), n in sorted(self.requests.items()):
            lines.append(
                f'crab_proxy_requests_total{{route="{_escape_label(route)}",status="{_escape_label(status)}"}} {n}'
            )
        lines += [
            "# HELP crab_proxy_upstream_errors_total Upstream failures (unreachable, timeout, midstream).",
            "# TYPE crab_proxy_upstream_errors_total counter",
        ]
        for kind, n in sorted(self.upstream_errors.items()):
            lines.append(f'crab_proxy_upstream_errors_total{{kind="{_escape_label(kind)}"}} {n}')
        lines += [
            "# HELP crab_proxy_held_seconds Time LLM responses were held until their turn's checkpoint was durable.",
            "# TYPE crab_proxy_held_seconds summary",
            f"crab_proxy_held_seconds_sum {self.held_seconds_total:.6f}",
            f"crab_proxy_held_seconds_count {self.held_count}",
            "# HELP crab_proxy_in_flight Requests the proxy is serving now.",
            "# TYPE crab_proxy_in_flight gauge",
            f"crab_proxy_in_flight {self.in_flight}",
        ]
        return "\n".join(lines) + "\n"
