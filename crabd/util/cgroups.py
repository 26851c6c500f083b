"""Finding a sandbox container's cgroup and its processes on the host.

Two engines put sandboxes in cgroups, each under its own parent, in every
hierarchy:

* Docker: ``docker/<id>`` (cgroupfs driver) or
  ``system.slice/docker-<id>.scope`` (systemd driver);
* crab's runc layer: ``crab/<id>`` (the bundle's ``cgroupsPath``,
  ``crabd/backends/runc/bundle.py`` ``CGROUP_PARENT``).

The ids cannot collide (Docker's are 64 hex digits, crab's runc ids are
``<instance>-<sandbox>-<generation>``), so a lookup tries both.  On this
host's hybrid layout the v1 controllers are ``/sys/fs/cgroup/<controller>``
and the v2 tree is mounted at ``unified``; runc 1.1 puts its containers in
the unified tree too (``unified/crab/<id>``, checked on this host), and BPF's
``bpf_get_current_cgroup_id()`` is the inode of that v2 directory.
Processes in child cgroups of the container belong to it too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from pathlib import Path

from crabd.util import proctree

CGROUP_ROOT = Path("/sys/fs/cgroup")

#: The parent cgroups of sandbox containers (Docker's cgroupfs driver, crab's runc layer).
PARENTS = ("docker", "crab")


def is_docker_id(container_id: str) -> bool:
    """Docker's ids are 64 hex digits; crab's runc ids are ``<instance>-<sandbox>-<generation>``."""
    return len(container_id) == 64 and all(c in "0123456789abcdef" for c in container_id)


def _v2_candidates(container_id: str, root: Path) -> list[Path]:
    out = [root / "unified" / parent / container_id for parent in PARENTS]  # hybrid layout
    out += [root / parent / container_id for parent in PARENTS]  # pure v2
    out.append(root / "system.slice" / f"docker-{container_id}.scope")  # Docker's systemd driver
    return out


def v2_dir(container_id: str, root: Path = CGROUP_ROOT) -> Path | None:
    """The container's cgroup v2 directory; None if there is none."""
    for base in _v2_candidates(container_id, root):
        if (base / "cgroup.procs").exists():
            return base
    return None


def v1_dir(container_id: str, controller: str, root: Path = CGROUP_ROOT) -> Path | None:
    """The container's directory in the v1 hierarchy of ``controller`` (e.g. ``freezer``); None if none."""
    for parent in PARENTS:
        base = root / controller / parent / container_id
        if (base / "cgroup.procs").exists():
            return base
    return None


def container_cgroup(container_id: str, root: Path = CGROUP_ROOT) -> Path | None:
    """The container's cgroup v2 directory (or v1 freezer's, as a fallback)."""
    return v2_dir(container_id, root) or v1_dir(container_id, "freezer", root)


def cgroup_id(container_id: str, root: Path = CGROUP_ROOT) -> int | None:
    """The cgroup v2 id of the container (the inode of its directory), as BPF's helpers report it."""
    base = v2_dir(container_id, root)
    return base.stat().st_ino if base is not None else None


#: Where each container's cgroup was found (a container keeps its cgroup for life; a container id
#: is never reused), so that a turn end does not probe every candidate path again.
_cgroup_dirs: dict[tuple[str, Path], str] = {}
_cgroup_dirs_lock = threading.Lock()
_CGROUP_DIRS_KEPT = 4096


def container_host_pids(container_id: str, root: Path = CGROUP_ROOT) -> list[int]:
    """Host pids of every process in the container's cgroup and its children.

    Walked with scandir and plain opens: every turn end reads this, and
    pathlib's rglob cost ~0.1 ms on a cgroup with no children at all.
    cgroupfs has no symlinks; a child cgroup removed meanwhile is skipped.
    """
    base = _cgroup_dirs.get((container_id, root))
    if base is None or not os.path.isdir(base):
        found = container_cgroup(container_id, root)
        if found is None:
            _cgroup_dirs.pop((container_id, root), None)
            return []
        base = str(found)
        with _cgroup_dirs_lock:
            _cgroup_dirs[(container_id, root)] = base
            if len(_cgroup_dirs) > _CGROUP_DIRS_KEPT:
                _cgroup_dirs.pop(next(iter(_cgroup_dirs)))
    out: set[int] = set()
    stack = [base]
    while stack:
        where = stack.pop()
        try:
            with open(os.path.join(where, "cgroup.procs"), "rb") as f:
                out.update(int(x) for x in f.read().split())
            with os.scandir(where) as entries:
                stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
        except (OSError, ValueError):
            continue
    return sorted(out)


def _counter(path: Path, key: str) -> int | None:
    """The value of the ``key N`` line of a flat-keyed cgroup file; None if unreadable or absent."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def oom_kills(container_id: str, root: Path = CGROUP_ROOT) -> int:
    """How many processes the kernel's OOM killer killed in the container's memory cgroup (0 if unknown).

    v1: ``memory.oom_control``'s ``oom_kill`` counter; v2: ``memory.events``'.
    Both count for the cgroup's whole life, and stay readable after its
    processes exited, until the cgroup is removed.
    """
    base = v1_dir(container_id, "memory", root)
    if base is not None:
        found = _counter(base / "memory.oom_control", "oom_kill")
        if found is not None:
            return found
    base = v2_dir(container_id, root)
    if base is not None:
        found = _counter(base / "memory.events", "oom_kill")
        if found is not None:
            return found
    return 0


def ns_pid(host_pid: int) -> tuple[int, str]:
    """(pid inside the container's pid namespace, command name) of a host pid; (0, "") if gone."""
    try:
        with open(f"/proc/{host_pid}/status", encoding="utf-8", errors="replace") as f:
            status = f.read()
    except OSError:
        return 0, ""
    name, nspid = "?", host_pid
    for row in status.splitlines():
        if row.startswith("Name:"):
            parts = row.split(None, 1)
            name = parts[1] if len(parts) > 1 else "?"
        elif row.startswith("NSpid:"):
            nspid = int(row.split()[-1])
    return nspid, name


def init_pid(container_id: str, root: Path = CGROUP_ROOT) -> int | None:
    """The host pid of the container's PID 1 (crab-init), whichever engine made it; None if it has none."""
    for pid in container_host_pids(container_id, root):
        if ns_pid(pid)[0] == 1:
            return pid
    return None


def kill_init(container_id: str, root: Path = CGROUP_ROOT) -> bool:
    """SIGKILL the container's PID 1 from the host (the kernel then kills its whole pid namespace).

    What ``docker kill`` does, for either engine: a crash of the sandbox as
    crabd would meet it (the demo, the harness's faults, tests).  False if
    the container has no live init.
    """
    pid = init_pid(container_id, root)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


#: How long :func:`kill_all` retries removing a cgroup its killed tasks are still leaving.
RMDIR_WAIT_S = 2.0


def container_dirs(container_id: str, parent: str = "crab", root: Path = CGROUP_ROOT) -> list[Path]:
    """The container's cgroup directories under ``parent`` in every hierarchy (v1, named, v2), deepest first.

    Called at every removal, so it is cheap: one stat per hierarchy, and a
    ``scandir`` walk of the container's own directories only.
    """
    try:
        hierarchies = sorted(root.iterdir())
    except OSError:
        return []
    seen: set[tuple[int, int]] = set()
    found: list[Path] = []
    for hierarchy in hierarchies:
        try:
            st = os.stat(hierarchy)  # follows a link: cpu and cpuacct may be one hierarchy under two names
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        base = hierarchy / parent / container_id
        if base.is_dir():
            found.extend(_dirs_below(base))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _dirs_below(base: Path) -> list[Path]:
    """``base`` and every directory below it (cgroup file systems hold no links to follow)."""
    out = [base]
    i = 0
    while i < len(out):
        with contextlib.suppress(OSError), os.scandir(out[i]) as entries:
            out.extend(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))
        i += 1
    return out


def _set_freezer(base: Path, state: str) -> None:
    """Write ``state`` to the freezer of ``base`` if it has one (never creates the file)."""
    with contextlib.suppress(OSError):
        fd = os.open(base / "freezer.state", os.O_WRONLY)
        try:
            os.write(fd, state.encode())
        finally:
            os.close(fd)


def kill_all(container_id: str, parent: str = "crab", root: Path = CGROUP_ROOT, *, remove: bool = True) -> list[str]:
    """SIGKILL every process left in the container's cgroups, reap crabd's own among them, remove the cgroups.

    For what a failed or killed ``runc create``/``restore`` leaves when runc
    no longer knows the container (so ``runc delete --force`` does nothing):
    restored tasks, the init, and the cgroup directories in every hierarchy.
    The v1 freezer is set FROZEN while the pids are read (nothing forks in
    between) and THAWED before the wait: a v1-frozen task does not act on
    SIGKILL.  ``remove=False`` leaves the (emptied) directories to runc.
    Returns what could not be done (an empty list: nothing left).
    """
    dirs = container_dirs(container_id, parent, root)
    if not dirs:
        return []
    freezer = root / "freezer" / parent / container_id
    errors: list[str] = []
    for _ in range(3):
        _set_freezer(freezer, "FROZEN")
        pids: set[int] = set()
        for d in dirs:
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        alive = proctree.kill_pids(sorted(pids), before_wait=lambda: _set_freezer(freezer, "THAWED"))
        if not pids:
            break
        if alive:
            errors = [f"{container_id}: pids {sorted(alive)} did not exit after SIGKILL"]
    _set_freezer(freezer, "THAWED")
    if not remove:
        return errors
    deadline = time.monotonic() + RMDIR_WAIT_S
    for d in dirs:
        while True:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                    errors.append(f"{container_id}: cannot remove cgroup {d}: {exc.strerror}")
                    break
                time.sleep(0.02)
    return errors
