"""Every benchmark command the docs give runs as written (issue 35: five failed with `No module named 'bench'`).

Each ``python -m bench.X`` or ``python bench/X.py`` in README.md and docs/*.md is run with ``--help``
the way it is written (the interpreter is this one; the working directory the checkout's root): cheap,
as every benchmark parses its arguments before it touches the host.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import REPO

#: A benchmark command: the interpreter, then the module or the script (what follows is its options).
COMMAND = re.compile(r"\bpython3?\s+(?P<target>-m\s+bench(?:\.[a-z_]+)+|bench/[a-z_/]+\.py)")


def documented() -> dict[str, list[str]]:
    """Each distinct command target (``-m bench.x`` or ``bench/x.py``) -> where the docs give it."""
    found: dict[str, list[str]] = {}
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in COMMAND.finditer(line):
                target = " ".join(m["target"].split())
                found.setdefault(target, []).append(f"{doc.relative_to(REPO)}:{n}")
    return found


DOCUMENTED = documented()


def test_the_docs_give_benchmark_commands() -> None:
    assert len(DOCUMENTED) >= 10, DOCUMENTED  # the pattern still finds them


def test_every_documented_benchmark_command_runs_as_written() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user runs it: from the root only

    def run(target: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        argv = [sys.executable, *target.split(), "--help"]
        return target, subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, sorted(DOCUMENTED)))
    failed = {
        target: f"{', '.join(DOCUMENTED[target])}: exit {done.returncode}: {done.stderr.strip()[-300:]}"
        for target, done in results
        if done.returncode != 0 or "usage" not in done.stdout.lower()
    }
    assert not failed, "\n".join(f"python {t}  ({why})" for t, why in failed.items())


@pytest.mark.parametrize("target", ["bench/daemon.py", "-m bench.daemon"])
def test_the_pattern_reads_both_forms(target: str) -> None:
    (m,) = COMMAND.finditer(f"    .venv/bin/python {target} --out x.json")
    assert m["target"] == target
