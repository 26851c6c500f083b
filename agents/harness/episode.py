"""One task under one strategy, with at most one fault: the agent loop, recovery, and what it cost."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from agents.harness.faults import PREEMPT_GRACE_S, FaultPlan, Supervisor, kill_container
from agents.harness.strategies import Episode, Strategy
from agents.harness.traffic import agent_checkpoints, undeduplicated_bytes
from agents.tasks import Task, verify
from agents.trace_agent import TraceAgent
from crabd.errors import CrabError, DaemonUnavailable, NotFound, SandboxDead

log = logging.getLogger("agents.harness")
T = TypeVar("T")
#: Faults (crabd kills by other tasks included) after which one task gives up.
MAX_RECOVERIES = 6


@dataclass
class Result:
    task: str
    strategy: str
    fault: str
    fault_turn: int
    solved: bool
    seconds: float
    turns_run: int  # actions executed, redone ones included
    llm_calls: int
    recoveries: int
    recovery_s: float
    bytes_written: int
    checkpoints: int
    #: The size of the checkpoints the agent's turn ends took, without de-duplication or
    #: compression (see traffic.py): for full-every-turn, what a FullCkpt store writes.
    undeduplicated_bytes: int = 0
    exposed_s: list[float] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)
    verifier: str = ""
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Runner:
    """Runs episodes against one crabd (``supervisor``); thread-safe, one call per episode."""

    def __init__(self, supervisor: Supervisor, agent: TraceAgent) -> None:
        self.sup = supervisor
        self.agent = agent

    def _retrying(self, client: Any, fn: Callable[[], T]) -> T:
        """``fn()``, again after crabd comes back if it died meanwhile (only for calls safe to repeat)."""
        for _ in range(MAX_RECOVERIES):
            try:
                return fn()
            except DaemonUnavailable:
                self.sup.wait_back(client)
        return fn()

    def run(self, task: Task, strategy: Strategy, plan: FaultPlan | None, name: str) -> Result:
        from crabd.sdk import Client

        t0 = time.monotonic()
        res = Result(task.name, strategy.name, plan.kind if plan else "", plan.before_turn if plan else -1,
                     False, 0.0, 0, 0, 0, 0.0, 0, 0)  # fmt: skip
        with Client(self.sup.socket) as client:
            ep = Episode(client, task, name)
            try:
                self._loop(ep, strategy, plan, res)
                res.seconds = time.monotonic() - t0
                assert ep.sb is not None
                sb = ep.sb
                verdict = self._retrying(client, lambda: verify(sb, task))
                res.solved, res.verifier = verdict.passed, verdict.output[-300:]
            except (CrabError, OSError, RuntimeError) as exc:
                res.seconds = time.monotonic() - t0
                res.error = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("episode failed", extra={"task": task.name, "strategy": strategy.name, "error": res.error})
            finally:
                self._account(ep, res, strategy.policy)
                for sb in ep.sandboxes:
                    with contextlib.suppress(CrabError):
                        sb.remove(force=True)
        return res

    def _loop(self, ep: Episode, strategy: Strategy, plan: FaultPlan | None, res: Result) -> None:
        self._retrying(ep.client, lambda: strategy.start(ep))
        n = len(ep.task.turns)
        i = 0
        pending = plan
        with ThreadPoolExecutor(1) as llm_pool:
            while i < n:
                assert ep.convo is not None and ep.sb is not None
                think = llm_pool.submit(self.agent.think, ep.task, i, ep.convo, ep.sb if self.agent.proxy else None)
                if pending is not None and i == pending.before_turn:
                    self._inject(ep, strategy, pending)
                    pending = None
                completion = think.result()
                res.llm_calls += 1
                try:
                    exposed = 0.0
                    if not self.agent.proxy:
                        t0 = time.monotonic()
                        ep.turn_index[ep.sb.begin_turn().number] = i  # waits for the last checkpoint, if needed
                        exposed = time.monotonic() - t0
                    code, _, ended = self._act(ep, strategy, i)
                    res.turns_run += 1
                    res.exposed_s.append(exposed + ended + completion.held_s)
                    if code != 0:
                        log.info("oracle turn exited non-zero", extra={"task": ep.task.name, "turn": i, "code": code})
                    i += 1
                except (SandboxDead, DaemonUnavailable) as exc:
                    res.recoveries += 1
                    if res.recoveries > MAX_RECOVERIES:
                        raise RuntimeError(f"gave up after {MAX_RECOVERIES} recoveries") from exc
                    r0 = time.monotonic()
                    i = self._retrying(ep.client, functools.partial(self._recover, ep, strategy, i, exc))
                    res.recovery_s += time.monotonic() - r0

    def _act(self, ep: Episode, strategy: Strategy, i: int) -> tuple[int, float, float]:
        assert ep.sb is not None and ep.convo is not None
        turn = ep.task.turns[i]
        t1 = time.monotonic()
        r = ep.sb.session.run(turn.run, timeout=turn.timeout_s)
        action = time.monotonic() - t1
        ep.convo.observe(turn, r.stdout, r.stderr, r.exit_code)
        exposed = 0.0
        if not self.agent.proxy:
            t2 = time.monotonic()
            ep.sb.end_turn(wait=strategy.wait, decision=False)
            exposed = time.monotonic() - t2
        return r.exit_code, action, exposed

    def _recover(self, ep: Episode, strategy: Strategy, i: int, exc: CrabError) -> int:
        assert ep.sb is not None
        if isinstance(exc, DaemonUnavailable):
            self.sup.wait_back(ep.client)
        try:
            alive = ep.sb.refresh().state == "running"
        except DaemonUnavailable:
            self.sup.wait_back(ep.client)
            alive = ep.sb.refresh().state == "running"
        log.info("recovering", extra={"task": ep.task.name, "strategy": strategy.name, "turn": i, "alive": alive})
        return strategy.recover(ep, i, alive=alive)

    def _inject(self, ep: Episode, strategy: Strategy, plan: FaultPlan) -> None:
        assert ep.sb is not None
        time.sleep(plan.delay_s)
        if plan.kind == "sandbox-kill":
            kill_container(ep.sb)
        elif plan.kind == "crabd-kill":
            self.sup.kill()
        elif plan.kind == "preempt":
            # The notice: the strategy gets the grace period to prepare, then the host goes away.
            with ThreadPoolExecutor(1) as pool:
                fut = pool.submit(strategy.on_notice, ep)
                try:
                    fut.result(timeout=PREEMPT_GRACE_S)
                except Exception as exc:  # a timeout or a failure: the host goes away regardless
                    log.warning("preemption preparation did not finish", extra={"error": repr(exc)})
            kill_container(ep.sb)
        else:
            raise ValueError(f"unknown fault {plan.kind!r}")

    def _account(self, ep: Episode, res: Result, policy: str) -> None:
        self._retrying(ep.client, lambda: self._count(ep, res, policy))

    def _count(self, ep: Episode, res: Result, policy: str) -> None:
        decisions: Counter[str] = Counter()
        res.bytes_written = res.undeduplicated_bytes = res.checkpoints = 0
        for sb in ep.sandboxes:
            try:
                turns = sb.turns()
                by_agent = agent_checkpoints(turns)
                for c in ep.client.checkpoints(sb.id):
                    res.bytes_written += c.new_bytes
                    res.checkpoints += 1
                    if c.id in by_agent:
                        res.undeduplicated_bytes += undeduplicated_bytes(c)
                for t in turns:
                    if t.implicit:
                        continue  # the task's setup and the verifier, not the agent's turns
                    if t.decision is not None:
                        decisions[t.decision.kind] += 1
                    elif t.checkpoint_state in ("done", "pending", "failed", "lost"):
                        decisions[policy] += 1  # a fixed policy: every turn takes its kind
            except DaemonUnavailable:
                raise
            except NotFound:
                continue  # removed by a recovery that started over (its policy took no checkpoints)
            except CrabError as exc:
                log.warning("could not account for a sandbox", extra={"sandbox": sb.id, "error": str(exc)})
        res.decisions = dict(decisions)
