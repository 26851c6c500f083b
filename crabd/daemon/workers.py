"""crabd's other processes (``[daemon] workers`` > 1): started, watched and stopped by the main one.

Why processes (issue 34, item 4; docs/architecture.md, "More than one
core"): one interpreter runs crab's Python on one core at a time, and the
work of a turn is spread over the whole RPC path, so no part moved off the
interpreter lock would lift that ceiling.  So each process owns a share of
the sandboxes (``sandboxes.shard``) with its own event loop, gRPC server,
public socket, coordinator, inspector and engine, and a client sends a
sandbox's calls to the process that owns it (the SDK learns where from the
sandbox's record, or from a WrongShard answer).  They share the one store:
SQLite (WAL, one writer at a time), the blob files, and the store lock,
which is a file lock across processes (util/filelock.py).

The main process (shard 0) starts the others once its own start-up is done
(the schema migrated, sandboxes of a process there no longer is rehomed,
crab's init installed, the host keys made), each as ``python -m
crabd.daemon.worker`` with the configuration in force on its stdin, and
counts crabd ready once every one has said so on its stdout.  Then it
watches them: one that exits is started again (after a pause that grows
while it keeps failing), and adopts its own sandboxes as a restarted crabd
would.  A worker dies with the main process (SIGKILL as its parent-death
signal, and a check of its parent right after setting it), so a kill -9 of
crabd never leaves a worker serving beside the next crabd; and every
process takes its shard's lock file before anything else
(``run/shard-N.lock``), so even a worker that is slow to go cannot overlap
with its successor.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from crabd.config import CrabConfig
from crabd.errors import HostError
from crabd.models import ShardPlace

log = logging.getLogger("crabd.workers")

#: What a worker prints on its stdout once it serves.
READY_LINE = b"crab-worker-ready\n"
#: Pauses before starting a worker that exited again: the n-th restart in a row waits the n-th.
RESTART_DELAYS = (0.5, 1.0, 2.0, 5.0, 10.0)
#: A worker that served this long before it exited starts again at once: it did not crash-loop.
STABLE_S = 60.0
#: How long a worker has to say it serves (its start-up is crabd's: migrations are already done).
READY_TIMEOUT_S = 120.0
#: At shut-down, how long a worker may take after SIGTERM (its engine drains first) before SIGKILL.
STOP_GRACE_S = 60.0

#: How long a process waits for the one that served its shard before to go (its engine's drain and more).
LOCK_WAIT_S = 90.0
LOCK_POLL_S = 0.1

#: Environment a worker must not inherit: systemd's notifications and watchdog are the main process's.
_NOT_INHERITED = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


def place_of(cfg: CrabConfig, index: int) -> ShardPlace:
    """Process ``index`` among ``[daemon] workers``, with every process's public socket."""
    return ShardPlace(index, tuple(str(cfg.paths.shard_socket(i)) for i in range(cfg.daemon.workers)))


@dataclass
class _Worker:
    index: int
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts_in_a_row: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    watch: asyncio.Task[None] | None = None


class Workers:
    """The main process's view of its workers: ``await start()``, then ``await close()``."""

    def __init__(
        self,
        cfg: CrabConfig,
        *,
        ephemeral: bool,
        log_level: str,
        log_file: str | None,
        module: str = "crabd.daemon.worker",
    ) -> None:
        self.cfg = cfg
        #: What each worker runs (``python -m``): a stand-in in the unit tests.
        self.module = module
        self.ephemeral = ephemeral
        self.log_level = log_level
        self.log_file = log_file
        self._workers = [_Worker(i) for i in range(1, cfg.daemon.workers)]
        self._closing = False
        #: Restarts of any worker since crabd started (``crabctl daemon status``).
        self.restarts = 0

    @property
    def count(self) -> int:
        return len(self._workers)

    def ready(self, shard: int) -> bool:
        """Whether worker ``shard`` serves now (it said so and has not exited since)."""
        w = self._workers[shard - 1]
        return w.ready.is_set() and not w.exited.is_set()

    def keepers(self) -> dict[int, int]:
        """The pid of each running worker's keeper (the worker is its one child that holds stdout), by shard."""
        return {w.index: w.proc.pid for w in self._workers if w.proc is not None and not w.exited.is_set()}

    async def start(self) -> None:
        """Start every worker and wait until each serves (HostError if one cannot)."""
        for w in self._workers:
            w.watch = asyncio.create_task(self._supervise(w), name=f"crab-worker-{w.index}")
        deadline = time.monotonic() + READY_TIMEOUT_S
        for w in self._workers:
            try:
                await asyncio.wait_for(w.ready.wait(), max(0.1, deadline - time.monotonic()))
            except TimeoutError as exc:
                raise HostError(
                    f"crabd's worker {w.index} did not start serving within {READY_TIMEOUT_S:.0f} s",
                    hint='Its log lines ("shard": N) say why; crabd starts with [daemon] workers = 1 meanwhile.',
                ) from exc

    async def _supervise(self, w: _Worker) -> None:
        """Worker ``w`` for as long as crabd runs: start it, read its ready line and its exit, start it again.

        The pause before a start grows while the worker keeps dying within :data:`STABLE_S`
        (:data:`RESTART_DELAYS`), so a worker that cannot start does not spin.
        """
        while not self._closing:
            try:
                await self._spawn(w)
            except OSError as exc:  # the interpreter could not be started: try again, as after a death
                w.exited.set()
                log.error("worker could not be started", extra={"shard": w.index, "error": str(exc)})
            else:
                await self._until_exit(w)
            if self._closing:
                return
            served = time.monotonic() - w.started_at
            w.restarts_in_a_row = 0 if served >= STABLE_S else w.restarts_in_a_row + 1
            delay = (
                0.0 if w.restarts_in_a_row == 0 else RESTART_DELAYS[min(w.restarts_in_a_row, len(RESTART_DELAYS)) - 1]
            )
            log.error(
                "worker exited; starting it again",
                extra={"shard": w.index, "served_s": round(served, 1), "in_s": delay},
            )
            await asyncio.sleep(delay)
            self.restarts += 1

    async def _spawn(self, w: _Worker) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        argv = [sys.executable, "-m", self.module, "--shard", str(w.index), "--parent", str(os.getpid())]
        argv += ["--log-level", self.log_level]
        if self.log_file:
            argv += ["--log-file", self.log_file]
        if self.ephemeral:
            argv.append("--ephemeral")
        w.ready.clear()
        w.exited.clear()
        w.started_at = time.monotonic()
        w.proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, start_new_session=True
        )
        assert w.proc.stdin is not None
        # The configuration in force (the file with the command line's overrides), not the file again.
        w.proc.stdin.write(self.cfg.model_dump_json().encode())
        await w.proc.stdin.drain()
        w.proc.stdin.close()
        log.info("worker started", extra={"shard": w.index, "keeper": w.proc.pid})

    async def _until_exit(self, w: _Worker) -> None:
        """Read the worker's ready line, then the end of its stdout: its exit.

        The process started is the worker's keeper (daemon/worker.py), which may stay after the
        worker for the sandboxes' inits it inherited; only the worker holds the pipe.
        """
        proc = w.proc
        assert proc is not None and proc.stdout is not None
        while line := await proc.stdout.readline():
            if line == READY_LINE:
                w.ready.set()
        w.exited.set()

    async def close(self) -> None:
        """SIGTERM to every worker (each stops as crabd does), SIGKILL after :data:`STOP_GRACE_S`.

        The signal goes to the keeper, which passes it on; a keeper that stays for inits after
        its worker stopped is left to finish that on its own.
        """
        self._closing = True
        running = [w for w in self._workers if w.proc is not None and not w.exited.is_set()]
        for w in running:
            assert w.proc is not None
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGTERM)
        for w in running:
            assert w.proc is not None
            try:
                await asyncio.wait_for(w.exited.wait(), STOP_GRACE_S)
            except TimeoutError:
                log.error("worker did not stop in time; killed", extra={"shard": w.index, "keeper": w.proc.pid})
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(w.proc.pid, signal.SIGKILL)
                await w.exited.wait()
        for w in self._workers:
            if w.watch is not None:
                w.watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await w.watch


class ShardLock:
    """``run/shard-N.lock``: held (flock, exclusive) for the whole life of the process that serves shard N.

    flock belongs to the open file and the kernel drops it when the process
    dies, kill -9 included; opened close-on-exec so no runc or CRIU child
    keeps it.  Two processes never serve one shard: a worker whose main
    process died may still be exiting (or a second crabd was started on this
    state dir) when the next one for its shard starts, which then waits here.
    """

    def __init__(self, run_dir: Path, index: int) -> None:
        self.path = run_dir / f"shard-{index}.lock"
        self.index = index
        self._fd: int | None = None

    async def take(self, timeout_s: float = LOCK_WAIT_S) -> None:
        """Hold it, waiting up to ``timeout_s`` for a predecessor to go (HostError after that)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        if not await _poll_flock(fd, timeout_s):
            os.close(fd)
            raise HostError(
                f"another crabd process still serves shard {self.index} of this state dir ({self.path} is locked)",
                hint="Stop the other crabd on this state dir (`systemctl stop crabd`, or kill it) and start again.",
            )
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


async def wait_for_predecessors(run_dir: Path, mine: int, timeout_s: float = LOCK_WAIT_S) -> None:
    """Until no process of an earlier crabd serves any shard here (every ``shard-*.lock`` but ``mine`` free).

    The main process's start-up sweeps (orphaned containers, blob and dump
    leftovers, everyone's reservations and leases) assume no other crabd
    process is alive; an earlier one's workers die with it (SIGKILL), but
    not in the same instant.
    """
    for path in sorted(run_dir.glob("shard-*.lock")):
        if path.name == f"shard-{mine}.lock":
            continue
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if not await _poll_flock(fd, timeout_s):
                raise HostError(
                    f"a process of an earlier crabd still holds {path}",
                    hint="Stop every crabd process on this state dir (`pkill -f crabd.daemon.worker`) and start again.",
                )
        finally:
            os.close(fd)  # a lock taken here goes with the descriptor


async def _poll_flock(fd: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(LOCK_POLL_S)
