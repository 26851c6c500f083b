"""Fault injection for the harness: kill a sandbox, kill -9 crabd, or preempt with a grace period.

Each faulted task gets one fault, during the LLM wait before a random turn
(agents spend most of their time there; it is also when crab's checkpoint
of the previous turn may still be in flight).  A crabd kill hits every
task in flight on the host, as it would in production; the supervisor here
plays systemd and starts crabd again at once.  So that a task meets about
one crabd kill rather than one per concurrent task, a task's kill is
skipped when crabd was killed less than ``KILL_SPACING_S`` before (the
number of kills is reported).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from crabd.errors import CrabError
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from crabd.util import cgroups

FAULTS = ("sandbox-kill", "crabd-kill", "preempt")
#: Grace period of a preemption notice (cloud spot notices give 30 s to 2 min; a short one here).
PREEMPT_GRACE_S = 10.0
#: Least time between two crabd kills (a kill asked for sooner is skipped: that task already met one).
KILL_SPACING_S = 20.0
#: How long an agent waits for crabd to come back before it gives up.
DAEMON_BACK_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class FaultPlan:
    kind: str
    #: The oracle turn whose preceding LLM wait the fault hits (1.. so some work can be lost).
    before_turn: int
    #: Delay into that wait.
    delay_s: float

    @classmethod
    def draw(cls, kind: str, turns: int, rng: random.Random) -> FaultPlan:
        return cls(kind, rng.randrange(1, turns) if turns > 1 else 0, rng.uniform(0.0, 0.6))


def kill_container(sb: Sandbox) -> None:
    """SIGKILL the sandbox's container, as a crash or an OOM kill would."""
    cid = sb.refresh().container_id
    if cid:
        cgroups.kill_init(cid)


class Supervisor:
    """crabd for one harness run: its own state directory; ``kill()`` is kill -9 plus a restart."""

    def __init__(self, base: Path, extra_args: list[str] | None = None) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.daemon = EmbeddedDaemon(state_dir=base, ephemeral=True, extra_args=extra_args)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.kills = 0
        self._last_kill = 0.0

    @property
    def socket(self) -> Path:
        return self.daemon.socket

    def __enter__(self) -> Supervisor:
        self.daemon.start()
        # Every arm starts with its probes attached; after a kill crabd serves at once (the scan
        # decides until the probes are back), which is what the crabd-kill arm measures.
        self.daemon.wait_inspector()
        self._ready.set()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self.daemon.close()

    def kill(self) -> None:
        """kill -9 crabd, then start it again (skipped within KILL_SPACING_S of the last kill)."""
        with self._lock:
            if self._last_kill and time.monotonic() - self._last_kill < KILL_SPACING_S:
                return
            self._ready.clear()
            self.daemon.kill()
            self.kills += 1
            self.daemon.start()
            self._last_kill = time.monotonic()
            self._ready.set()

    def wait_back(self, client: Client) -> None:
        """Until crabd answers again (after a kill)."""
        deadline = time.monotonic() + DAEMON_BACK_TIMEOUT_S
        self._ready.wait(DAEMON_BACK_TIMEOUT_S)
        while True:
            try:
                client.status()
                return
            except CrabError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
