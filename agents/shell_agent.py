"""A real tool-calling shell agent: an OpenAI-compatible model drives a crab sandbox through a `bash` tool.

Works against any server that supports OpenAI tool calls (vLLM with
``--enable-auto-tool-choice --tool-call-parser ...``, crab's stand-in with a
script).  Each model answer is one agent action: its tool calls run in the
sandbox's persistent bash session, and the outputs go back as ``tool``
messages, until the model answers without calling a tool.

Two ways to tell crab where turns end:

* SDK (default): ``begin_turn`` before the action, ``end_turn`` after it;
  the checkpoint runs while the model thinks about the next step;
* proxy (``proxy=True``): the model is reached through crab's proxy at
  ``sandbox.llm_base_url()``; each request ends the turn and its answer is
  held until the checkpoint is durable: no crab calls in the agent at all.

    python -m agents.shell_agent shell/kv-server --llm http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any

from agents.llm import ChatClient, Completion, ToolCall
from agents.tasks import create, find, verify
from crabd.sdk import Client, Sandbox

SYSTEM = (
    "You are an autonomous agent in a Linux sandbox (Debian, no network). Use the `bash` tool to run "
    "commands; the shell is persistent (cwd, variables and background jobs carry over). Work step by step, "
    "check your results, and when the task is done answer with a short summary and no tool call."
)
BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run commands in the sandbox's persistent bash shell; returns the exit code and output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "bash commands to run"}},
            "required": ["command"],
        },
    },
}
#: Cap on one tool result sent back to the model.
OUTPUT_CHARS = 4000


@dataclass
class AgentRun:
    messages: list[dict[str, Any]]
    completions: list[Completion] = field(default_factory=list)
    actions: int = 0
    finished: bool = False

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.completions)


class ShellAgent:
    def __init__(
        self,
        llm: ChatClient,
        *,
        max_steps: int = 40,
        command_timeout_s: float = 300.0,
        temperature: float | None = None,
        max_tokens: int | None = None,
        proxy: bool = False,
    ) -> None:
        self.llm = llm
        self.max_steps = max_steps
        self.command_timeout_s = command_timeout_s
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.proxy = proxy

    def solve(self, sb: Sandbox, instruction: str) -> AgentRun:
        run = AgentRun([{"role": "system", "content": SYSTEM}, {"role": "user", "content": instruction.strip()}])
        llm = self.llm
        if self.proxy:
            llm = ChatClient(sb.llm_base_url(), model=self.llm.model, timeout_s=self.llm.timeout_s)
        for _ in range(self.max_steps):
            c = llm.chat(run.messages, tools=[BASH_TOOL], temperature=self.temperature, max_tokens=self.max_tokens)
            run.completions.append(c)
            run.messages.append(c.message())
            if not c.tool_calls:
                run.finished = True
                break
            self._act(sb, c.tool_calls, run)
        return run

    def _act(self, sb: Sandbox, calls: tuple[ToolCall, ...], run: AgentRun) -> None:
        if not self.proxy:
            sb.begin_turn()
        try:
            for call in calls:
                run.messages.append({"role": "tool", "tool_call_id": call.id, "content": self._call(sb, call)})
            run.actions += 1
        finally:
            if not self.proxy:
                sb.end_turn(decision=False)  # decided and checkpointed while the LLM generates

    def _call(self, sb: Sandbox, call: ToolCall) -> str:
        command = bash_command(call)
        if command is None:
            return bad_call(call)
        r = sb.session.run(command, timeout=self.command_timeout_s)
        return render_result(r.exit_code, r.timed_out, r.stdout + r.stderr)


def bash_command(call: ToolCall) -> str | None:
    """The command a tool call asks ``bash`` to run; None if it is not a well-formed bash call."""
    command = call.args().get("command")
    return command if call.name == "bash" and isinstance(command, str) else None


def bad_call(call: ToolCall) -> str:
    """The tool result that tells the model its call was not a well-formed bash call."""
    return f"error: unknown tool {call.name!r} or missing 'command'; the only tool is bash(command)"


def render_result(exit_code: int, timed_out: bool, output: bytes) -> str:
    """One command's result as the model sees it: the exit code, then the output's tail."""
    text = output.decode("utf-8", "replace")
    if len(text) > OUTPUT_CHARS:
        text = f"[... {len(text) - OUTPUT_CHARS} characters cut ...]\n" + text[-OUTPUT_CHARS:]
    return f"exit code {exit_code}{' (timed out)' if timed_out else ''}\n{text}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.shell_agent", description="Solve one task with a model.")
    ap.add_argument("task", help="suite/id, e.g. shell/kv-server")
    ap.add_argument("--llm", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="")
    ap.add_argument("--socket", default="", help="crabd's socket (default: the system daemon)")
    ap.add_argument("--proxy", action="store_true", help="reach the model through crab's proxy")
    ap.add_argument("--max-steps", type=int, default=40)
    args = ap.parse_args(argv)
    task = find(args.task)
    agent = ShellAgent(ChatClient(args.llm, model=args.model), max_steps=args.max_steps, proxy=args.proxy)
    with Client(args.socket or None) as client, create(client, task) as sb:
        run = agent.solve(sb, task.spec.instruction)
        verdict = verify(sb, task)
    print(f"{run.actions} actions, {run.completion_tokens} generated tokens, finished={run.finished}")
    print("solved" if verdict.passed else f"NOT solved: {verdict.output}")
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
