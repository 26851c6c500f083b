"""The runc driver: crab's own containers, under crab's own runc state root.

Every call goes through :func:`crabd.util.proc.run` (argv list, timeout,
stderr kept).  Two kinds of call:

* Calls whose container outlives them (``create``, ``run -d``,
  ``restore -d``): runc hands ITS stdio to the container's init, so they run
  with stdout and stderr on ``/dev/null`` (a pipe would reach the sandbox and
  never see EOF; a host file on fds 0-2 would make CRIU refuse every dump,
  PLATFORM.md).  Their errors are read from runc's JSON log in the bundle
  (``--log``).
* Everything else: stdout/stderr captured as usual.

A status lookup (:meth:`Runc.state`) runs no runc at all: it reads runc's
own state files (:mod:`.statefile`), and asks ``runc state`` only when
those are not what it knows.

Every call that runs CRIU or starts a container (``create``, ``run -d``,
``checkpoint``, ``restore -d``) runs with ``kill_tree``: a timeout or a
failure kills runc together with CRIU and anything they forked, and reaps
them (:mod:`crabd.util.proctree`).  A restore's time limit grows with its
images (:meth:`Runc.restore_timeout`): a 1 GiB restore takes 1-2 s here, so
the default of 30 s plus 10 s per GiB leaves a wide margin and still ends a
hung CRIU in well under a minute.

Failures become :class:`~crabd.errors.ContainerRuntimeError`; a failed
checkpoint or restore (CRIU's domain) becomes
:class:`~crabd.errors.CriuError` with CRIU's log kept and quoted, the same
way the Docker path reports it (:mod:`crabd.backends.criu.runc`).
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from crabd.backends.criu.runc import DUMP_OPTIONS, checkpoint_argv, keep_log, log_excerpt
from crabd.backends.runc.bundle import Bundle
from crabd.backends.runc.statefile import StateFiles, Unreadable
from crabd.errors import CommandError, CommandTimeout, ContainerRuntimeError, CriuError
from crabd.util import proc
from crabd.util.private_dirs import private_dir

log = logging.getLogger("crabd.runc")


def criu_own_seconds(restore_log: Path) -> float | None:
    """CRIU's own time in a restore: the timestamp of its log's last line ("(00.123456) ..."); None if unreadable.

    CRIU stamps every line with the seconds since it started, so the last
    one is what a bare ``criu restore`` of the same images took; the rest of
    ``runc restore`` is runc's own work (cgroups, mounts, the detached start).
    """
    try:
        last = restore_log.read_text(errors="replace").strip().splitlines()[-1]
        return float(last[1 : last.index(")")])
    except (OSError, IndexError, ValueError):
        return None


def image_bytes(images_dir: Path) -> int:
    """Bytes of the files directly in ``images_dir`` (CRIU's image set is flat); 0 if unreadable."""
    total = 0
    try:
        with os.scandir(images_dir) as entries:
            for e in entries:
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
    except OSError:
        return total
    return total


GIB = 1 << 30
DEFAULT_STATE_ROOT = Path("/run/crab/runc")
DEFAULT_LOG_DIR = Path("/var/log/crab/criu")

#: runc's option for a network namespace that CRIU makes empty (docs/runc.md, "User namespaces").
EMPTY_NETNS = ("--empty-ns", "network")

#: ``runc list`` runs that may race a deletion before the state files are read instead.
LIST_TRIES = 2
_ID_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class RuncStatus(StrEnum):
    """A container's status as runc reports it."""

    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"


@dataclass(frozen=True)
class RuncState:
    """``runc state`` (or one entry of ``runc list``), typed."""

    id: str
    pid: int
    status: RuncStatus
    bundle: Path
    rootfs: str = ""
    created: str = ""
    annotations: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, data: dict[str, Any]) -> RuncState:
        try:
            return cls(
                id=str(data["id"]),
                pid=int(data.get("pid") or 0),
                status=RuncStatus(str(data["status"])),
                bundle=Path(str(data.get("bundle") or "")),
                rootfs=str(data.get("rootfs") or ""),
                created=str(data.get("created") or ""),
                annotations={str(k): str(v) for k, v in (data.get("annotations") or {}).items()},
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ContainerRuntimeError(f"runc reported a malformed state: {exc}: {data!r:.300}", container="") from exc


@dataclass(frozen=True)
class CheckpointOptions:
    """What CRIU is told beyond the image and work paths (defaults: the Docker path's)."""

    leave_running: bool = True
    #: Passed as is: DUMP_OPTIONS is --tcp-established --file-locks.
    criu_options: tuple[str, ...] = DUMP_OPTIONS
    #: Unix sockets connected to peers outside the sandbox are dumped as external.
    ext_unix_sk: bool = False
    #: "soft", "full", "strict" or "ignore" (runc's default when None: soft).
    manage_cgroups_mode: str | None = None
    #: ``--empty-ns network``: the network namespace is made empty, its contents neither dumped nor restored.
    #: A user-namespaced container's netns is runc's own; crabd configures the new one after a restore.
    empty_ns_network: bool = False
    #: Restore only: memory pages are served on first touch by a ``criu lazy-pages`` daemon already
    #: listening in the restore's work dir (backends/criu/lazypages.py).
    lazy_pages: bool = False

    def argv(self) -> tuple[str, ...]:
        extra = list(self.criu_options)
        if self.lazy_pages:
            extra.append("--lazy-pages")
        if self.ext_unix_sk:
            extra.append("--ext-unix-sk")
        if self.manage_cgroups_mode:
            extra += ["--manage-cgroups-mode", self.manage_cgroups_mode]
        if self.empty_ns_network:
            extra += list(EMPTY_NETNS)
        return tuple(extra)


def _check_id(container_id: str) -> str:
    if not _ID_OK.fullmatch(container_id):
        raise ContainerRuntimeError(f"not a valid container id: {container_id!r}", container=container_id)
    return container_id


def _log_errors(log: Path, offset: int) -> str:
    """The error messages runc wrote to its JSON log after ``offset``."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    msgs = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            msgs.append(line)
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "fatal"):
            msgs.append(str(entry.get("msg", "")))
    return "\n".join(msgs)


def _criu_log(text: str) -> Path | None:
    """The CRIU log runc names in an error ("log file: <path>")."""
    found = re.search(r"log file: (\S+\.log)", text)
    return Path(found.group(1)) if found else None


class Runc:
    """runc with its own state root.  Blocking calls; callers offload them."""

    def __init__(
        self,
        root: Path = DEFAULT_STATE_ROOT,
        *,
        binary: str = "runc",
        timeout_s: float = 60.0,
        criu_timeout_s: float = 300.0,
        restore_timeout_s: float = 30.0,
        restore_s_per_gib: float = 10.0,
        log_dir: Path = DEFAULT_LOG_DIR,
    ) -> None:
        self.root = root
        self.binary = binary
        self.timeout_s = timeout_s
        self.criu_timeout_s = criu_timeout_s
        self.restore_timeout_s = restore_timeout_s
        self.restore_s_per_gib = restore_s_per_gib
        self.log_dir = log_dir
        self.files = StateFiles(root)

    def version(self) -> str:
        """runc's version ("1.1.5+ds1"), from the first line of ``runc --version``."""
        try:
            out = proc.run([self.binary, "--version"], timeout=self.timeout_s).out
        except CommandError as exc:
            raise ContainerRuntimeError(f"runc --version: {exc.stderr or exc.message}", container="") from exc
        first = out.splitlines()[0] if out else ""
        return first.removeprefix("runc version").strip() or "?"

    def _argv(self, *args: str) -> list[str]:
        return [self.binary, "--root", str(self.root), *args]

    def _run(self, container_id: str, *args: str, timeout: float | None = None) -> proc.Completed:
        try:
            return proc.run(self._argv(*args), timeout=timeout or self.timeout_s)
        except CommandError as exc:
            raise ContainerRuntimeError(
                f"runc {args[0]} {container_id}: {exc.stderr or exc.message}", container=container_id
            ) from exc

    def _detached(self, container_id: str, bundle: Bundle, *args: str, timeout: float) -> str:
        """Run a call whose container outlives it (module docstring); return runc's logged errors if it failed."""
        private_dir(self.root)  # runc's state, named by container ids: root only
        log = bundle.log_path
        offset = log.stat().st_size if log.exists() else 0
        argv = [self.binary, "--root", str(self.root), "--log", str(log), "--log-format", "json", *args]
        try:
            done = proc.run(argv, timeout=timeout, check=False, capture=False, kill_tree=True)
        except CommandTimeout:
            # Killed with its whole tree by proc.run; the caller tears the container down.
            return f"runc did not finish within {timeout:.1f} s and was killed, with CRIU and all they started"
        except CommandError as exc:  # runc missing
            raise ContainerRuntimeError(
                f"runc {args[0]} {container_id}: {exc.message}", container=container_id
            ) from exc
        if done.exit_code == 0:
            return ""
        return _log_errors(log, offset) or f"runc exited with {done.exit_code} (no message in {log})"

    # --- life cycle ------------------------------------------------------------

    def _launch(self, command: tuple[str, ...], container_id: str, bundle: Bundle) -> None:
        args = (*command, "--bundle", str(bundle.path), _check_id(container_id))
        err = self._detached(container_id, bundle, *args, timeout=self.timeout_s)
        if err:
            raise ContainerRuntimeError(f"runc {command[0]} {container_id}: {err}", container=container_id)

    def create(self, container_id: str, bundle: Bundle) -> None:
        """``runc create``: namespaces, mounts and cgroup made; init waits for :meth:`start`."""
        self._launch(("create",), container_id, bundle)

    def start(self, container_id: str) -> None:
        self._run(container_id, "start", _check_id(container_id))

    def run_detached(self, container_id: str, bundle: Bundle) -> None:
        """``runc run -d``: create and start in one call."""
        self._launch(("run", "--detach"), container_id, bundle)

    def state(self, container_id: str) -> RuncState | None:
        """The container's state; None if runc does not know it.  From runc's files, else from ``runc state``."""
        cid = _check_id(container_id)
        try:
            rec = self.files.record(cid)
            if rec is None:
                if (self.root / cid).exists():
                    raise Unreadable(f"{self.root / cid} has no state file")
                return None
            status = RuncStatus(self.files.status(cid, rec))
        except Unreadable as exc:
            log.debug("runc's state files unreadable; asking runc", extra={"container": cid, "why": str(exc)})
            return self.state_by_runc(cid)
        return RuncState(
            id=rec.id,
            pid=0 if status is RuncStatus.STOPPED else rec.pid,  # as `runc state` says it
            status=status,
            bundle=Path(rec.bundle),
            rootfs=rec.rootfs,
            created=rec.created,
            annotations=dict(rec.annotations),
        )

    def state_by_runc(self, container_id: str) -> RuncState | None:
        """``runc state``: the container's state as runc itself reports it; None if runc does not know it."""
        done = proc.run(self._argv("state", _check_id(container_id)), timeout=self.timeout_s, check=False)
        if done.exit_code != 0:
            if "does not exist" in done.err or "not exist" in done.err:
                return None
            raise ContainerRuntimeError(f"runc state {container_id}: {done.err.strip()}", container=container_id)
        return RuncState.parse(_json(done.out, container_id))

    def list(self, prefix: str = "") -> list[RuncState]:
        """Every container under this state root whose id starts with ``prefix``.

        ``runc list`` first: one Go process reads a thousand state files in
        ~0.9 s, where parsing them here took 5.3 s (each state.json holds the
        whole config).  But it fails as a whole ("load container X: container
        does not exist") when any container is deleted while it reads, and
        crabd deletes containers in the background (a restore's old one)
        while it lists; so it is asked again, and if that races too, this
        reads the state files of the ``prefix`` ids itself, where a container
        that goes away is simply not listed.
        """
        if not self.root.is_dir():
            return []
        for _ in range(LIST_TRIES):
            try:
                data = _json(self._run("", "list", "--format", "json").out, "")
            except ContainerRuntimeError as exc:
                if "not exist" not in exc.message and "no such file" not in exc.message:
                    raise
                continue
            return [st for st in (RuncState.parse(d) for d in (data or [])) if st.id.startswith(prefix)]
        return self._list_from_files(prefix)

    def _list_from_files(self, prefix: str) -> builtins.list[RuncState]:
        """:meth:`list` from the state files, each read as :meth:`state` reads it."""
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if not name.startswith(prefix) or not _ID_OK.fullmatch(name):
                continue  # another instance's, or not a container directory runc would make
            st = self.state(name)
            if st is not None:
                out.append(st)
        return out

    def kill(self, container_id: str, signal: str = "KILL", *, all_processes: bool = False) -> None:
        args = ["kill", *(["--all"] if all_processes else []), _check_id(container_id), signal]
        self._run(container_id, *args)

    def delete(self, container_id: str) -> bool:
        """``runc delete --force`` (kills what runs); False if runc did not know the container."""
        # runc 1.1 exits 0 for an unknown id with --force: ask first.
        if self.state(container_id) is None:
            return False
        done = proc.run(self._argv("delete", "--force", _check_id(container_id)), timeout=self.timeout_s, check=False)
        if done.exit_code == 0:
            return True
        if "does not exist" in done.err or "not exist" in done.err:
            return False
        raise ContainerRuntimeError(f"runc delete {container_id}: {done.err.strip()}", container=container_id)

    def pause(self, container_id: str) -> None:
        self._run(container_id, "pause", _check_id(container_id))

    def resume(self, container_id: str) -> None:
        self._run(container_id, "resume", _check_id(container_id))

    # --- checkpoint and restore ----------------------------------------------------

    def checkpoint(
        self, container_id: str, images_dir: Path, work_dir: Path, options: CheckpointOptions | None = None
    ) -> None:
        """``runc checkpoint`` into ``images_dir`` (a plain directory: never a tarball)."""
        opts = options or CheckpointOptions()
        argv = checkpoint_argv(
            self.binary,
            self.root,
            _check_id(container_id),
            images_dir,
            work_dir,
            leave_running=opts.leave_running,
            options=opts.argv(),
        )
        images_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            proc.run(argv, timeout=self.criu_timeout_s, kill_tree=True)
        except CommandError as exc:
            raise self._criu_error(container_id, "dump", work_dir / "dump.log", exc.stderr or exc.message) from exc

    def restore(
        self,
        container_id: str,
        bundle: Bundle,
        images_dir: Path,
        work_dir: Path,
        options: CheckpointOptions | None = None,
    ) -> RuncState:
        """``runc restore -d`` of ``images_dir`` as a new container ``container_id`` of ``bundle``.

        ``images_dir`` is only read: several restores may run from one image
        directory at once, each with its own ``work_dir`` and bundle.
        """
        opts = options or CheckpointOptions()
        work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        timeout = self.restore_timeout(image_bytes(images_dir))
        args = ["restore", "--detach", "--image-path", str(images_dir), "--work-path", str(work_dir)]
        args += ["--bundle", str(bundle.path), *opts.argv(), _check_id(container_id)]
        err = self._detached(container_id, bundle, *args, timeout=timeout)
        if err:
            raise self._criu_error(container_id, "restore", _criu_log(err) or work_dir / "restore.log", err)
        st = self.state(container_id)
        if st is None or st.status is not RuncStatus.RUNNING:
            raise ContainerRuntimeError(
                f"runc restore {container_id}: the container is {st.status if st else 'gone'} after restore",
                container=container_id,
            )
        # The physical reference for restore times (bench/processes.py reads it from crabd's log).
        log.info(
            "criu restored", extra={"container": container_id, "criu_s": criu_own_seconds(work_dir / "restore.log")}
        )
        return st

    def restore_timeout(self, nbytes: int) -> float:
        """Seconds a restore of ``nbytes`` of process images may take: the base plus so much per GiB."""
        return self.restore_timeout_s + self.restore_s_per_gib * nbytes / GIB

    def _criu_error(self, container_id: str, what: str, log: Path, text: str) -> CriuError:
        kept = keep_log(log, self.log_dir, container_id, what)
        excerpt = log_excerpt(kept) if kept else ""
        return CriuError(
            f"CRIU could not {what} container {container_id}: {text.strip()}" + (f"\n{excerpt}" if excerpt else ""),
            log_path=str(kept) if kept else None,
            log_excerpt=excerpt,
        )


def _json(text: str, container_id: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ContainerRuntimeError(f"runc printed no JSON: {text[:200]!r}", container=container_id) from exc
