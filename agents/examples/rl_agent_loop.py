"""The agent-loop adapter: what a trainer's async agent loop receives, turn by turn.

python -m agents.examples.rl_agent_loop --task repair/<id> --llm http://127.0.0.1:8000/v1 --chat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from agents.examples.rl_grpo import crab_client, llm_endpoint
from agents.llm import AsyncChatClient
from agents.rl import ChatPolicy, OraclePolicy, Policy, Rollouts
from agents.rl.agent_loop import agent_loop
from agents.tasks import find


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    task = find(args.task)
    async with llm_endpoint(args.llm) as url, AsyncChatClient(url) as llm, crab_client(args.socket) as client:
        policy: Policy = ChatPolicy(llm) if args.chat else OraclePolicy(llm, {task.name: task})
        rollouts = Rollouts(client, policy)
        # Two samples at once, as a trainer's worker would run them.
        loops = [agent_loop(rollouts, task, seed=s) for s in (1, 2)]

        async def drain(loop: Any) -> list[dict[str, Any]]:
            return [
                {"id": o.trajectory_id, "step": o.step, "tokens": len(o.token_ids), "reward": o.reward, "done": o.done}
                async for o in loop
            ]

        per_loop = await asyncio.gather(*(drain(lp) for lp in loops))
    return [turn for turns in per_loop for turn in turns]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.examples.rl_agent_loop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="shell/kv-server")
    ap.add_argument("--llm", default="", help="OpenAI-compatible base URL (default: a stand-in)")
    ap.add_argument("--chat", action="store_true", help="the model acts through tool calls (needs a real model)")
    ap.add_argument("--socket", default="", help="crabd's socket (default: an embedded crabd)")
    turns = asyncio.run(run(ap.parse_args(argv)))
    for t in turns:
        print(json.dumps(t))
    return 0 if turns and all(t["reward"] == 1.0 for t in turns if t["done"]) else 1


if __name__ == "__main__":
    sys.exit(main())
