"""Turn coordination: decide at a turn end, checkpoint while the LLM generates, hold the next action.

The rhythm of an agent is: act in the sandbox, end the turn, wait for the
LLM, act again.  At a turn end (:meth:`TurnFlow.end_turn`, from the SDK's
``end_turn`` or from an LLM request through crab's proxy) this module

1. captures the session's state and asks the inspector what the turn
   changed (``inspection.plan``) — at the turn end, so the decision is
   about exactly that turn;
2. queues the checkpoint the decision calls for in the host engine
   (``crabd/engine``) and returns at once — or, when the caller does not want
   the decision back (``decide=False``: the SDK's ``with sb.turn():``), returns
   right after the turn is closed and decides in the background too, so the
   decision's own time (``/proc``, the upper dir, a registry write) is spent
   in the LLM's wait as well;
3. makes the sandbox's *next action* (:meth:`before_action`: the next
   command, ``begin_turn``, restore, fork, ...) or, in proxy mode, the
   release of the LLM's response wait until that checkpoint is durable.
   Waiting promotes the job to urgent; the time waited is the delay crab
   exposes to the agent, zero when the checkpoint fit in the LLM's time.

The checkpoint is taken when the engine runs it, not at the turn end.  In
between the agent does nothing in the sandbox (its next action waits), so
the state is the turn end's — except for what background processes do on
their own meanwhile, which the checkpoint then includes (and a paired
filesystem checkpoint re-checks; see ``inspection.py``).

Each sandbox's job deadline is its turn end plus its observed LLM latency
(the median of its recent waits): the engine serves first the agents that
come back first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from crabd.config import EngineConfig
from crabd.coordinator.commands import Commands
from crabd.coordinator.inspection import Plan, TurnInspection
from crabd.engine import HostEngine, Job, JobControl, Outcome
from crabd.errors import CheckpointFailed, CrabError, InvalidRequest
from crabd.inspector.model import SKIP
from crabd.models import CheckpointPolicy, SandboxRecord, TurnCheckpointState, TurnEnd, TurnRecord

log = logging.getLogger("crabd.turns")

T = TypeVar("T")


class LatencyTracker:
    """Each sandbox's recent LLM waits; the median predicts the next one."""

    def __init__(self, window: int, default_s: float) -> None:
        self.window = window
        self.default_s = default_s
        self._seen: dict[str, deque[float]] = {}

    def observe(self, sandbox_id: str, seconds: float) -> None:
        self._seen.setdefault(sandbox_id, deque(maxlen=self.window)).append(seconds)

    def estimate(self, sandbox_id: str) -> float:
        seen = self._seen.get(sandbox_id)
        return statistics.median(seen) if seen else self.default_s

    def forget(self, sandbox_id: str) -> None:
        self._seen.pop(sandbox_id, None)


class TurnFlow:
    def __init__(self, cfg: EngineConfig, engine: HostEngine, commands: Commands, inspection: TurnInspection) -> None:
        self.engine = engine
        self.commands = commands
        self.inspection = inspection
        self.sandboxes = commands.sandboxes
        self.latency = LatencyTracker(cfg.latency_window, cfg.default_llm_latency_s)
        # Monotonic time of each sandbox's last turn end, until its next action
        # (or its LLM response) turns the gap into a latency sample.
        self._ended_at: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: Turn ends being decided in the background (end_turn(decide=False)); the next action waits.
        self._deciding: dict[str, asyncio.Task[None]] = {}
        #: Commands of each sandbox running as turns of their own now (``command_turn``; several
        #: sessions run at the same time).
        self._in_flight: dict[str, int] = {}
        self._finish_locks: dict[str, asyncio.Lock] = {}

    def _finishing(self, sandbox_id: str) -> asyncio.Lock:
        return _lock_in(self._finish_locks, sandbox_id)

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return _lock_in(self._locks, sandbox_id)

    # --- the next action ------------------------------------------------------------

    def observe_llm(self, sandbox_id: str, seconds: float) -> None:
        """The proxy saw the sandbox's LLM answer after ``seconds`` (a direct latency sample)."""
        self._ended_at.pop(sandbox_id, None)
        self.latency.observe(sandbox_id, seconds)

    async def settle(self, sandbox_id: str, *, agent: bool = True) -> Job | None:
        """Until the sandbox's queued checkpoint is durable or failed; returns that job (None: there was none).

        ``agent``: the sandbox's agent is the one waiting (its wait is exposed
        delay); False for reads and housekeeping, which still get
        read-your-writes: a listing right after a turn end shows its checkpoint.
        """
        if sandbox_id in self._deciding:
            t0 = time.monotonic()
            await self.decided(sandbox_id)  # never raises: a failure is recorded with the turn
            if agent:
                self.engine.metrics.exposed.observe(time.monotonic() - t0)
        job = self.engine.unfinished(sandbox_id)
        if job is None:
            return None
        return await self.engine.wait(job, agent=agent)

    async def decided(self, sandbox_id: str) -> None:
        """Until a turn end being decided in the background is decided (and queued)."""
        deciding = self._deciding.get(sandbox_id)
        if deciding is not None:
            await asyncio.shield(deciding)

    async def before_action(self, rec: SandboxRecord) -> None:
        """The sandbox is about to act: its last turn end's checkpoint must be durable first."""
        ended = self._ended_at.pop(rec.id, None)
        if ended is not None:
            # Without the proxy, the time from turn end to the next action is the LLM's time (and the agent's).
            self.latency.observe(rec.id, time.monotonic() - ended)
        await self.settle(rec.id)
        await self.inspection.baseline_complete(rec.id)  # a start's digests, a dump's settling: done first

    # --- turn ends --------------------------------------------------------------------

    async def begin_turn(self, rec: SandboxRecord) -> tuple[TurnRecord | None, TurnRecord]:
        """Open a turn; an implicit turn still open (commands outside begin/end) is ended first."""
        await self.before_action(rec)
        await self.sandboxes.running(rec)
        closed = None
        while True:
            # Checked and begun with no await between: commands of other sessions may open
            # (implicit) and end turns while this one waits for the end of the last.
            current = self.sandboxes.turns.current(rec.id)
            if current is None:
                return closed, self.sandboxes.turns.begin(rec.id)
            if not current.implicit:
                raise InvalidRequest(
                    f"turn {current.number} of sandbox {rec.name} is already open",
                    hint=f"End it first: end_turn() in the SDK, `crabctl turn end {rec.name}` in a shell.",
                )
            closed = await self.end_turn(rec, if_open=True) or closed

    async def end_turn(
        self, rec: SandboxRecord, *, wait: bool = False, if_open: bool = False, decide: bool = True
    ) -> TurnRecord | None:
        """End the open turn: decide now, queue its checkpoint, return.

        ``wait``: return only once the checkpoint is durable (raises
        :class:`CheckpointFailed` if it failed).  ``if_open``: no open turn is
        not an error (the proxy: an LLM request with no action since the last
        one); returns None then.  ``decide=False`` (policy "auto", without
        ``wait``): return once the turn is closed, with no decision yet; the
        inspector decides in the background and the next action waits for
        that too (the decision is then in ``turns()``).
        """
        async with self._lock(rec.id):
            # Turn ends of one sandbox chain: the previous checkpoint is the next one's parent.
            await self.settle(rec.id)
            if if_open and self.sandboxes.turns.current(rec.id) is None:
                return None
            turn = await self.commands.end_turn(rec)
            if not decide and not wait and rec.spec.checkpoints is CheckpointPolicy.AUTO:
                return await self._decide_later(rec, turn)
            plan = await self.inspection.plan(rec, turn.number, turn.session_state_json)
            job = await self._enqueue(rec, turn, plan)
            self._ended_at[rec.id] = time.monotonic()
        if wait and job is not None:
            await self.engine.wait(job)
        return self._view(turn, plan, job, raise_failed=wait)

    async def command_turn(
        self, rec: SandboxRecord, end: TurnEnd, run: Callable[[], Awaitable[T]]
    ) -> tuple[T, TurnRecord]:
        """One command as a turn of its own: what ``begin_turn``, the command and ``end_turn`` do, in one call.

        An agent's step is usually exactly that, and each call costs crabd an
        RPC's machinery, about a third of a skip turn's CPU (issue 34).

        1. open the turn (the last turn end's checkpoint durable first, as
           before any action), or join the one open if another such command
           runs now (in another session: a turn is the sandbox's);
        2. run the command; if it raises (a dead container, a call its
           client cancelled), the turn is ended all the same, its decision
           not waited for, and the command's error is what the caller gets;
        3. end the sandbox's open turn as ``end`` says, whatever commands
           still run in other sessions (the turn end decides and checkpoints
           them as running processes); if another command's end closed it
           already, a turn of its own is begun and ended, so what this
           command changed since is covered by a turn end too.  Return the
           command's result and the ended turn (``durable``: a failed
           checkpoint raises, as ``end_turn(wait=True)`` does).
        """
        joined = self._in_flight.get(rec.id, 0) > 0
        self._in_flight[rec.id] = self._in_flight.get(rec.id, 0) + 1
        try:
            if not joined:
                await self.begin_turn(rec)
            try:
                result = await run()
            except BaseException:
                # Shielded: grpc.aio cancels the handler when its client goes away, and a turn left
                # open would make the sandbox's next turn fail as "already open".
                with contextlib.suppress(CrabError):
                    await asyncio.shield(self.end_turn(rec, decide=False, if_open=True))
                raise
            wait, decide = end is TurnEnd.DURABLE, end is not TurnEnd.DEFERRED
            # One finishing command at a time: another one's end between this one's begin and end
            # would leave it no turn to end.
            async with self._finishing(rec.id):
                turn = await self.end_turn(rec, wait=wait, decide=decide, if_open=True)
                if turn is None:
                    await self.begin_turn(rec)
                    turn = await self.end_turn(rec, wait=wait, decide=decide)
            assert turn is not None  # if_open=False: no open turn raised
            return result, turn
        finally:
            left = self._in_flight[rec.id] - 1
            if left:
                self._in_flight[rec.id] = left
            else:
                del self._in_flight[rec.id]

    async def _decide_later(self, rec: SandboxRecord, turn: TurnRecord) -> TurnRecord:
        """Mark the turn's checkpoint pending, then decide and queue it in a task of its own.

        Pending first, in the registry, so that a crabd killed before the
        decision reports the turn lost at its restart, never "no checkpoint
        needed".  A failure to decide (the container died meanwhile, ...) is
        recorded with the turn, as a failed checkpoint would be.
        """
        registry = self.sandboxes.registry
        registry.set_turn_checkpoint(rec.id, turn.number, TurnCheckpointState.PENDING)
        self._ended_at[rec.id] = time.monotonic()

        async def decide() -> None:
            try:
                plan = await self.inspection.plan(rec, turn.number, turn.session_state_json)
                await self._enqueue(rec, turn, plan)
            except Exception as exc:
                message = exc.message if isinstance(exc, CrabError) else f"internal error: {exc!r}"
                if not isinstance(exc, CrabError):
                    log.exception("turn end could not be decided", extra={"sandbox": rec.id, "turn": turn.number})
                error = f"the turn end could not be decided: {message}"
                failed = TurnCheckpointState.FAILED
                registry.set_turn_checkpoint(rec.id, turn.number, failed, None, error)
                log.warning("turn end not decided", extra={"sandbox": rec.id, "turn": turn.number, "error": message})
            finally:
                if self._deciding.get(rec.id) is task:
                    del self._deciding[rec.id]

        task = asyncio.create_task(decide(), name=f"crab-decide-{rec.id}-{turn.number}")
        self._deciding[rec.id] = task
        return replace(turn, checkpoint_state=TurnCheckpointState.PENDING)

    async def _enqueue(self, rec: SandboxRecord, turn: TurnRecord, plan: Plan | None) -> Job | None:
        # The turn's checkpoint state is group-committed (store/db.py: no fsync before COMMIT returns),
        # so it is written on the event loop like the lookups: a thread hop cost more than the write.
        registry = self.sandboxes.registry
        if plan is None or plan.kind == SKIP:
            # A skipped turn ended in the state of the head it was compared with: noted, so that
            # its number names that state even after a restore moves the head (coordinator/turnmap.py).
            registry.set_turn_checkpoint(
                rec.id,
                turn.number,
                TurnCheckpointState.NONE if plan is None else TurnCheckpointState.SKIPPED,
                basis_id=plan.basis if plan is not None else None,
            )
            return None
        registry.set_turn_checkpoint(rec.id, turn.number, TurnCheckpointState.PENDING)
        number, session_json = turn.number, turn.session_state_json

        async def work(ctl: JobControl) -> Outcome:
            try:
                ckpt = await self.inspection.execute(
                    rec, plan, turn=number, session_json=session_json, on_phase=ctl.phase
                )
            except CrabError as exc:
                failed = TurnCheckpointState.FAILED
                registry.set_turn_checkpoint(rec.id, number, failed, None, exc.message)
                log.warning("turn checkpoint failed", extra={"sandbox": rec.id, "turn": number, "error": exc.message})
                raise
            ckpt_id = ckpt.id if ckpt else None
            registry.set_turn_checkpoint(rec.id, number, TurnCheckpointState.DONE, ckpt_id)
            return Outcome(ckpt_id, int(ckpt.stats.get("new_bytes", 0)) if ckpt else 0)

        deadline = time.monotonic() + self.latency.estimate(rec.id)
        return await self.engine.submit(
            rec.id, work, owner_uid=rec.owner_uid, kind=plan.kind, turn=number, deadline=deadline
        )

    def _view(self, turn: TurnRecord, plan: Plan | None, job: Job | None, *, raise_failed: bool) -> TurnRecord:
        """The turn as the caller sees it right after its end."""
        decision_json = plan.decision.to_json() if plan and plan.decision else None
        if job is None:
            state = TurnCheckpointState.NONE if plan is None else TurnCheckpointState.SKIPPED
            basis = plan.basis if plan is not None else None
            return replace(turn, decision_json=decision_json, checkpoint_state=state, basis_id=basis)
        if job.error is not None:
            if raise_failed:
                raise CheckpointFailed(
                    f"the checkpoint of turn {turn.number} failed: {job.error.message}",
                    sandbox=turn.sandbox_id,
                    turn=turn.number,
                    cause=type(job.error).__name__,
                ) from job.error
            return replace(
                turn,
                decision_json=decision_json,
                checkpoint_state=TurnCheckpointState.FAILED,
                checkpoint_error=job.error.message,
            )
        if job.outcome is not None:
            # Re-read: execute() may have changed the decision (a stale pairing is taken full).
            for t in self.sandboxes.registry.list_turns(turn.sandbox_id, limit=1):
                if t.number == turn.number:
                    return t
            return replace(
                turn,
                decision_json=decision_json,
                checkpoint_id=job.outcome.checkpoint_id,
                checkpoint_state=TurnCheckpointState.DONE,
            )
        return replace(turn, decision_json=decision_json, checkpoint_state=TurnCheckpointState.PENDING)

    def forget(self, sandbox_id: str) -> None:
        self._ended_at.pop(sandbox_id, None)
        self._locks.pop(sandbox_id, None)
        self._finish_locks.pop(sandbox_id, None)
        self.latency.forget(sandbox_id)
        self.engine.forget(sandbox_id)


def _lock_in(locks: dict[str, asyncio.Lock], sandbox_id: str) -> asyncio.Lock:
    """The sandbox's lock in ``locks``, made on first use."""
    lock = locks.get(sandbox_id)
    if lock is None:
        lock = locks[sandbox_id] = asyncio.Lock()
    return lock
