"""Process dumps of Docker containers by driving runc (and through it CRIU) directly.

Why runc and not ``docker checkpoint create`` (measured on this host kind,
bash + a Python HTTP server, CRIU 4.2.1, see docs/processes.md): ``docker
checkpoint create --leave-running`` took 0.58-0.67 s, ``runc checkpoint
--leave-running`` on the same Docker-managed container 0.26-0.39 s — the
difference is dockerd/containerd plumbing, not CRIU.  runc's images are the
ones ``docker start --checkpoint`` restores from, so restores still go
through Docker and the engine keeps owning the container.

How a dump is run:

* ``runc --root <moby runtime root> checkpoint --leave-running`` against the
  container id Docker gave runc.  The caller has already frozen the
  container's cgroup; CRIU notices, dumps, and restores the freezer state it
  found (frozen), so the filesystem can be captured at the same instant.
* ``--tcp-established``: established TCP connections are dumped (a
  loopback connection between two processes of the sandbox survives a
  restore); crab rewrites connections to other hosts as closed before a
  restore (``sockets.py``).
* ``--file-locks``: SQLite and friends hold fcntl locks.
* Afterwards the dump is checked against the container's cgroup: a
  process that is not a descendant of the container's PID 1 (``docker
  exec``) is silently left out by CRIU, so crab refuses such a dump
  (IncompleteDump) instead of publishing a checkpoint that would lose it.

CRIU's own log is kept on failure (``<state_dir>/logs/criu``) and named in
the error, with an excerpt.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from crabd.backends.criu.images import dumped_tasks
from crabd.backends.procdump import DumpResult
from crabd.errors import CommandError, CriuError, IncompleteDump
from crabd.util import cgroups, proc

DEFAULT_RUNC_ROOT = Path("/run/docker/runtime-runc/moby")


#: CRIU logs these as errors on every run here and carries on (see PLATFORM.md); they explain nothing.
_NOISE = ("Can't setup RLIMIT_NOFILE",)


def log_excerpt(log: Path, limit: int = 12) -> str:
    """CRIU's error lines (and the last lines) of a log, for an error message."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    lines = [ln for ln in lines if not any(n in ln for n in _NOISE)]
    # "Runaway socket" (a debug line) names the socket outside the dump that a dumped one is
    # connected to, just before "External socket is used", which names neither.
    errors = [ln for ln in lines if "Error" in ln or "Runaway socket" in ln]
    tail = lines[-3:]
    picked = errors[-limit:] + [ln for ln in tail if ln not in errors]
    return "\n".join(picked)


def _culprit(excerpt: str) -> str:
    """The process CRIU was dumping when it failed, as "pid (command line)", if the log names one."""
    found = re.search(r"\(pid: (\d+)\)", excerpt)
    if not found:
        return ""
    pid = found.group(1)
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f" while dumping process {pid} ({cmd[:120]})"


def _container_pids(container_id: str) -> dict[int, str]:
    """{pid inside the sandbox: command name} of every process in the container's cgroups."""
    out: dict[int, str] = {}
    for host_pid in cgroups.container_host_pids(container_id):
        pid, name = cgroups.ns_pid(host_pid)
        if pid:  # 0: gone meanwhile (cannot happen while frozen)
            out[pid] = name
    return out


#: What every sandbox dump passes to CRIU (why: see the module's docstring).
DUMP_OPTIONS = ("--tcp-established", "--file-locks")


def checkpoint_argv(
    runc: str,
    runc_root: Path,
    container_id: str,
    images_dir: Path,
    work_dir: Path,
    *,
    leave_running: bool = True,
    options: tuple[str, ...] = DUMP_OPTIONS,
) -> list[str]:
    """``runc checkpoint`` of ``container_id`` into ``images_dir`` (CRIU's log lands in ``work_dir``)."""
    return [
        runc,
        "--root",
        str(runc_root),
        "checkpoint",
        *(["--leave-running"] if leave_running else []),
        *options,
        "--image-path",
        str(images_dir),
        "--work-path",
        str(work_dir),
        container_id,
    ]


#: The longest container id a kept log's name holds as it is (runc's ids are at most 114: runc/naming.py).
_LOG_ID_MAX = 128


def _log_name(container_id: str) -> str:
    """``container_id`` as a kept log names it: whole, as a runc id's first 12 characters are its
    crabd instance (the same for every sandbox, so the logs of two sandboxes in one second collided);
    characters other than ``[A-Za-z0-9_.-]`` replaced, and an overlong id cut, a digest of it kept."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", container_id) or "_"
    if len(safe) > _LOG_ID_MAX:
        safe = f"{safe[: _LOG_ID_MAX - 17]}-{hashlib.sha256(container_id.encode()).hexdigest()[:16]}"
    return safe


def keep_log(log: Path, log_dir: Path, container_id: str, what: str) -> Path | None:
    """Copy CRIU's ``log`` into ``log_dir`` under a dated name; None if there is no log."""
    if not log.exists():
        return None
    log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    kept = log_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{_log_name(container_id)}-{what}.log"
    shutil.copyfile(log, kept)
    return kept


class RuncDumper:
    """:class:`~crabd.backends.procdump.ProcessDumper` through runc."""

    def __init__(
        self,
        *,
        runc: str = "runc",
        runc_root: Path = DEFAULT_RUNC_ROOT,
        timeout_s: float = 300.0,
        log_dir: Path,
        options_for: Callable[[str], tuple[str, ...]] | None = None,
    ) -> None:
        """``options_for(container id)``: runc options a dump of that container adds (the runc backend's
        ``--empty-ns network`` for a user-namespaced container); None: none."""
        self.options_for = options_for
        self.runc = runc
        self.runc_root = runc_root
        self.timeout_s = timeout_s
        self.log_dir = log_dir

    def version(self) -> str:
        out = proc.run(["criu", "--version"], timeout=30).out
        return out.splitlines()[0].replace("Version: ", "") if out else "?"

    def _keep_log(self, log: Path, container_id: str, what: str) -> Path | None:
        return keep_log(log, self.log_dir, container_id, what)

    def dump(self, container_id: str, images_dir: Path, work_dir: Path) -> DumpResult:
        """The dump, in three steps: the command (:meth:`_argv`), CRIU's run, the completeness check."""
        t0 = time.monotonic()
        extra = self.options_for(container_id) if self.options_for is not None else ()
        self._run(self._argv(container_id, images_dir, work_dir, extra), container_id, work_dir)
        return self._checked(container_id, images_dir, t0)

    def _argv(self, container_id: str, images_dir: Path, work_dir: Path, extra: tuple[str, ...]) -> list[str]:
        """``runc checkpoint`` with the usual options and ``extra`` (runc's spelling)."""
        return checkpoint_argv(
            self.runc, self.runc_root, container_id, images_dir, work_dir, options=(*DUMP_OPTIONS, *extra)
        )

    def _run(self, argv: list[str], container_id: str, work_dir: Path) -> None:
        """Run ``argv``; a failure becomes CriuError with CRIU's log kept and quoted."""
        try:
            proc.run(argv, timeout=self.timeout_s, kill_tree=True)
        except CommandError as exc:
            kept = self._keep_log(work_dir / "dump.log", container_id, "dump")
            excerpt = log_excerpt(kept) if kept else exc.stderr
            raise CriuError(
                f"CRIU could not dump sandbox container {container_id[:12]}{_culprit(excerpt)}:\n"
                f"{excerpt or exc.message}",
                log_path=str(kept) if kept else None,
                log_excerpt=excerpt,
                hint="The sandbox keeps running and no checkpoint was made; the CRIU log named here says what "
                "it could not handle.",
            ) from exc

    def _checked(self, container_id: str, images_dir: Path, t0: float) -> DumpResult:
        """The dump's result, once every process of the container's cgroup is found in it."""
        tasks = dumped_tasks(images_dir)
        dumped = {t.pid for t in tasks}
        missing = {pid: name for pid, name in _container_pids(container_id).items() if pid not in dumped}
        if missing:
            listed = ", ".join(f"{pid} ({name})" for pid, name in sorted(missing.items()))
            raise IncompleteDump(
                f"processes {listed} run in the sandbox but outside its init's process tree, so a restore would "
                "lose them; no checkpoint was made",
                pids=sorted(missing),
            )
        return DumpResult(images_dir, time.monotonic() - t0, tuple(sorted(dumped)))
