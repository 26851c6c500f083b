"""Lazy restore: memory pages served on first touch by a ``criu lazy-pages`` daemon (userfaultfd).

An eager restore copies every page of every process before the first
instruction runs (about 200 ms for 200 MB here).  A lazy one (``runc
restore --lazy-pages``) maps the memory empty, registers it with one
userfaultfd per process and hands those to a daemon, ``criu lazy-pages``,
started just before on the same image directory and work dir (the restore
finds it by its socket there).  The processes run at once; the daemon
answers each fault with the page from the image files, pushes every other
page in the background meanwhile, and exits 0 once all are in (its log's
last word: ``UFFD transferred pages: (N/N)``).  From then on the processes
own all their memory, as after an eager restore.

Never a zero page.  Closing a userfaultfd unregisters its ranges, and a
fault there afterwards gets a fresh zero page, silently.  A daemon that
died mid-service (killed, out of memory, an unreadable image) would have
its descriptors closed by the kernel, and the restored processes would run
on with zeroes where their memory was.  So crabd holds a copy of each of
the daemon's userfaultfds (``pidfd_getfd(2)``, :meth:`PageServer.guard`)
from right after the restore until the daemon exited 0: while a copy is
open the ranges stay armed, a fault with nobody to answer it waits, and
crabd, seeing the daemon fail, kills the container before it closes the
copies (``backends/runc/lazy_restores.py``).  A copy goes as soon as the
daemon, still running, closed its own (that process's pages are all in):
CRIU's close must unregister the ranges (:meth:`PageServer.release_done`).

What is left unguarded, and said so: the few milliseconds between the end
of ``runc restore`` (the processes resume) and crabd taking the copies, and
the time after crabd itself died (its copies go with it; ``KillMode=process``
leaves the daemon running, and the next crabd learns whether it completed
from its exit status: :func:`completed`).

The daemon runs under a one-line ``sh`` that waits for it and writes its
exit status to a file: crabd is its parent only while crabd lives, and
CRIU logs its completion only at debug level (a line per page before it).

CRIU's work dir of a lazy restore holds, besides ``restore.log``:

    lazy-pages.socket   the daemon's socket (CRIU's own name for it)
    lazy-pages.log      the daemon's log (``-o``, relative to the work dir)
    lazy-pages.pid      the supervising shell's pid, for a crabd started after this one died
    lazy-pages.status   the daemon's exit status, once it ended ("0": every page delivered)
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from crabd.errors import CommandError, CriuError
from crabd.util import libc, proc

log = logging.getLogger("crabd.criu")

SOCKET = "lazy-pages.socket"
LOG = "lazy-pages.log"
PIDFILE = "lazy-pages.pid"
STATUS = "lazy-pages.status"
#: The supervising shell: runs the daemon ($@), records its exit status atomically, exits with it.  The
#: work dir is its cwd; every variable part is a positional parameter, never shell text.
_SUPERVISOR = (
    'rc=0; "$@" || rc=$?; echo "$rc" > lazy-pages.status.tmp && mv -f lazy-pages.status.tmp lazy-pages.status;'
    ' exit "$rc"'
)
#: How long the daemon may take to listen (it reads no image before the restore connects).
START_TIMEOUT_S = 5.0
#: What /proc/PID/fd/N of a userfaultfd reads.
_UFFD_LINK = "anon_inode:[userfaultfd]"
#: How long :meth:`PageServer.close` lets the shell reap the killed daemon before it kills the shell too.
CLOSE_WAIT_S = 5.0
#: How often the watch of a lazy restore lets go of the copies whose originals the daemon closed (release_done).
RELEASE_POLL_S = 0.01
#: How much of the daemon's log a failure quotes.
_LOG_TAIL = 1500


@dataclass(frozen=True)
class PagesChoice:
    """How one restore brings its memory back, and why (logged with the restore)."""

    lazy: bool
    reason: str


def choose(*, enabled: bool, page_bytes: int, min_bytes: int, unsupported: str) -> PagesChoice:
    """Lazy when the host can, the config allows it, and the images hold enough pages for it to pay."""
    if not enabled:
        return PagesChoice(False, "lazy restore is off ([runtime] lazy_restore)")
    if unsupported:
        return PagesChoice(False, f"this host cannot restore lazily: {unsupported}")
    if page_bytes < min_bytes:
        return PagesChoice(
            False, f"{page_bytes} bytes of pages, under [runtime] lazy_min_bytes ({min_bytes}): copying is cheaper"
        )
    return PagesChoice(True, f"{page_bytes} bytes of pages served on first touch")


def page_bytes(images_dir: Path) -> int:
    """Bytes of memory pages in a dump directory (its ``pages-*.img`` files)."""
    total = 0
    with os.scandir(images_dir) as it:
        for entry in it:
            if entry.name.startswith("pages-") and entry.name.endswith(".img") and entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def unsupported(criu: str | None) -> str:
    """Why this host cannot restore lazily ("" when it can): CRIU's own check of non-cooperative uffd."""
    if criu is None:
        return "criu is not installed"
    try:
        proc.run([criu, "check", "--feature", "uffd-noncoop"], timeout=30)
    except CommandError as exc:
        return f"`criu check --feature uffd-noncoop` failed: {exc.stderr.strip()[-300:] or exc.message}"
    return ""


#: The sysctl that lets processes without CAP_SYS_PTRACE in the host's user namespace make a userfaultfd.
UNPRIVILEGED_SYSCTL = Path("/proc/sys/vm/unprivileged_userfaultfd")


def userns_unsupported(sysctl: Path = UNPRIVILEGED_SYSCTL) -> str:
    """Why a container in a user namespace cannot be restored lazily here ("" if it can).

    CRIU makes each task's userfaultfd inside the task, already in the
    container's user namespace: there it holds no capability of the host's,
    and the kernel refuses (EPERM) unless ``vm.unprivileged_userfaultfd`` is
    1.  crab does not turn that on: it would hand every sandbox process the
    userfaultfd, a favourite tool for widening kernel race windows.
    """
    try:
        value = sysctl.read_text().strip()
    except OSError:
        return ""  # a kernel without the sysctl lets anyone
    if value == "1":
        return ""
    return (
        "the sandbox runs in a user namespace, where CRIU cannot make its userfaultfds while "
        "vm.unprivileged_userfaultfd is 0 (crab leaves it so: it keeps userfaultfd from sandboxes)"
    )


def completed(work_dir: Path) -> bool:
    """Whether the daemon of the lazy restore in ``work_dir`` exited 0 (delivered every page)."""
    try:
        return (work_dir / STATUS).read_text().strip() == "0"
    except OSError:
        return False


def describe_exit(code: int) -> str:
    """A page server's exit status in words (a shell reports death by signal N as 128 + N)."""
    signo = -code if code < 0 else code - 128 if code > 128 else 0
    if signo:
        try:
            return f"killed by {signal.Signals(signo).name}"
        except ValueError:
            return f"killed by signal {signo}"
    return f"exit {code}"


def daemon_pid(work_dir: Path) -> int | None:
    """The pid :class:`PageServer` recorded for the daemon's supervisor in ``work_dir`` (None: none)."""
    try:
        text = (work_dir / PIDFILE).read_text()
    except OSError:
        return None
    return int(text) if text.strip().isdigit() else None


class PageServer:
    """One ``criu lazy-pages`` daemon serving the restore whose CRIU work dir is ``work_dir``.

    ``start()`` before ``runc restore --lazy-pages --work-path work_dir``,
    ``guard()`` right after it, then ``wait()``; ``close()`` in every case
    (kills a daemon still serving, closes the guard copies).  The container
    must be killed before ``close()`` when the daemon did not complete.
    """

    def __init__(self, images_dir: Path, work_dir: Path, *, criu: str = "criu") -> None:
        self.images_dir = images_dir
        self.work_dir = work_dir
        self.criu = criu
        #: The supervising shell (module docstring); the daemon is its one child.
        self._proc: subprocess.Popen[bytes] | None = None
        self._daemon_pid: int | None = None
        #: A pidfd of the daemon: signals and descriptor copies reach it, never a process that reused its pid.
        self._daemon_fd: int | None = None
        #: (the daemon's descriptor number, crabd's copy) of each userfaultfd guarded and not yet released.
        self._guards: list[tuple[int, int]] = []
        #: Copies whose originals the daemon no longer held at the last :meth:`release_done` (released at the next).
        self._missing: set[int] = set()
        #: How many userfaultfds :meth:`guard` took copies of, and how many :meth:`release_done` let go.
        self.guarded = 0
        self.released = 0
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Run the daemon and wait until it listens.  Raises CriuError if it does not."""
        argv = [self.criu, "lazy-pages", "--images-dir", str(self.images_dir), "--work-dir", str(self.work_dir)]
        argv += ["-o", LOG, "-v2"]
        self.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.started_at = time.monotonic()
        try:
            self._proc = proc.spawn(["sh", "-c", _SUPERVISOR, "sh", *argv], cwd=self.work_dir)
        except CommandError as exc:
            raise CriuError(
                f"cannot start CRIU's lazy-pages daemon: {exc.message}", log_path=None, log_excerpt=""
            ) from exc
        (self.work_dir / PIDFILE).write_text(f"{self._proc.pid}\n")
        deadline = self.started_at + START_TIMEOUT_S
        while not (self.work_dir / SOCKET).exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                why = self.failure()
                raise CriuError(
                    f"CRIU's lazy-pages daemon did not listen (exit {self._proc.poll()}): {why}",
                    log_path=str(self.work_dir / LOG),
                    log_excerpt=why,
                )
            time.sleep(0.002)
        self._daemon_pid = self._child()
        if self._daemon_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                self._daemon_fd = os.pidfd_open(self._daemon_pid)

    def _child(self) -> int | None:
        """The daemon's pid: the supervising shell's one child (None if it is gone already)."""
        assert self._proc is not None
        pid = self._proc.pid
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def guard(self) -> int:
        """Take a copy of each of the daemon's userfaultfds (module docstring); how many it holds now.

        Raises CriuError when the daemon holds none while it still runs: the
        restore it served would then be unguarded (an exit 0 already is fine).
        """
        assert self._proc is not None
        if self._daemon_fd is None:
            return 0  # ended already: wait() says how
        for fd in self._uffd_numbers():
            with contextlib.suppress(OSError):  # closed meanwhile (that task's pages are all in), or it ended
                self._guards.append((fd, libc.pidfd_getfd(self._daemon_fd, fd)))
        self.guarded = len(self._guards)
        if not self._guards and self._proc.poll() is None:
            raise CriuError(
                f"CRIU's lazy-pages daemon (pid {self._daemon_pid}) holds no userfaultfd after the restore",
                log_path=str(self.work_dir / LOG),
                log_excerpt=self.failure(),
            )
        return len(self._guards)

    def _uffd_numbers(self) -> list[int]:
        fd_dir = f"/proc/{self._daemon_pid}/fd"
        found = []
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    if os.readlink(f"{fd_dir}/{name}") == _UFFD_LINK:
                        found.append(int(name))
        return found

    def release_done(self) -> int:
        """Close the copies of the userfaultfds the daemon itself closed while it serves on; how many now.

        CRIU closes a process's userfaultfd once it delivered every page of
        it (or the process exited), and counts on that close to unregister
        the ranges: a later fault there (a page the dump never held, memory
        freed with MADV_DONTNEED and touched again) then gets a zero page
        from the kernel, as in any process.  A copy held past that point
        keeps the ranges armed with nobody to answer: the process hangs in
        the fault, and CRIU's epoll keeps reporting the closed descriptor.
        Seen: crab-init stuck in ``handle_userfault`` and the daemon spinning
        at 100% CPU on EBADF until crabd was stopped.

        A close counts only while the daemon's descriptor table is whole and
        it has not exited: a dying daemon (killed, or failed) loses all its
        descriptors at once, and those copies are exactly what must stay.
        The same original must be missing at two calls in a row, and the
        daemon alive at both, so that a failure path's closes just before
        its exit are not taken for deliveries (the watch polls every
        RELEASE_POLL_S).
        """
        if self._daemon_pid is None or not self._guards or not self._serving():
            return 0
        missing = set()
        for orig, copy in self._guards:
            try:
                held = libc.kcmp_file(self._daemon_pid, os.getpid(), orig, copy)
            except OSError as exc:
                # Only EBADF says the original is closed.  Any other failure (ENOSYS, EPERM) proves nothing,
                # and a copy let go while the daemon still serves could hand the process a zero page.
                held = exc.errno != errno.EBADF
            if not held:
                missing.add(copy)
        # Whole: it still holds other descriptors (an exiting task's table is detached at once) and runs.
        if missing and (not self._table_whole() or not self._serving()):
            return 0
        done, self._missing = missing & self._missing, missing
        if not done:
            return 0
        self._guards = [(orig, copy) for orig, copy in self._guards if copy not in done]
        for copy in done:
            os.close(copy)
        self.released += len(done)
        return len(done)

    def _serving(self) -> bool:
        """The daemon has not exited (its pidfd is not readable yet)."""
        if self._daemon_fd is None:
            return False
        readable, _, _ = select.select([self._daemon_fd], [], [], 0)
        return not readable

    def _table_whole(self) -> bool:
        try:
            return bool(os.listdir(f"/proc/{self._daemon_pid}/fd"))
        except OSError:
            return False

    def wait(self, timeout_s: float | None = None) -> int:
        """The daemon's exit status once it ended (0: every page delivered).  Raises TimeoutError."""
        assert self._proc is not None
        try:
            return self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"lazy-pages daemon {self._proc.pid} still serving") from exc

    def failure(self) -> str:
        """What the daemon's log says went wrong (its last lines)."""
        try:
            with open(self.work_dir / LOG, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - _LOG_TAIL))
                tail = f.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(no log: {exc.strerror})"
        lines = tail.strip().splitlines()
        errors = [line for line in lines if "Error" in line]
        if errors:
            return " | ".join(errors[-3:])
        return lines[-1] if lines else "(log empty)"

    def close(self) -> None:
        """Kill the daemon if it still serves, reap its supervisor, then close the guard copies.

        The shell reaps the daemon itself (it is the shell's child): it is let
        do so before it is killed, else the killed daemon would be left a
        zombie for crabd, a subreaper that waits only for the pids it knows.
        """
        if self._proc is not None and self._proc.poll() is None:
            if self._daemon_fd is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._daemon_fd, signal.SIGKILL)
            try:
                self._proc.wait(CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._daemon_fd is not None:
            os.close(self._daemon_fd)
            self._daemon_fd = None
        guards, self._guards = self._guards, []
        for _, copy in guards:
            os.close(copy)
