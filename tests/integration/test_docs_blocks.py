"""The README and docs run as written: every block marked ``run`` against a private crabd (tests/docblocks.py).

Python blocks run standalone (``Client()`` reaches the test crabd through
$CRAB_SOCKET); shell blocks run command by command in one bash, with this
checkout's ``crabctl`` first on PATH.  What a block claims to print is
asserted, and no sandbox may be left behind by any block.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from crabd.sdk import Client, EmbeddedDaemon
from tests.conftest import REPO
from tests.docblocks import (
    Action,
    Block,
    all_blocks,
    missing_claims,
    python_claims,
    shell_commands,
    shell_script,
    split_output,
)

RUN = [b for b in all_blocks(REPO) if b.decision is not None and b.decision.action is Action.RUN]


def _param(block: Block) -> object:
    # A block that takes a full checkpoint, or leaves a process running into one, needs CRIU.
    needs_criu = "full" in block.code or " &" in block.code
    return pytest.param(block, id=block.where, marks=[pytest.mark.criu] if needs_criu else [])


BLOCK_TIMEOUT_S = 900


def _env(daemon: EmbeddedDaemon) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return dict(
        os.environ,
        PATH=f"{venv_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        PYTHONPATH=str(REPO),  # this checkout's crabd, also for the crabctl entry point
        CRAB_SOCKET=str(daemon.socket),
        COLUMNS="200",
    )


def _run_python(block: Block, env: dict[str, str], cwd: Path) -> None:
    script = cwd / "block.py"
    script.write_text(block.code)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )
    assert done.returncode == 0, f"{block.where} failed:\n{done.stdout}\n{done.stderr}"
    missing = missing_claims(python_claims(block.code), done.stdout)
    assert not missing, f"{block.where} did not print {missing}; it printed:\n{done.stdout}"


def _run_shell(block: Block, env: dict[str, str], cwd: Path) -> None:
    commands = shell_commands(block.code)
    done = subprocess.run(
        ["bash", "-c", shell_script(commands)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    runs = split_output(done.stdout, len(commands))
    for command, ran in zip(commands, runs, strict=False):
        where = f"{block.where} line {command.line}: {command.text!r}"
        assert ran.rc == 0, f"{where} exited {ran.rc}:\n{ran.output}{done.stderr}"
        missing = missing_claims(command.claims, ran.output)
        assert not missing, f"{where} did not print {missing}; it printed:\n{ran.output}"
    assert len(runs) == len(commands), f"{block.where} stopped early:\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("block", [_param(b) for b in RUN])
def test_block_runs_as_written_and_leaves_nothing(block: Block, daemon: EmbeddedDaemon, tmp_path: Path) -> None:
    with Client(daemon.socket) as client:
        before = {sb.id for sb in client.list()}
        try:
            (_run_python if block.lang == "python" else _run_shell)(block, _env(daemon), tmp_path)
        finally:
            left = [sb for sb in client.list() if sb.id not in before]
            for sb in left:  # the next block starts clean whatever this one did
                sb.remove(force=True)
        assert not left, f"{block.where} left sandboxes behind: {[sb.name for sb in left]}"
