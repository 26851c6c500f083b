"""``python -m crabd.daemon.worker``: one of crabd's other processes, as the main one starts it (daemon/workers.py).

It reads the configuration in force (JSON) from stdin, then splits in two:

* the **keeper** (this process): a child subreaper that does nothing but
  wait.  The worker below it is a subreaper too (the runc backend makes its
  containers' inits its children, backends/runc/reaper.py); when a worker
  dies, its sandboxes live on and their inits are reparented to the nearest
  subreaper above it.  Without the keeper that would be the main crabd,
  which on purpose never waits for a child it did not start, so each would
  stay a zombie there once it exited.  The keeper reaps them, passes SIGTERM
  and SIGINT on to the worker, and exits once it has no child left (the
  worker gone and every init it inherited reaped);
* the **worker** (its child): the daemon for shard N (``Daemon`` with that
  place), which prints :data:`~crabd.daemon.workers.READY_LINE` on stdout
  once it serves.  Only the worker keeps stdout, so the main process reads
  the end of it as the worker's exit, even while the keeper stays for the
  inits.

Both die with the process above them (``PR_SET_PDEATHSIG`` with SIGKILL,
checked right after it is set: a parent that died before that would never
signal).  The inits the keeper held then go to the host's init, as a
crashed single-process crabd's do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import NoReturn

from crabd.config import CrabConfig
from crabd.daemon import logs
from crabd.daemon.app import Daemon, serve
from crabd.daemon.workers import READY_LINE, place_of
from crabd.errors import CrabError
from crabd.util import faults

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)


def _die_with(parent: int) -> None:
    """SIGKILL when ``parent`` exits; exit now if it already has.

    SIGKILL, not a graceful stop: a process above that died did not stop
    crabd, it crashed, and the next crabd must not wait for this one's
    engine to drain (it waits for its shard lock).  Everything here is safe
    against kill -9 by design (crashes are the case the store is built for).
    """
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(0)


def _keep(worker: int) -> NoReturn:
    """The keeper's life: pass stop signals on, reap every child, exit with the worker's status once none is left."""

    def forward(sig: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = 1
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(code)
        if pid == worker:
            code = os.waitstatus_to_exitcode(status)
            code = code if code >= 0 else 128 - code


def _ready() -> None:
    sys.stdout.buffer.write(READY_LINE)
    sys.stdout.buffer.flush()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="crabd-worker", description="one of crabd's processes (started by crabd)")
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--parent", type=int, required=True, help="the main crabd's pid")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-file")
    p.add_argument("--ephemeral", action="store_true")
    args = p.parse_args(argv)
    _die_with(args.parent)
    cfg = CrabConfig.model_validate_json(sys.stdin.buffer.read())
    if not 0 < args.shard < cfg.daemon.workers:
        sys.exit(f"crabd-worker: shard {args.shard} is not one of 1..{cfg.daemon.workers - 1}")
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("crabd-worker: prctl(PR_SET_CHILD_SUBREAPER) failed")
    keeper = os.getpid()
    worker = os.fork()
    if worker:
        # Only the worker holds the pipe the main process reads: its end is the worker's exit.
        os.close(1)
        _keep(worker)
    _die_with(keeper)
    logs.setup(args.log_level, Path(args.log_file) if args.log_file else None, shard=args.shard)
    armed = faults.arm_from_env()
    if armed:
        logging.getLogger("crabd").warning("fault injection armed", extra={"points": armed})
    try:
        daemon = Daemon(cfg, ephemeral=args.ephemeral, place=place_of(cfg, args.shard), on_ready=_ready)
        asyncio.run(serve(daemon))
    except CrabError as exc:
        sys.stderr.write(f"crabd worker {args.shard}: {exc.message}\nhint: {exc.hint}\n")
        sys.exit(1)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
