"""Task suites (``envs/tasks/<suite>/<task>/``): load them, prepare a sandbox, run the oracle, verify.

On-disk layout of one task, after Terminal-Bench's (``task.yaml``,
``solution``, ``run-tests.sh`` and ``tests/``), in TOML::

    envs/tasks/<suite>/<task-id>/
      task.toml        instruction, image, workdir, tags, what live state it depends on
      files/           optional: copied into the sandbox at ``workdir`` before setup
      setup.sh         optional: the rest of the environment recipe; bash, run at ``workdir``
      solution.toml    the oracle: [[turn]] entries, each one agent action (see below)
      run-tests.sh     the verifier; exit 0 only when the task is really solved
      tests/           files the verifier uses

``solution.toml``::

    [[turn]]
    think = "Start the server first."   # what the agent says before acting (optional)
    run = "python3 server.py &"         # typed into the agent's bash session; may be several lines
    timeout_s = 120                     # optional, default 120

The verifier's files are copied into the sandbox only when it runs (at
``/tests``), so an agent never sees them, and ``files/tests`` (a
repository's own tests) as shipped goes to ``/tests/repo_tests``, so edits
to them do not count; a suite's ``_shared/`` goes to ``/tests/shared``
(verifier code its tasks share).  It runs as a separate program (not in the agent's
session) with ``workdir`` as its directory.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import tarfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crabd.sdk import AsyncClient, AsyncSandbox, Client, ExecResult, Sandbox

ROOT = Path(__file__).resolve().parent.parent / "envs" / "tasks"
SUITES = ("shell", "repair", "mixed")
#: Where the verifier's files go inside the sandbox.
TESTS_DIR = "/tests"


class TaskError(Exception):
    """A task that cannot be loaded or whose environment could not be prepared."""


class TaskSpec(BaseModel):
    """``task.toml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instruction: str = Field(min_length=1, description="What the agent is asked to do.")
    image: str = Field(default="bookworm", description="crab env image the sandbox starts from.")
    workdir: str = Field(default="/app", description="Where the agent starts and files/ are copied.")
    difficulty: Literal["easy", "medium", "hard"] = "medium"
    tags: tuple[str, ...] = ()
    depends_on: tuple[Literal["files", "session", "processes"], ...] = Field(
        default=(), description="Live state the later turns need: what a recovery must bring back."
    )
    max_agent_timeout_sec: float = Field(default=600, gt=0)
    max_test_timeout_sec: float = Field(default=120, gt=0)


class OracleTurn(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run: str = Field(min_length=1)
    think: str = ""
    timeout_s: float = Field(default=120, gt=0)


class Solution(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    turn: tuple[OracleTurn, ...] = Field(min_length=1)


@dataclass(frozen=True)
class Task:
    suite: str
    id: str
    path: Path
    spec: TaskSpec
    turns: tuple[OracleTurn, ...]

    @property
    def name(self) -> str:
        return f"{self.suite}/{self.id}"


@dataclass(frozen=True)
class Verdict:
    passed: bool
    exit_code: int
    output: str
    seconds: float


def _toml(path: Path) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TaskError(f"{path}: {exc}") from exc


def load_task(path: Path, suite: str = "") -> Task:
    try:
        spec = TaskSpec.model_validate(_toml(path / "task.toml"))
        solution = Solution.model_validate(_toml(path / "solution.toml"))
    except ValidationError as exc:
        raise TaskError(f"{path}: {exc}") from exc
    if not (path / "run-tests.sh").is_file():
        raise TaskError(f"{path}: no run-tests.sh (every task needs a verifier)")
    return Task(suite or path.parent.name, path.name, path, spec, solution.turn)


def load_suite(suite: str, root: Path = ROOT) -> list[Task]:
    base = root / suite
    if not base.is_dir():
        raise TaskError(f"no suite {suite!r} under {root} (suites: {', '.join(SUITES)})")
    return [load_task(p, suite) for p in sorted(base.iterdir()) if (p / "task.toml").is_file()]


def find(name: str, root: Path = ROOT) -> Task:
    """A task by ``suite/id``."""
    suite, _, tid = name.partition("/")
    path = root / suite / tid
    if not tid or not (path / "task.toml").is_file():
        raise TaskError(f"no task {name!r} (expected suite/id under {root})")
    return load_task(path, suite)


def tar_of(src: Path, prefix: str = "") -> bytes:
    """A tar (in memory) of ``src``'s contents, owned by root, modes kept."""

    def reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(src.rglob("*")):
            tar.add(p, arcname=f"{prefix}{p.relative_to(src)}", recursive=False, filter=reset)
    return buf.getvalue()


@dataclass(frozen=True)
class _Exec:
    """One program the task's recipe or verifier runs in the sandbox (the sync and async paths share these)."""

    argv: tuple[str, ...]
    what: str
    stdin: bytes = b""
    workdir: str = ""
    timeout: float = 120.0


def _copy(src: Path, dest: str) -> _Exec:
    return _Exec(
        ("sh", "-c", 'mkdir -p "$1" && tar -x -C "$1"', "put", dest), f"copying {src} into {dest}", tar_of(src)
    )


def _prepare_plan(task: Task) -> list[_Exec]:
    wd = task.spec.workdir
    files = task.path / "files"
    plan = [_copy(files, wd) if files.is_dir() else _Exec(("mkdir", "-p", wd), f"creating {wd}")]
    setup = task.path / "setup.sh"
    if setup.is_file():
        plan.append(_Exec(("bash", "-s"), f"{task.name}: setup.sh", setup.read_bytes(), wd, 600.0))
    return plan


def _verify_plan(task: Task) -> tuple[list[_Exec], _Exec]:
    """The copies of the verifier's files, then the verifier itself."""
    copies = [_Exec(("rm", "-rf", TESTS_DIR), f"removing {TESTS_DIR}")]
    if (task.path / "tests").is_dir():
        copies.append(_copy(task.path / "tests", TESTS_DIR))
    if (task.path.parent / "_shared").is_dir():
        # Verifier code the suite's tasks share.
        copies.append(_copy(task.path.parent / "_shared", f"{TESTS_DIR}/shared"))
    if (task.path / "files" / "tests").is_dir():
        # The repository's own tests as shipped: a verifier runs these, not the agent's copy.
        copies.append(_copy(task.path / "files" / "tests", f"{TESTS_DIR}/repo_tests"))
    test = _Exec(
        ("bash", "-s"),
        f"{task.name}: run-tests.sh",
        (task.path / "run-tests.sh").read_bytes(),
        task.spec.workdir,
        task.spec.max_test_timeout_sec,
    )
    return copies, test


def _checked(e: _Exec, r: ExecResult) -> None:
    if r.exit_code != 0:
        raise TaskError(f"{e.what} failed ({r.exit_code}): {r.stderr[-2000:]!r}")


def _verdict(r: ExecResult, t0: float) -> Verdict:
    out = (r.stdout + r.stderr)[-4000:].decode("utf-8", "replace")
    return Verdict(r.exit_code == 0, r.exit_code, out, time.monotonic() - t0)


def _run(sb: Sandbox, e: _Exec) -> ExecResult:
    return sb.run(list(e.argv), stdin=e.stdin, workdir=e.workdir, timeout=e.timeout)


async def _arun(sb: AsyncSandbox, e: _Exec) -> ExecResult:
    return await sb.run(list(e.argv), stdin=e.stdin, workdir=e.workdir, timeout=e.timeout)


def prepare(sb: Sandbox, task: Task) -> None:
    """The task's environment recipe, on a fresh sandbox: its files, then its setup script."""
    for e in _prepare_plan(task):
        _checked(e, _run(sb, e))


async def aprepare(sb: AsyncSandbox, task: Task) -> None:
    """:func:`prepare`, with the asyncio SDK."""
    for e in _prepare_plan(task):
        _checked(e, await _arun(sb, e))


def create(client: Client, task: Task, *, name: str = "", checkpoints: str = "auto") -> Sandbox:
    """A sandbox for ``task``, prepared; removed again if the preparation fails."""
    sb = client.create(task.spec.image, name=name, workdir=task.spec.workdir, checkpoints=checkpoints)
    try:
        prepare(sb, task)
    except BaseException:
        sb.remove(force=True)
        raise
    return sb


async def acreate(client: AsyncClient, task: Task, *, name: str = "", checkpoints: str = "auto") -> AsyncSandbox:
    """:func:`create`, with the asyncio SDK."""
    sb = await client.create(task.spec.image, name=name, workdir=task.spec.workdir, checkpoints=checkpoints)
    try:
        await aprepare(sb, task)
    except BaseException:
        await asyncio.shield(sb.remove(force=True))
        raise
    return sb


def verify(sb: Sandbox, task: Task) -> Verdict:
    """Run the task's verifier in the sandbox."""
    t0 = time.monotonic()
    copies, test = _verify_plan(task)
    for e in copies:
        _checked(e, _run(sb, e))
    return _verdict(_run(sb, test), t0)


async def averify(sb: AsyncSandbox, task: Task) -> Verdict:
    """:func:`verify`, with the asyncio SDK."""
    t0 = time.monotonic()
    copies, test = _verify_plan(task)
    for e in copies:
        _checked(e, await _arun(sb, e))
    return _verdict(await _arun(sb, test), t0)


@dataclass(frozen=True)
class OracleCheck:
    task: str
    ok: bool
    problem: str
    seconds: float


def check_oracle(client: Client, task: Task) -> OracleCheck:
    """On a fresh sandbox the verifier fails, every oracle turn succeeds, and then the verifier passes."""
    t0 = time.monotonic()
    slug = "".join(c if c.isalnum() else "-" for c in task.id)[:40]
    try:
        with create(client, task, name=f"oracle-{task.suite}-{slug}", checkpoints="none") as sb:
            before = verify(sb, task)
            if before.passed:
                return OracleCheck(task.name, False, "the verifier passes before the task is done", 0.0)
            for i, turn in enumerate(task.turns):
                r = sb.session.run(turn.run, timeout=turn.timeout_s)
                if r.exit_code != 0:
                    err = (r.stdout + r.stderr)[-1500:].decode("utf-8", "replace")
                    return OracleCheck(task.name, False, f"oracle turn {i} exited {r.exit_code}: {err}", 0.0)
            after = verify(sb, task)
            if not after.passed:
                return OracleCheck(task.name, False, f"the verifier fails after the oracle: {after.output}", 0.0)
    except TaskError as exc:
        return OracleCheck(task.name, False, str(exc), 0.0)
    return OracleCheck(task.name, True, "", time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    """``python -m agents.tasks check [--suite S] [--task suite/id] [--workers N]``: every oracle solves its task."""
    from crabd.sdk import EmbeddedDaemon

    ap = argparse.ArgumentParser(prog="python -m agents.tasks", description=main.__doc__)
    ap.add_argument("command", choices=["check", "list"])
    ap.add_argument("--suite", action="append", choices=SUITES, help="default: every suite")
    ap.add_argument("--task", action="append", default=[], help="suite/id (repeatable)")
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args(argv)
    tasks = [find(t) for t in args.task] or [t for s in args.suite or SUITES for t in load_suite(s)]
    if args.command == "list":
        for t in tasks:
            print(f"{t.name:40} {len(t.turns):3} turns  {','.join(t.spec.depends_on):24} {t.spec.instruction[:60]}")
        return 0
    with EmbeddedDaemon() as daemon, Client(daemon.socket) as client, ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(lambda t: check_oracle(client, t), tasks))
    for r in results:
        print(f"{'ok  ' if r.ok else 'FAIL'} {r.task:40} {r.seconds:6.1f} s  {r.problem}")
    bad = [r for r in results if not r.ok]
    print(f"{len(results) - len(bad)}/{len(results)} oracles solve their tasks")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
