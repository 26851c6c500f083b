"""mini-swe-agent in a crab sandbox, offline: its own agent loop with its scripted model (docs/minisweagent.md).

::

    pip install 'crabd[minisweagent]'
    python -m crabd.integrations.minisweagent_demo [--socket PATH] [-o run.traj.json]

No network model and no set-up wizard: the model is mini-swe-agent's
``DeterministicModel`` (the one its own tests use), answering with a fixed
script: write a buggy ``calc.py``, show the bug, fix it, submit.  The agent is
mini-swe-agent's ``DefaultAgent`` with its ``default.yaml``; the environment is
:class:`~crabd.integrations.minisweagent.CrabEnvironment`, so each command is
one crab turn in the sandbox's persistent session.  It prints each step's turn
and checkpoint, rolls back to the buggy state to show that it can, and
removes its sandbox.  Exit status 0 when every step succeeded, the run
submitted and the rollback brought the bug back.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

# mini-swe-agent asks set-up questions on first use and prints a banner at import: neither fits a demo.
os.environ.setdefault("MSWEA_CONFIGURED", "true")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.models.test_models import DeterministicModel, make_output

from crabd.integrations.minisweagent import SUBMIT_MARKER, CrabEnvironment, CrabEnvironmentError

TASK = "calc.py's add() returns the wrong sum: fix it."
BUGGY = "return a - b"
#: The scripted model's answers, one command each (mini-swe-agent's text format: one bash block per answer).
SCRIPT = (
    (
        "Set up the project.",
        "mkdir -p /tmp/demo && cd /tmp/demo && printf 'def add(a, b):\\n    return a - b\\n' > calc.py",
    ),
    # No cd: crab's session is persistent, so the directory of the step before carries over.
    # -B: no calc.pyc; the fix below keeps the file's size and may land in the same second (a stale .pyc).
    ("Show the bug.", "python3 -B -c 'import calc; print(\"add(2, 3) =\", calc.add(2, 3))'"),
    (
        "Fix it.",
        "sed -i 's/a - b/a + b/' calc.py && python3 -c 'import calc; assert calc.add(2, 3) == 5; print(\"fixed\")'",
    ),
    ("Done.", f"echo {SUBMIT_MARKER} && cat calc.py"),
)


def run(socket: str = "", output: Path | None = None, out: Any = sys.stdout) -> dict[str, Any]:
    """Run the scripted agent; returns mini-swe-agent's trajectory (also written to ``output`` if given)."""
    config = get_config_from_spec("default.yaml")
    model = DeterministicModel(  # type: ignore[no-untyped-call]
        outputs=[make_output(text, [{"command": cmd}]) for text, cmd in SCRIPT],
        observation_template=config["model"]["observation_template"],
    )
    started = time.monotonic()
    with CrabEnvironment(socket=socket, timeout=60, **config["environment"]) as env:
        agent = DefaultAgent(model, env, **config["agent"])
        result = agent.run(TASK)
        traj: dict[str, Any] = agent.save(output)
        print(f"exit status: {result.get('exit_status')}  sandbox: {env.sandbox.name}", file=out)
        print(f"{'step':>4}  {'turn':>4}  {'exit':>4}  checkpoint", file=out)
        for step in traj["info"]["crab"]["steps"]:
            ckpt = step["checkpoint_id"] or "(none)"
            print(f"{step['step']:>4}  {step['turn']:>4}  {step['returncode']:>4}  {ckpt}", file=out)
        # Back to the end of step 2 (before the fix): the files and the session's directory come back.
        env.rollback(2)
        again = env.execute({"command": "cat calc.py"})["output"]
        print(f"after rollback to step 2, calc.py says: {again.strip().splitlines()[-1].strip()}", file=out)
        traj["demo"] = {"rolled_back": BUGGY in again, "seconds": round(time.monotonic() - started, 2)}
    print(f"took {traj['demo']['seconds']} s (sandbox removed)", file=out)
    if output is not None:
        print(f"trajectory: {output}", file=out)
    return traj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crabd.integrations.minisweagent_demo", description=__doc__)
    parser.add_argument("--socket", default="", help="crabd's socket (default: crab's usual one)")
    parser.add_argument("-o", "--output", type=Path, help="write mini-swe-agent's trajectory file here")
    args = parser.parse_args(argv)
    try:
        traj = run(args.socket, args.output)
    except CrabEnvironmentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    steps_ok = all(s["returncode"] == 0 for s in traj["info"]["crab"]["steps"])
    ok = traj["info"]["exit_status"] == "Submitted" and steps_ok and traj["demo"]["rolled_back"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
