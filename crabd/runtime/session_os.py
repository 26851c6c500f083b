"""The session bash's own process state, read by crabd on the host: resource limits and open descriptors.

The semantic capture (``session_state.py``) runs inside bash and cannot
see what the kernel holds for the process, so crabd reads it through the
bash's host pid, right after each capture while the session is idle (no
command running, so bash holds only its own descriptors: during a command
it also holds saved copies of redirected ones at fd 10 and up):

* ``/proc/<pid>/limits``: every resource limit, soft and hard;
* ``/proc/<pid>/fd/<n>`` (readlink only) and ``/proc/<pid>/fdinfo/<n>``:
  each open descriptor but 0-2, which are crab's own pipes to init, and
  ``initproto.CONTROL_FD``, the session's control channel (the session
  protocol needs them; bash holds no other descriptor of crab's
  when idle — "idle" meaning blocked reading fd 0, which crabd waits for
  by watching ``/proc/<pid>/syscall``).

With them, read last, whether the bash has run since the last reading
(``/proc/<pid>/stat``'s start time and ``task/*/schedstat``'s run time):
a turn end reuses the last capture when it has not (``coordinator/runner.py``).

The kernel writes these files, but the names in them are the sandbox's: a
file name may hold any byte, including newlines or " (deleted)".  They are
data to record, compare and show (escaped), never paths crabd opens or
follows.  Every read goes through one directory fd of ``/proc/<pid>``,
opened and then checked to be the sandbox's session (in the container's
cgroup, with the expected pid inside the sandbox): a pid reused meanwhile
gives ESRCH, never another process's data.

Stored in the session state (JSON; absent in captures older than this)::

    "limits": {"nofile": [soft, hard], ...}   # every name of RESOURCES; -1 = unlimited
    "fds": [{"fd": 7, "kind": "file", "target": "/work/f", "flags": 32769, "pos": 0}, ...]
        # kind: file | pipe | socket | anon | other | more (over MAX_FDS: target = how many more)
        # flags: fdinfo's (octal there, an int here), pos: the file offset

On restore (``restore``), limits are re-applied exactly with prlimit(2)
from crabd.  bash's own ``ulimit`` in the session cannot do that: raising a
hard limit back needs CAP_SYS_RESOURCE, which Docker does not grant, and
it counts several limits in KiB, so a byte value that is not a multiple of
1024 would be rounded.  A hard limit above the fresh bash's is never
granted, though — the container never allowed more, so a stored state
asking for it did not come from the sandbox — and is reported instead.
Descriptors are not re-created: a re-opened file would have another
offset, and pipes, sockets and eventfds cannot be re-opened at all; under
the "auto" policy a turn that changes them is checkpointed full, so CRIU's
image brings them back exactly (``coordinator/inspection.py``).  After a
restore the bash's actual limits and descriptors are read back and every
difference from the stored state is reported (``not_restored``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import threading
import time
from collections.abc import Iterator
from typing import Any

from crabd.errors import SessionProcessError
from crabd.runtime.initproto import CONTROL_FD
from crabd.util import cgroups

UNLIMITED = -1
#: Linux's RLIMIT_LOCKS (include/uapi/asm-generic/resource.h); Python's resource module lacks it.
RLIMIT_LOCKS = 10
#: (name in the state, row title in /proc/<pid>/limits, resource); every limit the kernel has.
RESOURCES: tuple[tuple[str, str, int], ...] = (
    ("cpu", "Max cpu time", resource.RLIMIT_CPU),
    ("fsize", "Max file size", resource.RLIMIT_FSIZE),
    ("data", "Max data size", resource.RLIMIT_DATA),
    ("stack", "Max stack size", resource.RLIMIT_STACK),
    ("core", "Max core file size", resource.RLIMIT_CORE),
    ("rss", "Max resident set", resource.RLIMIT_RSS),
    ("nproc", "Max processes", resource.RLIMIT_NPROC),
    ("nofile", "Max open files", resource.RLIMIT_NOFILE),
    ("memlock", "Max locked memory", resource.RLIMIT_MEMLOCK),
    ("as", "Max address space", resource.RLIMIT_AS),
    ("locks", "Max file locks", RLIMIT_LOCKS),
    ("sigpending", "Max pending signals", resource.RLIMIT_SIGPENDING),
    ("msgqueue", "Max msgqueue size", resource.RLIMIT_MSGQUEUE),
    ("nice", "Max nice priority", resource.RLIMIT_NICE),
    ("rtprio", "Max realtime priority", resource.RLIMIT_RTPRIO),
    ("rttime", "Max realtime timeout", resource.RLIMIT_RTTIME),
)
_BY_TITLE = {title: name for name, title, _ in RESOURCES}
_RLIMIT = {name: res for name, _, res in RESOURCES}
#: rlim_t is 64 bits; the kernel prints RLIM_INFINITY as "unlimited".
_RLIM_MAX = (1 << 64) - 1
#: Descriptors recorded per capture (the lowest numbers); more are counted in one "more" entry.
MAX_FDS = 256
#: Largest /proc text read (limits is ~1.3 KB, an fdinfo a few hundred bytes; epoll/inotify ones list more).
_READ_LIMIT = 1 << 16
_ACCMODE = 0o3
_O_APPEND = 0o2000

Limits = dict[str, list[int]]
Fds = list[dict[str, Any]]
#: (host pid, start time in ticks, CPU time in ns): two equal readings mean it did not run in between.
Ran = tuple[int, int, int]


# --- parsing (pure) ----------------------------------------------------------------------


def _limit_value(word: str) -> int | None:
    if word == "unlimited":
        return UNLIMITED
    if not word.isdigit() or len(word) > 20:
        return None
    value = int(word)
    return value if value < _RLIM_MAX else UNLIMITED


def parse_limits(text: str) -> Limits:
    """``/proc/<pid>/limits`` as {name: [soft, hard]}; unknown or malformed rows are left out.

    The kernel prints each row as the title left-aligned in 25 columns, then
    soft, hard and units (``fs/proc/base.c``, ``proc_pid_limits``).
    """
    out: Limits = {}
    for line in text.splitlines()[1:]:
        name = _BY_TITLE.get(line[:25].rstrip())
        fields = line[25:].split()
        if name is None or len(fields) < 2:
            continue
        soft, hard = _limit_value(fields[0]), _limit_value(fields[1])
        if soft is not None and hard is not None:
            out[name] = [soft, hard]
    return out


def parse_fdinfo(text: str) -> tuple[int, int]:
    """(pos, flags) from ``/proc/<pid>/fdinfo/<n>`` (flags are octal there); (0, 0) where missing."""
    pos = flags = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        with contextlib.suppress(ValueError):
            if key == "pos":
                pos = int(value)
            elif key == "flags":
                flags = int(value, 8)
    return pos, flags


def fd_kind(target: str) -> str:
    """What a ``/proc/<pid>/fd/<n>`` link names: file, pipe, socket, anon (eventfd, epoll, ...) or other."""
    if target.startswith("/"):
        return "file"
    for prefix, kind in (("pipe:[", "pipe"), ("socket:[", "socket"), ("anon_inode:", "anon")):
        if target.startswith(prefix):
            return kind
    return "other"


def _fd_key(entry: Any) -> tuple[object, ...] | None:
    """What must be equal for two descriptors to be the same state; None for a malformed entry.

    Pipes and sockets are compared by kind and flags only: their inode
    numbers change with every restore (CRIU makes new ones), which is not a
    change of the session.  A file's name, flags and offset all matter.
    """
    if not isinstance(entry, dict) or not isinstance(entry.get("fd"), int):
        return None
    kind = str(entry.get("kind", ""))
    target = str(entry.get("target", ""))
    ident = target if kind in ("file", "anon", "other", "more") else ""
    if kind == "anon":
        ident = target.split("]", 1)[0]  # anon_inode:[eventfd] — the type, not the instance
    pos = entry.get("pos", 0) if kind == "file" else 0
    return (entry["fd"], kind, ident, entry.get("flags", 0), pos)


def _fd_map(fds: Any) -> dict[int, tuple[object, ...]]:
    out: dict[int, tuple[object, ...]] = {}
    for entry in fds if isinstance(fds, list) else []:
        key = _fd_key(entry)
        if key is not None:
            out[int(entry["fd"])] = key
    return out


def _show(text: str) -> str:
    """A sandbox-controlled name for people and logs: quoted, every control or odd byte escaped."""
    return json.dumps(text, ensure_ascii=True)


def describe_fd(entry: dict[str, Any]) -> str:
    kind = str(entry.get("kind", "other"))
    if kind == "more":
        return f"{entry.get('target', '?')} more descriptors"
    flags = int(entry.get("flags", 0) or 0)
    mode = {0: "read-only", 1: "write-only", 2: "read-write"}.get(flags & _ACCMODE, "?")
    text = f"fd {entry.get('fd')}: {kind}"
    if kind in ("file", "anon", "other"):
        text += f" {_show(str(entry.get('target', '')))}"
    text += f", {mode}" + (", append" if flags & _O_APPEND else "")
    if kind == "file":
        text += f", offset {entry.get('pos', 0)}"
    return text


def _fmt(value: int) -> str:
    return "unlimited" if value == UNLIMITED else str(value)


def descriptors_changed(now_json: str | None, head_json: str | None) -> str:
    """Why the session's descriptors differ between two stored session states, or "".

    "" also when ``now_json`` has no record of them (nothing to compare).  A
    head without a record counts as holding none beyond 0-2, which is what a
    restore of it gives.
    """
    now, head = _fds_of(now_json), _fds_of(head_json)
    if now is None:
        return ""
    a, b = _fd_map(now), _fd_map(head or [])
    changed = sorted(fd for fd in set(a) | set(b) if a.get(fd) != b.get(fd))
    if not changed:
        return ""
    return "the session's open descriptors changed (fd " + ", ".join(map(str, changed[:8])) + ")"


def held_descriptors(state_json: str | None) -> list[int]:
    """The descriptor numbers (beyond 0-2) a stored session state records as open."""
    return sorted(_fd_map(_fds_of(state_json)))


def _fds_of(state_json: str | None) -> Fds | None:
    if not state_json:
        return None
    try:
        data = json.loads(state_json)
    except ValueError:
        return None
    fds = data.get("fds") if isinstance(data, dict) else None
    return fds if isinstance(fds, list) else None


def differences(limits: Any, fds: Any, got_limits: Limits, got_fds: Fds) -> list[str]:
    """What the session lacks of a stored state (``limits``, ``fds``; None: not recorded), for people."""
    out: list[str] = []
    if isinstance(limits, dict):
        for name, _, _ in RESOURCES:
            want, have = limits.get(name), got_limits.get(name)
            if isinstance(want, list) and want != have:
                now = "unknown" if have is None else f"{_fmt(have[0])}/{_fmt(have[1])}"
                out.append(f"limit {name} {_fmt(want[0])}/{_fmt(want[1])} (soft/hard): the session has {now}")
    if isinstance(fds, list):
        want_map, have_map = _fd_map(fds), _fd_map(got_fds)
        by_fd = {int(e["fd"]): e for e in fds if _fd_key(e) is not None}
        got_by_fd = {int(e["fd"]): e for e in got_fds}
        for fd in sorted(set(want_map) | set(have_map)):
            if want_map.get(fd) == have_map.get(fd):
                continue
            if fd in by_fd and fd not in have_map:
                out.append(f"{describe_fd(by_fd[fd])}: not re-opened (a files-only checkpoint cannot)")
            elif fd in by_fd:
                out.append(f"{describe_fd(by_fd[fd])}: the session has {describe_fd(got_by_fd[fd])} instead")
            else:
                out.append(f"{describe_fd(got_by_fd[fd])}: open in the session, but not in the checkpoint's")
    return out


# --- reading /proc (host) ----------------------------------------------------------------


def _read_at(dirfd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dirfd)
    try:
        return os.read(fd, _READ_LIMIT).decode("utf-8", "surrogateescape")
    finally:
        os.close(fd)


#: read(2)'s syscall number, by machine (what /proc/<pid>/syscall shows while bash waits for input).
_READ_NR = {"x86_64": 0, "aarch64": 63}
#: How long the session may take to finish the tail of crab's command framing and block on input.
IDLE_WAIT_S = 2.0


def _wait_idle(dirfd: int) -> None:
    """Until the bash blocks reading its stdin (fd 0): only then does it hold just its own descriptors.

    The done-markers reach crabd while bash is still undoing the framing's
    own ``>&2`` (its stdout saved at fd 10 for a moment; seen in about one
    read in five without this wait).  Under the session lock nobody writes
    to its stdin, so once blocked there it stays blocked.
    """
    nr = _READ_NR.get(os.uname().machine)
    if nr is None:
        return  # unknown syscall numbering: read at once (best effort)
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        try:
            fields = _read_at(dirfd, "syscall").split()
        except OSError as exc:
            raise SessionProcessError(f"the session's process is gone: {exc}", sandbox="") from exc
        if len(fields) > 1 and fields[0] == str(nr) and fields[1] == "0x0":
            return
        if time.monotonic() > deadline:
            raise SessionProcessError("the session's bash did not go idle (it runs something)", sandbox="")
        time.sleep(0.001)


def host_pid(container_id: str, nspid: int) -> int | None:
    """The host pid of the container's process that is ``nspid`` inside it, or None."""
    for hp in cgroups.container_host_pids(container_id):
        if cgroups.ns_pid(hp)[0] == nspid:
            return hp
    return None


#: Host pids of sessions found so far, by (container, pid inside): a hint, checked at every use.
_known: dict[tuple[str, int], int] = {}
_known_lock = threading.Lock()
_KNOWN_KEPT = 4096


def _open_checked(container_id: str, nspid: int, hp: int) -> int:
    """A dirfd of ``/proc/<hp>``, once checked through it to be the container's process ``nspid``."""
    try:
        dirfd = os.open(f"/proc/{hp}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise SessionProcessError(f"the session's process is gone: {exc}", sandbox="") from exc
    try:
        status, cgroup = _read_at(dirfd, "status"), _read_at(dirfd, "cgroup")
    except OSError as exc:
        os.close(dirfd)
        raise SessionProcessError(f"the session's process is gone: {exc}", sandbox="") from exc
    nspids = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
    if not nspids or nspids[-1] != str(nspid) or container_id not in cgroup:
        os.close(dirfd)
        raise SessionProcessError(f"pid {hp} is no longer the sandbox's session", sandbox="")
    return dirfd


@contextlib.contextmanager
def _proc_dir(container_id: str, nspid: int) -> Iterator[tuple[int, int]]:
    """(dirfd of /proc/<host pid>, host pid) of the sandbox's process ``nspid``, checked through the dirfd.

    The host pid found last time is tried first (every turn end reads the
    idle bash: a walk of the container's pids cost ~0.3 ms of it); the check
    through the dirfd is what makes it the right process, either way.
    """
    key = (container_id, nspid)
    hint, dirfd = _known.get(key), -1
    if hint is not None:
        with contextlib.suppress(SessionProcessError):
            dirfd, hp = _open_checked(container_id, nspid, hint), hint
    if dirfd < 0:
        found = host_pid(container_id, nspid) if nspid > 0 else None
        if found is None:
            raise SessionProcessError(f"the session (pid {nspid} in the sandbox) is not running", sandbox="")
        dirfd, hp = _open_checked(container_id, nspid, found), found
        with _known_lock:
            _known.pop(key, None)
            if len(_known) >= _KNOWN_KEPT:
                _known.pop(next(iter(_known)))
            _known[key] = hp
    try:
        yield dirfd, hp
    finally:
        os.close(dirfd)


def _read_fds(dirfd: int) -> Fds:
    fdd = os.open("fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        # 0-2 are crab's pipes to init and CONTROL_FD its control channel: crab's own, not the session's.
        numbers = sorted(int(n) for n in os.listdir(fdd) if n.isdigit() and int(n) > 2 and int(n) != CONTROL_FD)
        out: Fds = []
        for n in numbers[:MAX_FDS]:
            try:
                # readlink only: the link names the sandbox's file, which crabd never opens.
                target = os.readlink(str(n), dir_fd=fdd)
                pos, flags = parse_fdinfo(_read_at(dirfd, f"fdinfo/{n}"))
            except FileNotFoundError:
                continue  # closed meanwhile
            out.append({"fd": n, "kind": fd_kind(target), "target": target, "flags": flags, "pos": pos})
        if len(numbers) > MAX_FDS:
            out.append({"fd": -1, "kind": "more", "target": str(len(numbers) - MAX_FDS), "flags": 0, "pos": 0})
        return out
    finally:
        os.close(fdd)


def _read(dirfd: int) -> tuple[Limits, Fds]:
    _wait_idle(dirfd)
    try:
        return parse_limits(_read_at(dirfd, "limits")), _read_fds(dirfd)
    except OSError as exc:
        raise SessionProcessError(f"cannot read the session's process state: {exc}", sandbox="") from exc


def _ran(dirfd: int, hp: int) -> Ran:
    """(host pid, start time in clock ticks, CPU time of all its threads in ns) of the process now.

    Equal at two readings only if the process did not run at all in
    between: every time a thread is scheduled its schedstat run time grows.
    """
    try:
        stat = _read_at(dirfd, "stat")
        start = int(stat[stat.rindex(")") + 2 :].split()[19])
        taskd = os.open("task", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dirfd)
        try:
            runtime = 0
            for tid in os.listdir(taskd):
                runtime += int(_read_at(taskd, f"{tid}/schedstat").split()[0])
        finally:
            os.close(taskd)
    except (OSError, ValueError, IndexError) as exc:
        raise SessionProcessError(f"cannot read the session's process state: {exc}", sandbox="") from exc
    return hp, start, runtime


def capture(container_id: str, nspid: int) -> tuple[Limits, Fds, Ran]:
    """The limits and descriptors (beyond 0-2) of the sandbox's idle session bash, pid ``nspid``
    inside it; and, read last, whether it has run since (:func:`_ran`: compare two of these)."""
    with _proc_dir(container_id, nspid) as (dirfd, hp):
        limits, fds = _read(dirfd)
        return limits, fds, _ran(dirfd, hp)


def _wanted(limits: Any, have: Limits) -> dict[str, tuple[int, int]]:
    """The well-formed limits of a stored state that differ from the session's now."""
    out: dict[str, tuple[int, int]] = {}
    if not isinstance(limits, dict):
        return out
    for name, value in limits.items():
        ok = name in _RLIMIT and isinstance(value, list) and len(value) == 2
        if not ok or not all(isinstance(v, int) and UNLIMITED <= v < _RLIM_MAX for v in value):
            continue
        if have.get(name) != value:
            out[name] = (int(value[0]), int(value[1]))
    return out


def _above(a: int, b: int) -> bool:
    """Whether limit value ``a`` is larger than ``b`` (UNLIMITED is the largest)."""
    if a == b:
        return False
    return a == UNLIMITED or (b != UNLIMITED and a > b)


def restore(container_id: str, nspid: int, limits: Any, fds: Any) -> list[str]:
    """Give the sandbox's session bash the stored ``limits``; return what it lacks of ``limits`` and ``fds``."""
    with _proc_dir(container_id, nspid) as (dirfd, hp):
        have, _ = _read(dirfd)
        for name, (soft, hard) in _wanted(limits, have).items():
            current = have.get(name)
            if current is None or _above(hard, current[1]):
                continue  # never more than the container grants (reported below)
            try:
                resource.prlimit(hp, _RLIMIT[name], (soft, hard))
            except (OSError, ValueError) as exc:
                if isinstance(exc, OSError) and exc.errno == errno.ESRCH:
                    raise SessionProcessError("the session ended while its limits were set", sandbox="") from exc
                continue  # reported below
        # Read back through the same dirfd: it fails if the process is gone, so prlimit
        # above reached this process and no other that got its pid.
        got_limits, got_fds = _read(dirfd)
    return differences(limits, fds, got_limits, got_fds)
