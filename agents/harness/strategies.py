"""The recovery strategies the harness compares, each behind one small class.

A strategy decides two things: how a sandbox is checkpointed while the agent
works (crab's policy, and whether a turn end waits for its checkpoint), and
what happens after a fault (:meth:`Strategy.recover`), which returns the
oracle turn the agent goes on from.

=================  ==========  ==============  ==================================================
strategy           policy      turn end        after a fault
=================  ==========  ==============  ==================================================
none               none        async           (fault-free only: the reference time)
restart            none        async           a fresh sandbox, from turn 0, conversation reset
chat-only          none        async           a fresh sandbox, the conversation so far
chat+fs            fs          async           the last files (fresh shell, no processes)
full-every-turn    full        waits           the last full checkpoint (CRIU + files)
crab               auto        async           crab: the last checkpoint the inspector chose
=================  ==========  ==============  ==================================================

``full-every-turn`` is the naive way to be correct: every turn end dumps
processes and files and the agent waits for it.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from agents.tasks import Task, create
from agents.trace_agent import Conversation
from crabd.errors import NotFound
from crabd.models import CheckpointKind, CheckpointPolicy
from crabd.sdk import Client, Sandbox
from crabd.sdk.models import Turn


@dataclass
class Episode:
    """One task's run under one strategy: the agent's side of it."""

    client: Client
    task: Task
    name: str
    sb: Sandbox | None = None
    convo: Conversation | None = None
    #: crab turn number -> oracle turn index, for every turn the agent began.
    turn_index: dict[int, int] = field(default_factory=dict)
    #: Every sandbox this episode created (for traffic accounting and clean-up).
    sandboxes: list[Sandbox] = field(default_factory=list)

    def fresh(self, policy: CheckpointPolicy) -> Sandbox:
        name = f"{self.name}-{len(self.sandboxes)}"
        # A create whose reply a crabd kill lost may have made it (the harness retries the start):
        # start over from nothing rather than fail on the name.
        with contextlib.suppress(NotFound):
            self.client.get(name).remove(force=True)
        sb = create(self.client, self.task, name=name, checkpoints=policy)
        self.sandboxes.append(sb)
        self.sb = sb
        if policy is not CheckpointPolicy.NONE:
            # The environment recipe ran after crab's creation checkpoint: keep it, so that a
            # recovery before the first turn does not lose the task's setup.
            sb.checkpoint("setup", kind=CheckpointKind.FS)
        return sb

    def resume_after(self, lost: list[int], next_index: int) -> int:
        """The oracle turn to go on from, given the crab turns a restore lost."""
        indexes = [self.turn_index[t] for t in lost if t in self.turn_index]
        return min([*indexes, next_index])


def lost_turns(turns: list[Turn], checkpoint_turn: int) -> list[int]:
    """Turns after ``checkpoint_turn`` a restore of its checkpoint loses (skipped turns right after it are kept)."""
    later = [t for t in turns if t.number > checkpoint_turn]
    for i, t in enumerate(later):
        if t.checkpoint_state != "skipped":
            return [x.number for x in later[i:]]
    return []


class Strategy(ABC):
    name: str
    policy: CheckpointPolicy
    wait: bool = False

    def start(self, ep: Episode) -> Sandbox:
        ep.convo = Conversation.start(ep.task)
        return ep.fresh(self.policy)

    @abstractmethod
    def recover(self, ep: Episode, next_index: int, *, alive: bool) -> int:
        """Bring ``ep`` back after a fault; return the oracle turn to go on from.

        ``next_index`` is the turn the agent was about to do (or was doing when
        the fault hit); ``alive``: the sandbox's container still runs (crabd
        died, the sandbox did not) but the last action's outcome is unknown.
        """

    def on_notice(self, ep: Episode) -> None:  # noqa: B027 (most strategies do nothing with a notice)
        """A preemption notice: prepare within the grace period (the harness bounds the time)."""


class NoCheckpoints(Strategy):
    name, policy = "none", CheckpointPolicy.NONE

    def recover(self, ep: Episode, next_index: int, *, alive: bool) -> int:
        raise RuntimeError("the 'none' strategy runs fault-free only")


def _discard(ep: Episode) -> None:
    if ep.sb is not None:
        ep.sb.remove(force=True)
        ep.sb = None


class Restart(Strategy):
    name, policy = "restart", CheckpointPolicy.NONE

    def recover(self, ep: Episode, next_index: int, *, alive: bool) -> int:
        _discard(ep)
        ep.convo = Conversation.start(ep.task)
        ep.fresh(self.policy)
        return 0


class ChatOnly(Strategy):
    name, policy = "chat-only", CheckpointPolicy.NONE

    def recover(self, ep: Episode, next_index: int, *, alive: bool) -> int:
        _discard(ep)
        ep.fresh(self.policy)
        return next_index


class FromCheckpoint(Strategy):
    """Back to the sandbox's latest checkpoint: recreated if its container died, else restored in place."""

    fresh_shell = False

    def on_notice(self, ep: Episode) -> None:
        # Listing checkpoints waits until the last turn end's checkpoint is durable (crab
        # promotes it: a reader is waiting): after this, nothing the agent did is lost.
        assert ep.sb is not None
        ep.sb.checkpoints()

    def recover(self, ep: Episode, next_index: int, *, alive: bool) -> int:
        sb = ep.sb
        assert sb is not None
        if alive:
            ckpts = sb.checkpoints()
            head = ckpts[-1]
            lost = lost_turns(sb.turns(), head.turn)
            sb.restore(head)
        else:
            done = sb.recover()
            lost = done.lost_turns
        if self.fresh_shell:
            sb.session.restart(None)  # files only: the shell's variables and cwd are gone too
        return ep.resume_after(lost, next_index)


class ChatPlusFs(FromCheckpoint):
    name, policy, fresh_shell = "chat+fs", CheckpointPolicy.FS, True


class FullEveryTurn(FromCheckpoint):
    name, policy, wait = "full-every-turn", CheckpointPolicy.FULL, True


class Crab(FromCheckpoint):
    name, policy = "crab", CheckpointPolicy.AUTO


STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (NoCheckpoints, Restart, ChatOnly, ChatPlusFs, FullEveryTurn, Crab)
}
