"""The gymnasium adapter: a synchronous trainer's view of a crab task, with a snapshot and a rollback.

python -m agents.examples.rl_gym --task shell/kv-server --socket /run/crab/crabd.sock
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agents.rl.gym_env import CrabGymEnv
from agents.tasks import find
from crabd.sdk import EmbeddedDaemon


def episode(task_name: str, socket: str) -> dict[str, Any]:
    task = find(task_name)
    env = CrabGymEnv(task, socket=socket)
    try:
        _obs, _info = env.reset()
        for turn in task.turns[:-1]:
            _obs, _reward, _terminated, _truncated, _info = env.step(turn.run)
        snap = env.snapshot()  # one step before the end
        _, early, _, _, _ = env.step("")  # "done" too early: the verifier says no
        env.restore(snap)
        env.step(task.turns[-1].run)
        _, reward, terminated, _, _ = env.step("")
        return {"task": task.name, "early_reward": early, "reward": reward, "terminated": terminated}
    finally:
        env.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.examples.rl_gym", description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="shell/kv-server")
    ap.add_argument("--socket", default="", help="crabd's socket (default: an embedded crabd)")
    args = ap.parse_args(argv)
    if args.socket:
        result = episode(args.task, args.socket)
    else:
        with EmbeddedDaemon() as daemon:
            result = episode(args.task, str(daemon.socket))
    print(json.dumps(result))
    return 0 if result["reward"] == 1.0 and result["early_reward"] == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
