"""A container's state from runc's own files, without running runc: no subprocess per status lookup (issue 34).

What ``runc state <id>`` prints, worked out the way runc works it out
(libcontainer's ``refreshState``), from:

    <root>/<id>/state.json   runc's record, in crab's own runc root (root's, 0700; nothing
                             a sandbox writes): ``id``, ``init_process_pid``,
                             ``init_process_start`` (the init's start time in clock ticks,
                             field 22 of /proc/<pid>/stat), ``created`` (RFC 3339),
                             ``config.labels`` ("bundle=<path>", and "key=value" for each
                             OCI annotation), ``config.rootfs``, ``cgroup_paths``
                             ({controller: dir}; "" is the unified hierarchy)
    <root>/<id>/exec.fifo    there between ``runc create`` and ``runc start``
    /proc/<pid>/stat         the init: gone, a zombie, or another process under its pid
                             (another start time) -> stopped
    the freezer              frozen -> paused (v1 ``freezer.state``, v2 ``cgroup.freeze``)

The status is decided in runc's order: paused, else stopped (no init),
else created (the fifo), else running.  The record's parsed fields are
cached by the file's (mtime, size, inode): runc replaces it whole on every
change.  The format is runc's, not a promise: whatever this module cannot
read or does not recognise raises :class:`Unreadable`, and the caller asks
``runc state`` instead (:meth:`~.cli.Runc.state`).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
EXEC_FIFO = "exec.fifo"
#: runc's label that names the bundle; every other "key=value" label is an OCI annotation.
BUNDLE_LABEL = "bundle"
#: Bigger than any state.json crab's bundles make (a few KiB): a larger one is not read.
MAX_STATE_BYTES = 4 << 20


class Unreadable(Exception):
    """The state files are not what this module knows: ask ``runc state``."""


@dataclass(frozen=True)
class Record:
    """The parts of state.json a status needs (they change only when runc rewrites the file)."""

    id: str
    pid: int
    start: int
    created: str
    bundle: str
    rootfs: str
    annotations: dict[str, str]
    freezer: Path | None
    unified: bool


def parse_record(data: Any) -> Record:
    """The :class:`Record` of a decoded state.json; :class:`Unreadable` if a field is missing or mistyped."""
    try:
        cfg = data["config"]
        labels = [str(x) for x in cfg.get("labels") or ()]
        pairs = dict(label.split("=", 1) for label in labels if "=" in label)
        paths = {str(k): str(v) for k, v in (data.get("cgroup_paths") or {}).items()}
        unified = "" in paths and "freezer" not in paths
        freezer = paths.get("freezer") or paths.get("")
        return Record(
            id=str(data["id"]),
            pid=int(data["init_process_pid"]),
            start=int(data["init_process_start"]),
            created=str(data.get("created") or ""),
            bundle=pairs.pop(BUNDLE_LABEL, ""),
            rootfs=str(cfg.get("rootfs") or ""),
            annotations=pairs,
            freezer=Path(freezer) if freezer else None,
            unified=unified,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise Unreadable(f"state.json: {exc!r}") from exc


def proc_start(pid: int) -> tuple[int, str] | None:
    """(start time in ticks, state letter) of host ``pid``; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:
        raise Unreadable(f"/proc/{pid}/stat: {exc}") from exc
    return parse_stat(raw, pid)


def parse_stat(raw: bytes, pid: int = 0) -> tuple[int, str]:
    """(start time, state letter) from the text of /proc/<pid>/stat."""
    # The command name may hold anything, ")" and spaces too: the fields start after its LAST ")".
    try:
        rest = raw[raw.rindex(b")") + 2 :].split()
        return int(rest[19]), rest[0].decode()
    except (IndexError, ValueError) as exc:
        raise Unreadable(f"/proc/{pid}/stat: {raw[:200]!r}") from exc


def init_running(pid: int, start: int) -> bool:
    """Whether host ``pid`` is still the init runc recorded (same start time), neither a zombie nor dead."""
    init = proc_start(pid) if pid > 0 else None
    return init is not None and init[0] == start and init[1] not in ("Z", "X", "x")


def open_state(root: Path, container_id: str) -> int:
    """A descriptor of the container's state.json, opened without following a link.

    FileNotFoundError if runc has no such container; Unreadable for any other failure.
    """
    path = root / container_id / STATE_FILE
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise Unreadable(f"{path}: {exc}") from exc


def decode_state(fd: int, path: Path) -> Any:
    """The JSON of the state.json open at ``fd``, never read past MAX_STATE_BYTES; Unreadable if larger or not JSON."""
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_STATE_BYTES + 1)
        if len(raw) > MAX_STATE_BYTES:
            raise Unreadable(f"{path}: more than {MAX_STATE_BYTES} bytes")
        return json.loads(raw)
    except ValueError as exc:
        raise Unreadable(f"{path}: {exc}") from exc


def frozen(rec: Record) -> bool:
    """Whether the container's cgroup is frozen, as runc's ``isPaused`` asks."""
    if rec.freezer is None:
        return False
    name = "cgroup.freeze" if rec.unified else "freezer.state"
    try:
        text = (rec.freezer / name).read_text().strip()
    except FileNotFoundError:
        return False  # the cgroup is gone with its processes: stopped, not paused
    except OSError as exc:
        raise Unreadable(f"{rec.freezer / name}: {exc}") from exc
    return text == "1" if rec.unified else text == "FROZEN"


class StateFiles:
    """Reads containers' states under one runc root; thread-safe."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[int, int, int], Record]] = {}

    def record(self, container_id: str) -> Record | None:
        """The container's parsed state.json (cached by the file's identity); None if runc has no such container."""
        path = self.root / container_id / STATE_FILE
        try:
            fd = open_state(self.root, container_id)
        except FileNotFoundError:
            with self._lock:
                self._cache.pop(container_id, None)
            return None
        try:
            st = os.fstat(fd)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            with self._lock:
                hit = self._cache.get(container_id)
            if hit is not None and hit[0] == key:
                return hit[1]
            data = decode_state(fd, path)
        finally:
            os.close(fd)
        rec = parse_record(data)
        if rec.id != container_id:
            raise Unreadable(f"{path} names container {rec.id!r}")
        with self._lock:
            self._cache[container_id] = (key, rec)
        return rec

    def status(self, container_id: str, rec: Record) -> str:
        """ "paused", "stopped", "created" or "running": runc's words, in runc's order."""
        if frozen(rec):
            return "paused"
        if not init_running(rec.pid, rec.start):
            return "stopped"
        if os.path.lexists(self.root / container_id / EXEC_FIFO):
            return "created"
        return "running"

    def forget(self, container_id: str) -> None:
        with self._lock:
            self._cache.pop(container_id, None)
