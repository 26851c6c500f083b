"""The one way crab runs host subprocesses.

Rules enforced here: argv lists only (never a shell), a timeout on every
call, output captured with a bound, and stderr carried in the error.

A helper that forks helpers of its own (``runc`` runs CRIU, which forks the
restored tasks) is run with ``kill_tree=True``: it starts as the leader of
a session of its own, and when it times out or fails, everything it
started is killed and reaped with it (:mod:`crabd.util.proctree`), never
left to run on or to linger as crabd's zombies.
"""

from __future__ import annotations

import os
import select
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from crabd.errors import CommandError, CommandTimeout
from crabd.util import priority, proctree

#: Bytes of stderr kept in an error message.
STDERR_TAIL = 4000


@dataclass(frozen=True)
class Completed:
    """The result of a finished subprocess."""

    argv: tuple[str, ...]
    exit_code: int
    stdout: bytes
    stderr: bytes

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")


def _cannot_run(args: list[str], exc: OSError) -> CommandError:
    """The error for a program that could not be started at all."""
    return CommandError(
        f"cannot run {args[0]}: {exc.strerror or exc}",
        argv=tuple(args),
        exit_code=None,
        stderr="",
        hint=f"Install {os.path.basename(args[0])} or fix PATH (`make setup` provisions crab's tools).",
    )


def _tail(data: bytes | None) -> str:
    if not data:
        return ""
    text = data.decode("utf-8", "replace").strip()
    return text if len(text) <= STDERR_TAIL else "..." + text[-STDERR_TAIL:]


def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Reap ``proc`` once it exits, waking when it does; TimeoutExpired after ``timeout`` seconds.

    Why not ``Popen.wait(timeout)``: with a timeout it polls, sleeping up to
    50 ms between looks, so a helper with no pipes (``runc create``, whose
    container init inherits its stdio) was seen to finish up to 50 ms late:
    a fifth of a sandbox create.  A pidfd becomes readable the moment the
    process exits.  The pid stays this process's child until reaped here
    (crabd never waits for "any child"), so the pidfd names this helper.
    """
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # ESRCH: it is gone already (reaped by Popen's own bookkeeping)
        proc.wait(timeout)
        return
    try:
        if not _readable(fd, timeout):
            raise subprocess.TimeoutExpired(proc.args, timeout)
    finally:
        os.close(fd)
    proc.wait()


def _readable(fd: int, timeout: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout * 1000))))


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    input: bytes | None = None,
    cwd: str | os.PathLike[str] | None = None,
    capture: bool = True,
    stream: bool = False,
    kill_tree: bool = False,
    stdout_fd: int | None = None,
) -> Completed:
    """Run ``argv`` and wait at most ``timeout`` seconds.

    Raises :class:`CommandTimeout` on timeout (the process is killed), and
    :class:`CommandError` on a non-zero exit when ``check`` is true, or when
    the program cannot be started at all.  ``capture=False`` sends stdout and
    stderr to /dev/null instead: for a program whose detached children inherit
    them (``runc run -d``), where a pipe would never see EOF.  ``stream=True``
    sends both to this process's stderr as they come (a long host set-up whose
    progress the operator watches); nothing is captured then.

    ``kill_tree=True`` (module docstring): on a timeout the helper's whole
    tree and session are killed and reaped, not the helper alone; on a
    non-zero exit whatever it left in its session is.  Only for helpers
    whose success leaves nothing of theirs in their session (a container's
    init always has a session of its own).

    ``stdout_fd``: an open descriptor the program's stdout is written to
    (output too large to hold in memory, e.g. a copy into a staging file);
    stderr is still captured.
    """
    args = [os.fspath(a) for a in argv]
    # A checkpoint job the engine runs in the background starts its helpers demoted (util/priority.py).
    bg = priority.current()
    sink: int = (2 if stream else subprocess.PIPE) if capture else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(
            bg.argv(args) if bg is not None else args,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=stdout_fd if stdout_fd is not None else sink,
            stderr=sink,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=kill_tree,
        )
    except OSError as exc:
        raise _cannot_run(args, exc) from exc
    if bg is not None:
        bg.spawned(proc.pid)
    try:
        if proc.stdin is None and proc.stdout is None and proc.stderr is None:
            _wait_exit(proc, timeout)
            stdout = stderr = None
        else:
            stdout, stderr = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        # As subprocess.run does: kill and reap, but read no more (a grandchild may hold the pipes).
        if kill_tree:
            proctree.kill_tree(proc.pid, session=proc.pid)
        proc.kill()
        proc.wait()
        raise CommandTimeout(
            f"{args[0]} did not finish within {timeout:g} s: {' '.join(args)}",
            argv=tuple(args),
            exit_code=None,
            stderr=_tail(exc.stderr if isinstance(exc.stderr, bytes) else None),
        ) from exc
    finally:
        if bg is not None:
            bg.exited(proc.pid)
    if kill_tree and proc.returncode != 0:
        # The session's id stays reserved while any member lives, so it names only what the helper left.
        proctree.kill_tree(None, session=proc.pid)
    done = Completed(tuple(args), proc.returncode, stdout or b"", stderr or b"")
    if check and proc.returncode != 0:
        tail = _tail(stderr) or _tail(stdout)
        raise CommandError(
            f"{' '.join(args)} exited with {proc.returncode}" + (f":\n{tail}" if tail else ""),
            argv=tuple(args),
            exit_code=proc.returncode,
            stderr=tail,
        )
    return done


def spawn(argv: Sequence[str], *, cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a long-lived helper (a daemon that serves one restore) and return it at once.

    Its stdio is /dev/null (such a helper logs to a file of its own); it
    leads a session of its own, so a signal to crabd's process group (Ctrl-C
    of an embedded crabd) does not end it mid-service.  The caller owns it:
    it waits for it, or kills it, and reaps it.
    """
    args = [os.fspath(a) for a in argv]
    try:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as exc:
        raise _cannot_run(args, exc) from exc
