"""How an external agent framework drives crab through the SDK (a sketch of the integration points).

A framework already has an agent loop: ask the model, run a tool, repeat.
crab needs three lines in it: create the sandbox, and mark each action as a
turn (``with sandbox.turn():``) so crab can checkpoint it while the model
thinks.  Rollback and branching are then one call each.

    python -m agents.examples.framework_loop --llm http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import sys

from agents.llm import ChatClient
from crabd.sdk import Client


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", required=True, help="OpenAI-compatible base URL")
    ap.add_argument("--socket", default="")
    args = ap.parse_args(argv)
    llm = ChatClient(args.llm)
    messages = [{"role": "user", "content": "Create a file notes.txt, then tell me what you did."}]
    with Client(args.socket or None) as crab, crab.create("bookworm", workdir="/work") as sandbox:
        # 1. The framework's loop: one model call, one action, as a crab turn.
        plan = llm.chat(messages)
        with sandbox.turn():  # begin_turn ... end_turn: crab checkpoints what this action changed
            sandbox.session.run("mkdir -p /work && echo 'first draft' > /work/notes.txt")
        good = sandbox.turns()[-1]
        # 2. A destructive action, then roll back to the turn before it.
        with sandbox.turn():
            sandbox.session.run("rm -f /work/notes.txt")
        sandbox.restore(turn=good.number)
        print(sandbox.session.run("cat /work/notes.txt").stdout.decode().strip())
        # 3. Branch: three copies of the sandbox as it is now, e.g. for three continuations.
        for branch in sandbox.fork(3):
            with branch:
                print(branch.name, branch.session.run("cat /work/notes.txt").stdout.decode().strip())
        print("model said:", plan.content[:80])
    return 0


if __name__ == "__main__":
    sys.exit(main())
