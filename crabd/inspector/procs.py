"""A sandbox's processes, from /proc: exact, and cheap enough for every turn end.

For each process in the container's cgroups: its pid inside the sandbox,
start time (so a recycled pid is a different process), command line, the
CPU time of its threads from ``/proc/<pid>/task/<tid>/schedstat`` (ns; if it
grew, the process ran), its thread ids (a thread that came or went means it
ran), and what would make a process checkpoint unsound or impossible:
io_uring or AIO contexts (the kernel writes their memory without the
process running), a tracer, and writable shared mappings of files that do
not belong to the sandbox.  Also the regular files each process holds open
(and which for writing), so the inspector can tell when a turn changed a
file under a live process, and whether it has a shared mapping of a file that
it may write through (writes through a mapping make no syscall the probes
could see, so such a mapping alive at a turn end makes the next turn's files
suspect).

Everything is read through the host pid; paths are as the process sees them.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import blake3

from crabd.inspector.model import Proc
from crabd.util import cgroups

_ACCMODE = 0o3
_O_WRONLY, _O_RDWR = 0o1, 0o2
#: Paths inside a sandbox that are not its files (Docker bind mounts and kernel filesystems).
_NOT_SANDBOX_FILES = ("/proc/", "/sys/", "/dev/")


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _stat_start(host_pid: int) -> tuple[int, int, str]:
    """(ppid in the host namespace, start time in ticks, state letter) from /proc/<pid>/stat."""
    raw = _read(f"/proc/{host_pid}/stat")
    rest = raw[raw.rindex(")") + 2 :].split()
    return int(rest[1]), int(rest[19]), rest[0]


def _cmdline(host_pid: int, limit: int = 120) -> str:
    try:
        raw = Path(f"/proc/{host_pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _threads(host_pid: int) -> tuple[int, frozenset[int]]:
    total = 0
    tids = []
    for tid in os.listdir(f"/proc/{host_pid}/task"):
        try:
            total += int(_read(f"/proc/{host_pid}/task/{tid}/schedstat").split()[0])
            tids.append(int(tid))
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total, frozenset(tids)


def _fds(host_pid: int) -> tuple[bool, tuple[str, ...], tuple[str, ...], frozenset[str]]:
    """(has io_uring, regular files open for writing, regular files open, every "fd=target")."""
    uring = False
    writable: list[str] = []
    opened: list[str] = []
    table: list[str] = []
    base = f"/proc/{host_pid}/fd"
    for fd in os.listdir(base):
        try:
            target = os.readlink(f"{base}/{fd}")
        except OSError:
            continue
        table.append(f"{fd}={target}")
        if target == "anon_inode:[io_uring]":
            uring = True
        if not target.startswith("/") or target.endswith(" (deleted)") or target.startswith(_NOT_SANDBOX_FILES):
            continue
        opened.append(target)
        try:
            flags = int(
                next(
                    ln for ln in _read(f"/proc/{host_pid}/fdinfo/{fd}").splitlines() if ln.startswith("flags:")
                ).split()[1],
                8,
            )
        except (OSError, StopIteration, ValueError, IndexError):
            continue
        if flags & _ACCMODE in (_O_WRONLY, _O_RDWR):
            writable.append(target)
    return uring, tuple(sorted(set(writable))), tuple(sorted(set(opened))), frozenset(table)


def _maps(host_pid: int, devices: Callable[[], _Devices]) -> tuple[bool, str, tuple[str, ...], bool, bool]:
    """(has an AIO context, a foreign writable shared mapping or "", mapped regular files,
    has a shared mapping of a non-tmpfs file it may write through, has a shared mapping of a
    file on the sandbox's tmpfs mounts).  ``devices`` is asked only for a shared file mapping:
    most processes have none, and reading the mount table costs more than the rest of this."""
    aio = False
    tmpfs_shared = False
    foreign = ""
    mapped: list[str] = []
    may_write: list[str] = []  # address ranges of read-only shared file mappings
    writes = False
    for line in _read(f"/proc/{host_pid}/maps").splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        perms, dev, inode, path = parts[1], parts[3], parts[4], parts[5]
        if path.startswith("/[aio]"):
            aio = True
        if inode == "0":
            continue
        devs = devices() if "s" in perms else None
        if devs is not None and dev in devs.tmpfs:
            # Writes through it reach no probe: the tmpfs mounts are fingerprinted at every turn end.
            tmpfs_shared = True
        # SysV and /dev/zero shared memory is anonymous; tmpfs is fingerprinted (mounts.py).
        shared_file = devs is not None and dev not in devs.tmpfs and not path.startswith(("/dev/zero", "/SYSV"))
        if shared_file and "w" in perms:
            writes = True
        elif shared_file:
            may_write.append(parts[0])
        if not path.startswith("/"):
            continue
        if not path.startswith(_NOT_SANDBOX_FILES) and not path.endswith(" (deleted)"):
            mapped.append(path)
        if "w" in perms and devs is not None and dev not in devs.own and not path.startswith(("/dev/zero", "/SYSV")):
            foreign = foreign or path
    if may_write and not writes:
        writes = _may_write(host_pid, set(may_write))
    return aio, foreign, tuple(sorted(set(mapped))), writes, tmpfs_shared


def _may_write(host_pid: int, ranges: set[str]) -> bool:
    """Whether one of these read-only shared mappings may become writable (mprotect): VM_MAYWRITE, "mw"."""
    current = ""
    for line in _read(f"/proc/{host_pid}/smaps").splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            current = head
        elif head == "VmFlags:" and current in ranges and "mw" in line.split()[1:]:
            return True
    return False


class _Devices:
    """Devices (major:minor as /proc/<pid>/maps prints them) of the sandbox's filesystems."""

    def __init__(self, host_pid: int) -> None:
        self.own: set[str] = set()  # its root and its tmpfs-like mounts
        self.tmpfs: set[str] = set()
        for line in _read(f"/proc/{host_pid}/mountinfo").splitlines():
            parts = line.split()
            # mountinfo: id parent major:minor root mountpoint ... - fstype source options
            fstype = parts[parts.index("-") + 1] if "-" in parts else ""
            major, minor = parts[2].split(":")
            dev = f"{int(major):02x}:{int(minor):02x}"
            if fstype in ("tmpfs", "mqueue", "shm"):
                self.tmpfs.add(dev)
            if parts[4] == "/" or fstype in ("tmpfs", "mqueue", "devpts", "shm"):
                self.own.add(dev)


#: crab-init's command line under its keeper (user-namespaced runc sandboxes: crab-init.c, "PID 1 keeper").
KEPT_INIT_CMD = "/.crab/init --keeper"


def crab_init(now: dict[int, Proc]) -> int:
    """The pid of crab's init in the sandbox ``now``: PID 1, or under the keeper (PID 1) its first child.

    The keeper forks crab-init before anything else runs, and a restore
    forks PID 1's children in the order the kernel listed them (crab-init
    first), so crab-init is PID 1's child with that command line that started
    first (the lower pid on a tie of clock ticks).  Orphans come to PID 1 too,
    later; one that mimics the command line still is not the first.
    """
    first = 1
    if now.get(1) is not None and now[1].cmd == KEPT_INIT_CMD:
        kids = [p for p in now.values() if p.ppid == 1 and p.pid != 1 and p.cmd == KEPT_INIT_CMD]
        if kids:
            first = min(kids, key=lambda p: (p.start, p.pid)).pid
    return first


def _status(host_pid: int) -> tuple[int, bool]:
    """(pid in the sandbox's pid namespace, has a tracer), from one read of /proc/<pid>/status; (0, False): gone."""
    try:
        text = _read(f"/proc/{host_pid}/status")
    except OSError:
        return 0, False
    nspid, traced = host_pid, False
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            nspid = int(line.split()[-1])
        elif line.startswith("TracerPid:"):
            traced = line.split()[1] != "0"
    return nspid, traced


#: How many times a snapshot lists the cgroups again to find processes begun while it read.
SNAPSHOT_LISTINGS = 8


def snapshot(container_id: str, light: frozenset[int] | set[int] = frozenset()) -> dict[int, Proc]:
    """Every process of the container, by pid inside the sandbox.

    ``light`` pids (crab's init and the session's bash, which the decision
    does not count as processes) skip the costly parts: their tracer and the
    files they map.  Their fds are still read, and whether they may write
    through a shared mapping.

    Steps: list the cgroups' pids, read each process, list again; read any
    pid the new listing holds that was not read, until a listing brings no
    new pid.  One listing is not enough: a daemon's double fork can run
    while the processes are read, so that the pid listed exits before it is
    read and the grandchild that lives on was forked after the listing.
    Bounded (SNAPSHOT_LISTINGS): a sandbox that forks without end still
    shows new processes in what was read.
    """
    out: dict[int, Proc] = {}
    devs: list[_Devices] = []  # read once, at the first process with a shared file mapping

    def devices(hp: int) -> _Devices:
        if not devs:
            devs.append(_Devices(hp))
        return devs[0]

    seen: set[int] = set()
    ns_of: dict[int, int] = {}
    for _ in range(SNAPSHOT_LISTINGS):
        fresh = [hp for hp in cgroups.container_host_pids(container_id) if hp not in seen]
        if not fresh:
            break
        seen.update(fresh)
        _read_processes(fresh, ns_of, light, devices, out)
    return out


def _read_processes(
    host_pids: list[int],
    ns_of: dict[int, int],
    light: frozenset[int] | set[int],
    devices: Callable[[int], _Devices],
    out: dict[int, Proc],
) -> None:
    """Read each of ``host_pids`` into ``out`` (by pid in the sandbox); a process gone meanwhile is left out."""
    status = {hp: _status(hp) for hp in host_pids}
    ns_of.update((hp, st[0]) for hp, st in status.items())
    for hp in host_pids:
        pid, tracer = status[hp]
        if not pid:
            continue
        try:
            host_ppid, start, state = _stat_start(hp)
            if state in ("Z", "X"):
                continue  # exited, not yet reaped: nothing left to checkpoint
            runtime, tids = _threads(hp)
            io = io_counters(hp)
            uring, writable, opened, table = _fds(hp)
            # Every process's mappings are read, crab's init and the session's bash too: a bash
            # builtin loaded with `enable -f` could map a file and write through it.
            aio, foreign, mapped, writes_mapped, maps_tmpfs = _maps(hp, functools.partial(devices, hp))
            traced = tracer and pid not in light
            if pid in light:
                aio, foreign, mapped = False, "", ()
        except (OSError, ValueError):
            continue  # it ended while we looked: it is simply not there
        out[pid] = Proc(
            pid=pid,
            host_pid=hp,
            ppid=ns_of.get(host_ppid, 0),
            start=start,
            cmd=_cmdline(hp),
            runtime_ns=runtime,
            tids=tids,
            io=io,
            io_uring=uring,
            aio=aio,
            traced=traced,
            foreign_shared=foreign,
            writes_mapped=writes_mapped,
            maps_tmpfs=maps_tmpfs,
            writable_files=writable,
            open_files=tuple(sorted(set(opened) | set(mapped))),
            fds=table,
        )


def io_counters(host_pid: int) -> tuple[int, ...] | None:
    """The process's read/write counters (rchar, wchar, syscr, syscw), or None if it is gone.

    ``/proc/<pid>/io`` sums them over all its threads, dead ones included.
    They move with every completed read or write of any fd (file, pipe,
    socket), which is what sets a process's real work apart from a syscall
    merely restarted after a freeze: the interruption itself is counted at
    the freeze, before the dump, and a restarted call counts only when it
    completes.
    """
    try:
        fields = dict(ln.split(": ", 1) for ln in _read(f"/proc/{host_pid}/io").splitlines() if ": " in ln)
        return tuple(int(fields[k]) for k in ("rchar", "wchar", "syscr", "syscw"))
    except (OSError, KeyError, ValueError):
        return None


def runtime_ns(host_pid: int) -> int | None:
    """CPU time of the process's threads now (None if it is gone)."""
    try:
        return _threads(host_pid)[0]
    except OSError:
        return None


#: x86-64's red zone: a leaf function may keep live data this far below its stack pointer.
RED_ZONE = 128


def _stack_pointers(host_pid: int) -> list[int] | None:
    """Each thread's user stack pointer while it waits in the kernel, or None if one is running."""
    sps = []
    for tid in os.listdir(f"/proc/{host_pid}/task"):
        text = _read(f"/proc/{host_pid}/task/{tid}/syscall").split()
        if not text or text[0] == "running":
            return None
        sps.append(int(text[-2], 16))  # "<nr> <args...> <sp> <pc>", or "-1 <sp> <pc>"
    return sps


#: pagemap: one 64-bit entry per page; in its top byte, 0x80 present, 0x40 swapped
#: (``Documentation/admin-guide/mm/pagemap.rst``).
PAGE = os.sysconf("SC_PAGE_SIZE")
_PM_ENTRY = 8
#: Top byte of an entry -> b"1" when the page is present or swapped, else b"0".
_RESIDENT = bytes(b"1"[0] if b & 0xC0 else b"0"[0] for b in range(256))
#: Largest writable private address range whose page map is read (8 bytes per page: 8 MiB of map).
MAX_MAPPED = 4 << 30
_DIGEST_KEY = secrets.token_bytes(32)


def memory_digest(host_pid: int, limit: int = 1 << 30, *, resident_only: bool = True) -> str | None:
    """A digest of a process's writable private memory, or None if it cannot be read (or is over ``limit``).

    Only consistent while the process does not run: callers freeze it, or
    check that its CPU time did not move across the read.  Stack below each
    thread's stack pointer (past the red zone) is dead by the ABI and left
    out: the kernel and CRIU write signal frames there (a checkpoint's dump
    does, and the thread's memory is otherwise unchanged).

    ``resident_only``: of an *anonymous* mapping (heap, stacks, arenas, JIT
    areas) only the pages present or swapped are read, as
    ``/proc/<pid>/pagemap`` says, and which pages those are is part of the
    digest.  A page that is neither has never been written (or was dropped)
    and reads as zeros; it cannot change without becoming present, which
    changes the page set.  Reading it would also fault it in, and a
    sandbox's userfaultfd could hold that fault forever.  File-backed
    mappings are read whole as before: an untouched page there shows its
    file's bytes, and a file such as a memfd can change under the mapping.
    ``limit`` counts what is read, not the address space, so a process with
    large reserved but untouched mappings can still be proven unchanged.
    """
    # Keyed BLAKE3: ~7 GB/s here against SHA-256's 2 (the hash was most of a proof's time), and
    # keyed with a secret of this crabd run, so a sandbox cannot craft a second memory state
    # with the digest of the first (digests are only compared within one run).
    h = blake3.blake3(key=_DIGEST_KEY)
    try:
        plan = memory_ranges(host_pid, resident_only=resident_only)
        # Over the limit: known from the plan, before a byte is read (a 200 MB process cost 64 MB of reads here).
        if plan is None or sum(hi - lo for _, ranges in plan for lo, hi in ranges) > limit:
            return None
        with open(f"/proc/{host_pid}/mem", "rb", buffering=0) as mem:
            for mapping, ranges in plan:
                h.update(mapping.encode())
                for lo, hi in ranges:
                    h.update(f"{lo:x}-{hi:x}".encode())
                    _hash_range(h, mem, lo, hi)
    except OSError:
        return None
    return h.hexdigest()


def memory_ranges(host_pid: int, *, resident_only: bool = True) -> list[tuple[str, list[tuple[int, int]]]] | None:
    """What :func:`memory_digest` reads: each writable private mapping ("start-end") and the ranges read of it.

    None if a thread runs (its stack pointer is unknown) or the anonymous
    mappings whose page map would be read exceed MAX_MAPPED.  Raises OSError
    when /proc cannot be read (the process is gone).
    """
    sps = _stack_pointers(host_pid)
    if sps is None:
        return None
    plan = []
    mapped = 0
    with open(f"/proc/{host_pid}/pagemap", "rb", buffering=0) as pagemap:
        for line in _read(f"/proc/{host_pid}/maps").splitlines():
            parts = line.split(None, 5)
            if "w" not in parts[1] or "p" not in parts[1]:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            anonymous = len(parts) < 6 or parts[5].startswith("[")
            for sp in sps:
                if start <= sp < end:
                    start = max(start, sp - RED_ZONE)
            if not (resident_only and anonymous):
                plan.append((parts[0], [(start, end)]))
                continue
            mapped += end - start
            if mapped > MAX_MAPPED:
                return None
            plan.append((parts[0], _resident_runs(pagemap, start, end)))
    return plan


def _resident_runs(pagemap: BinaryIO, start: int, end: int) -> list[tuple[int, int]]:
    """The address ranges in [start, end) whose pages are present or swapped."""
    first = start // PAGE
    pagemap.seek(first * _PM_ENTRY)
    want = (end - 1) // PAGE - first + 1
    entries = pagemap.read(want * _PM_ENTRY)
    if len(entries) != want * _PM_ENTRY:
        raise OSError(f"short read of the page map: {len(entries)} of {want * _PM_ENTRY} bytes")
    flags = entries[7::_PM_ENTRY].translate(_RESIDENT)
    out = []
    for m in re.finditer(b"1+", flags):
        lo = max(start, (first + m.start()) * PAGE)
        hi = min(end, (first + m.end()) * PAGE)
        out.append((lo, hi))
    return out


def _hash_range(h: blake3.blake3, mem: BinaryIO, start: int, end: int) -> None:
    pos = start
    while pos < end:
        n = min(1 << 20, end - pos)
        try:
            mem.seek(pos)
            h.update(mem.read(n))
        except OSError:
            h.update(b"\0unreadable")
        pos += n
