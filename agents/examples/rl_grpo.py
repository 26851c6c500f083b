"""A GRPO-style training step on CPU: group rollouts from a mid-trajectory fork, tensors, one policy update.

The rollouts are real (crab sandboxes, the task's verifier as reward); the
"model" being trained is a toy bag-of-tokens softmax, standing in for the
trainer's LLM, so the whole loop runs in seconds without a GPU.  The
policy generating the rollouts is the sampled oracle over an OpenAI
endpoint (crab's stand-in by default, or ``--llm`` for a vLLM server; with
``--chat`` the model itself acts through tool calls).

    python -m agents.examples.rl_grpo --task shell/kv-server --k 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

from agents.llm import AsyncChatClient
from agents.rl import ChatPolicy, OraclePolicy, Policy, Rollouts, group_advantages, to_tensors
from agents.tasks import Task, find
from crabd.llm import StandinServer
from crabd.sdk import AsyncClient


@contextlib.asynccontextmanager
async def llm_endpoint(url: str) -> AsyncIterator[str]:
    """``url``, or a stand-in server for as long as the block runs."""
    if url:
        yield url
        return
    with StandinServer(time_scale=0.05) as srv:
        yield f"{srv.url}/v1"


@contextlib.asynccontextmanager
async def crab_client(socket: str) -> AsyncIterator[AsyncClient]:
    """A client of the crabd at ``socket``, or of an embedded one."""
    client = AsyncClient(socket) if socket else await AsyncClient.embedded()
    async with client:
        yield client


def policy_update(batch: dict[str, Any], vocab: int = 50_200, lr: float = 0.5) -> dict[str, float]:
    """One REINFORCE step with group-relative advantages on a toy token model; returns its loss and change."""
    import torch

    torch.manual_seed(0)
    logits = torch.zeros(vocab, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=lr)
    adv = group_advantages(batch["reward"], batch["group"])
    # A shared prefix gets no gradient here: its tokens' advantages sum to zero over the group anyway.
    mask = batch["mask"] & ~batch["shared"]
    logp = torch.log_softmax(logits, dim=0)[batch["token_ids"]]
    loss = -(adv[:, None] * logp * mask).sum() / mask.sum().clamp(min=1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {"loss": float(loss.detach()), "update_norm": float(logits.detach().norm())}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    task: Task = find(args.task)
    async with (
        llm_endpoint(args.llm) as url,
        AsyncChatClient(url, model=args.model) as llm,
        crab_client(args.socket) as client,
    ):
        policy: Policy = ChatPolicy(llm) if args.chat else OraclePolicy(llm, {task.name: task}, explore=0.3, slip=0.25)
        rollouts = Rollouts(client, policy, max_steps=args.max_steps)
        prefix = args.prefix if args.prefix >= 0 else len(task.turns) // 2
        leaves = await rollouts.group(task, prefix_steps=prefix, k=args.k, seed=args.seed)
    batch = to_tensors(leaves)
    update = policy_update(batch)
    return {
        "task": task.name,
        "prefix_steps": prefix,
        "trajectories": [
            {"id": t.id, "reward": t.reward, "steps": len(t.steps), "branch_step": t.branch_step} for t in leaves
        ],
        "shapes": {k: list(v.shape) for k, v in batch.items()},
        "advantages": [round(float(a), 3) for a in group_advantages(batch["reward"], batch["group"])],
        "ledger": rollouts.ledger.to_json(),
        **update,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.examples.rl_grpo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="shell/kv-server")
    ap.add_argument("--k", type=int, default=4, help="continuations per prefix")
    ap.add_argument("--prefix", type=int, default=-1, help="steps before the fork (default: half the oracle)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--llm", default="", help="OpenAI-compatible base URL (default: a stand-in)")
    ap.add_argument("--model", default="")
    ap.add_argument("--chat", action="store_true", help="the model acts through tool calls (needs a real model)")
    ap.add_argument("--socket", default="", help="crabd's socket (default: an embedded crabd)")
    result = asyncio.run(run(ap.parse_args(argv)))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
