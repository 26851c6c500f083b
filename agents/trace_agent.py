"""The trace agent: replays a task's oracle turns, "thinking" through an LLM endpoint between them.

Each turn is: ask the LLM (the conversation so far, as a real agent would
send it), then act (the oracle turn's commands, in the sandbox's session).
The LLM's answer is not used to choose the action; the call is there for
its timing and its tokens.  Point it at the stand-in server
(``crab-llm-standin``) or at real vLLM: the code is the same.

Each request carries ``user=<task>`` and ``seed=<turn>``: the stand-in then
draws the same latency for the same turn of the same task in every run, so
strategies compared side by side see identical LLM time.

With crab's proxy (``proxy=True``) the agent sends its LLM requests to
``sandbox.llm_base_url()`` and never calls ``end_turn``: the request ends
the turn, and the answer comes back once its checkpoint is durable.

    python -m agents.trace_agent shell/kv-server --llm http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from agents.llm import ChatClient, Completion
from agents.tasks import OracleTurn, Task, find, verify
from agents.tasks import create as create_sandbox
from crabd.models import CheckpointPolicy
from crabd.sdk import Client, Sandbox

SYSTEM = (
    "You are an agent working in a Linux sandbox through a bash shell. "
    "Think briefly, then give the next shell commands to run."
)
#: Cap on what one observation adds to the conversation (real agents truncate tool output).
OBSERVATION_CHARS = 2000


@dataclass
class TurnStats:
    index: int
    llm_s: float
    action_s: float
    exposed_s: float  # time the agent spent in crab's turn calls (or held by the proxy)
    exit_code: int
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Conversation:
    """What the agent remembers: survives any fault (it lives in the agent, not the sandbox)."""

    messages: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def start(cls, task: Task) -> Conversation:
        return cls([{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.spec.instruction.strip()}])

    def observe(self, turn: OracleTurn, stdout: bytes, stderr: bytes, code: int) -> None:
        self.messages.append({"role": "assistant", "content": f"{turn.think}\n```bash\n{turn.run.strip()}\n```"})
        out = (stdout + stderr).decode("utf-8", "replace")[-OBSERVATION_CHARS:]
        self.messages.append({"role": "user", "content": f"exit code {code}\n{out}"})


class TraceAgent:
    def __init__(self, llm: ChatClient, *, max_tokens: int | None = None, proxy: bool = False) -> None:
        self.llm = llm
        self.max_tokens = max_tokens
        self.proxy = proxy

    def think(self, task: Task, index: int, convo: Conversation, sb: Sandbox | None = None) -> Completion:
        """The LLM call before turn ``index``."""
        llm = self.llm
        if self.proxy and sb is not None:
            llm = ChatClient(sb.llm_base_url(), model=self.llm.model, timeout_s=self.llm.timeout_s)
        return llm.chat(convo.messages, max_tokens=self.max_tokens, seed=index, user=task.name)

    def act(self, sb: Sandbox, task: Task, index: int, convo: Conversation) -> tuple[int, float, float]:
        """Turn ``index``'s action: (exit code, action seconds, seconds spent in crab's turn calls)."""
        turn = task.turns[index]
        exposed = 0.0
        if not self.proxy:
            t0 = time.monotonic()
            sb.begin_turn()
            exposed += time.monotonic() - t0
        t1 = time.monotonic()
        r = sb.session.run(turn.run, timeout=turn.timeout_s)
        action = time.monotonic() - t1
        convo.observe(turn, r.stdout, r.stderr, r.exit_code)
        if not self.proxy:
            t2 = time.monotonic()
            sb.end_turn(decision=False)  # decided and checkpointed while the LLM generates
            exposed += time.monotonic() - t2
        return r.exit_code, action, exposed

    def run(self, sb: Sandbox, task: Task, start: int = 0, convo: Conversation | None = None) -> list[TurnStats]:
        """Turns ``start``.. of the task, in order, without faults."""
        convo = convo or Conversation.start(task)
        stats = []
        for i in range(start, len(task.turns)):
            c = self.think(task, i, convo, sb)
            code, action, exposed = self.act(sb, task, i, convo)
            stats.append(
                TurnStats(i, c.seconds, action, exposed + c.held_s, code, c.prompt_tokens, c.completion_tokens)
            )
        return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.trace_agent", description="Replay one task's oracle.")
    ap.add_argument("task", help="suite/id, e.g. shell/kv-server")
    ap.add_argument("--llm", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--socket", default="", help="crabd's socket (default: the system daemon)")
    ap.add_argument("--proxy", action="store_true", help="send LLM requests through crab's proxy")
    ap.add_argument(
        "--checkpoints", type=CheckpointPolicy, default=CheckpointPolicy.AUTO, choices=list(CheckpointPolicy)
    )
    args = ap.parse_args(argv)
    task = find(args.task)
    with Client(args.socket or None) as client, create_sandbox(client, task, checkpoints=args.checkpoints) as sb:
        stats = TraceAgent(ChatClient(args.llm), proxy=args.proxy).run(sb, task)
        verdict = verify(sb, task)
    for s in stats:
        print(f"turn {s.index}: llm {s.llm_s:.2f} s, action {s.action_s:.2f} s, exposed {s.exposed_s * 1000:.1f} ms")
    print("solved" if verdict.passed else f"NOT solved: {verdict.output}")
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
