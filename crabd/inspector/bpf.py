"""The eBPF event source: ``ebpf/inspector.c`` loaded with bcc, one instance for the whole host.

What decides is not an event but three counters per sandbox that the probes
bump in the kernel (the marks in ``counts``; see the top of ``ebpf/inspector.c``):

* **files**: some syscall may have changed a file a checkpoint keeps.  The
  probes judge by the kernel object the syscall acted on (the fd's inode, its
  type and filesystem), never by a path string, so no spelling of a path,
  dirfd or magic link hides a write.  A moved counter makes the decision
  compare the upper dir with the head exactly (net).
* **processes**: something may have changed a process's memory while it did
  not run (ptrace, process_vm_writev, a write to a /proc file such as
  ``/proc/<pid>/mem``, io_uring, AIO).
* **tmpfs**: something may have changed what the tmpfs and mqueue mounts
  hold: the decision fingerprints them again (``Inspector._tmpfs_now``).

The counters are never reset: each slot remembers the last values it saw, so
a mark that lands while crabd reads them counts for the next turn rather
than vanishing.  The same holds for the slot's other counters (events sent
or past the budget, events lost, forks, exits): all of them are one
``struct counts``, read in one lookup per turn; each turn then writes the
slot's ``struct epoch`` (the epoch number, and the events count its budget
starts from) in one update.  A poller thread drains the ring buffer of *events*, which
only explain (paths for the reasons, short-lived processes) — except that
lost events, a spent event budget, and a 32-bit process (x86 reports no
compat-mode syscall to ``syscalls:*`` tracepoints: its exec event is the only
sign of it) still make the turn's files dirty, never quietly clean.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from crabd.errors import BpfError
from crabd.inspector import btf
from crabd.inspector.model import Evidence, MemoryWrites, TaskCounts
from crabd.util import cgroups, resources

log = logging.getLogger("crabd.inspector")

#: The probes' C source: ebpf/inspector.c of the checkout, or its copy in the installed package.
PROGRAM = resources.inspector_program()
BCC_PATH = "/usr/lib/python3/dist-packages"
#: Syscalls whose tracepoints only newer kernels have; each becomes -DHAVE_<name> when present.
OPTIONAL = (
    "openat2",
    "fchmodat2",
    "setxattrat",
    "removexattrat",
    "pwritev2",
    "utime",
    "futimesat",
    "move_mount",
    "fsmount",
    "mount_setattr",
    "open_tree",
    "open_tree_attr",
)
EV_OPEN, EV_PATH, EV_PATH2, EV_FD, EV_FORK, EV_EXEC, EV_EXIT, EV_UNCERTAIN = range(1, 9)
OPS = {
    1: "truncated", 2: "removed", 3: "made dir", 4: "removed dir", 5: "made node", 6: "chmod", 7: "chown",
    8: "changed xattrs of", 9: "set times of", 10: "renamed", 11: "linked", 12: "made symlink", 13: "wrote",
    14: "allocated", 15: "copied into", 16: "mapped for writing", 23: "ioctl on", 24: "dumped core",
}  # fmt: skip
UNCERTAIN = {
    17: "ptrace (another process's memory may have changed while it did not run)",
    18: "process_vm_writev (another process's memory changed while it did not run)",
    19: "io_uring (the kernel does I/O the syscall probes cannot see)",
    20: "Linux AIO (the kernel does I/O the syscall probes cannot see)",
    21: "opened a file by handle for writing (no path to see)",
    22: "wrote to a /proc file (it may be another process's memory)",
}
#: Paths not worth naming in an explanation (the probes already judged them by their inodes).
_QUIET = ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/dev/stdout", "/dev/stderr", "/dev/fd/", "/dev/pts/")
#: Kernel struct members the probes read, as ``-D`` macros: (macro, struct, member).
KERNEL_OFFSETS = (
    ("OFF_TASK_FILES", "task_struct", "files"),
    ("OFF_TASK_EXIT_CODE", "task_struct", "exit_code"),
    ("OFF_FILES_FDT", "files_struct", "fdt"),
    ("OFF_FDT_MAX_FDS", "fdtable", "max_fds"),
    ("OFF_FDT_FD", "fdtable", "fd"),
    ("OFF_FILE_INODE", "file", "f_inode"),
    ("OFF_FILE_MODE", "file", "f_mode"),
    ("OFF_INODE_MODE", "inode", "i_mode"),
    ("OFF_INODE_SB", "inode", "i_sb"),
    ("OFF_SB_MAGIC", "super_block", "s_magic"),
)
MARK_FILES, MARK_PROC, MARK_TMPFS, NMARKS = 0, 1, 2, 3
MAX_NOTES = 8
#: Events the probes send per sandbox per turn; past it they only count (see ebpf/inspector.c).
EVENT_BUDGET = 64
#: How often the ring buffer is drained between turn ends (it holds about 2,000 events).
POLL_INTERVAL_S = 0.01
PATH_BYTES = 1024


#: The fields of ``struct counts`` after the marks (ebpf/inspector.c), in order.
EVENTS, DROPPED, FORKS, EXITS, TASK_EXITS = NMARKS, NMARKS + 1, NMARKS + 2, NMARKS + 3, NMARKS + 4
#: Exec'd processes a turn's evidence names (``Evidence.exec_tgids``); past it, None: too many to tell.
MAX_EXEC_TGIDS = 64


class _Slot:
    def __init__(self, sandbox_id: str, counts: list[int], tracked: int) -> None:
        self.sandbox_id = sandbox_id
        #: Which track() made it: task counts of one tracking are comparable, across two they are not.
        self.tracked = tracked
        self.ev = Evidence()
        self.muted = False
        #: The slot's counters as of the last take (what moved since is this turn's): the marks,
        #: then events, dropped, forks, exits.  The kernel only ever increments them.
        self.seen = counts
        #: The epoch number (explanations of writes are sent once per process and fd per epoch).
        self.epoch = 0


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "backslashreplace")


class BpfEvents:
    """:class:`~crabd.inspector.base.EventSource` over the eBPF probes."""

    name = "ebpf"
    why = "eBPF probes attached"
    pending = False

    def __init__(self, *, cgroup_level: int = 2, max_sandboxes: int = 1024, ring_pages: int = 1024) -> None:
        self.cgroup_level = cgroup_level
        self.max_sandboxes = max_sandboxes
        self.ring_pages = ring_pages
        self._bpf: Any = None
        self._lock = threading.Lock()
        self._ring_lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._by_sandbox: dict[str, tuple[int, int]] = {}  # sandbox -> (slot, cgroup id)
        self._free = list(range(max_sandboxes - 1, -1, -1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tracepoints = 0
        self._tracks = 0

    # --- lifetime ----------------------------------------------------------------

    def start(self) -> None:
        """Compile, load and attach the probes (a few seconds), then start polling.

        Once per instance: a second call raises rather than attach a second set.
        """
        if self._bpf is not None:
            raise BpfError("crab's eBPF probes are already attached", hint="This is a bug in crabd; report it.")
        if BCC_PATH not in sys.path:
            sys.path.append(BCC_PATH)
        try:
            from bcc import BPF
        except ImportError as exc:
            raise BpfError("bcc is not installed (Debian's python3-bpfcc)", hint="Run `make setup`.") from exc
        have = [n for n in OPTIONAL if Path(f"/sys/kernel/tracing/events/syscalls/sys_enter_{n}").is_dir()]
        offsets = btf.offsets(KERNEL_OFFSETS)
        cflags = [
            *(f"-D{name}={value}" for name, value in offsets.items()),
            f"-DSANDBOX_CGROUP_LEVEL={self.cgroup_level}",
            f"-DMAX_SANDBOXES={self.max_sandboxes}",
            f"-DPATH_BYTES={PATH_BYTES}",
            f"-DRINGBUF_PAGES={self.ring_pages}",
            f"-DEVENT_BUDGET={EVENT_BUDGET}",
            "-w",
            *(f"-DHAVE_{n}" for n in have),
        ]
        t0 = time.monotonic()
        try:
            self._bpf = BPF(src_file=str(PROGRAM).encode(), cflags=cflags)
            self._bpf["events"].open_ring_buffer(self._on_event)
        except Exception as exc:  # bcc raises bare Exceptions
            raise BpfError(f"cannot load crab's eBPF probes: {exc}") from exc
        self.tracepoints = int(self._bpf.num_open_tracepoints())
        log.info(
            "ebpf probes attached",
            extra={"tracepoints": self.tracepoints, "seconds": round(time.monotonic() - t0, 2)},
        )
        self._thread = threading.Thread(target=self._poll, name="crab-bpf-poll", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Detach the probes (idempotent; also after a failed start)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None

    def _drain(self) -> None:
        # libbpf's ring buffer has one consumer position: two threads consuming
        # at once could hand an event over twice or skip one.  So every drain
        # goes through one lock, and nothing blocks inside it (consume never
        # waits), so a turn decision waits at most for one drain in progress.
        with self._ring_lock:
            self._bpf.ring_buffer_consume()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            try:
                self._drain()
            except Exception:  # never let the poller die: decisions would go blind
                log.exception("ebpf ring buffer drain failed")

    # --- sandboxes ------------------------------------------------------------------

    def track(self, sandbox_id: str, container_id: str) -> None:
        cg = cgroups.cgroup_id(container_id)
        if cg is None:
            raise BpfError(f"container {container_id[:12]} has no cgroup v2 directory to attribute events by")
        with self._lock:
            self._untrack_locked(sandbox_id)
            if not self._free:
                raise BpfError(f"more than {self.max_sandboxes} sandboxes to watch")
            slot = self._free.pop()
            # The counters are never reset: the new sandbox's turns count from their values now.
            self._tracks += 1
            state = self._slots[slot] = _Slot(sandbox_id, self._counts(slot), self._tracks)
            self._by_sandbox[sandbox_id] = (slot, cg)
            self._new_epoch(slot, state)
            self._bpf["sandboxes"][ctypes.c_uint64(cg)] = ctypes.c_uint32(slot)

    def _counts(self, slot: int) -> list[int]:
        """The slot's counters in one map lookup: the marks, then events, dropped, forks, exits, task exits."""
        c = self._bpf["counts"][ctypes.c_int(slot)]
        return [int(m) for m in c.marks] + [
            int(c.events),
            int(c.dropped),
            int(c.forks),
            int(c.exits),
            int(c.task_exits),
        ]

    def tasks(self, sandbox_id: str) -> TaskCounts | None:
        """(tracking, tasks forked, tasks exited) in the sandbox's cgroup now, as the kernel counted them."""
        with self._lock:
            found = self._by_sandbox.get(sandbox_id)
            if found is None:
                return None
            counts = self._counts(found[0])
            return self._slots[found[0]].tracked, counts[FORKS], counts[TASK_EXITS]

    def memory_writes(self, sandbox_id: str) -> MemoryWrites | None:
        """(tracking, the process mark's count): every uncertain operation in the sandbox bumps it."""
        with self._lock:
            found = self._by_sandbox.get(sandbox_id)
            if found is None:
                return None
            return self._slots[found[0]].tracked, self._counts(found[0])[MARK_PROC]

    def _new_epoch(self, slot: int, state: _Slot) -> None:
        """Start the slot's next epoch from the counters just read into ``state.seen`` (one map update)."""
        state.epoch += 1
        table = self._bpf["epochs"]
        table[ctypes.c_int(slot)] = table.Leaf(state.epoch, state.seen[EVENTS])

    def _untrack_locked(self, sandbox_id: str) -> None:
        found = self._by_sandbox.pop(sandbox_id, None)
        if found is None:
            return
        slot, cg = found
        with contextlib.suppress(KeyError):
            del self._bpf["sandboxes"][ctypes.c_uint64(cg)]
        self._slots.pop(slot, None)
        self._free.append(slot)

    def untrack(self, sandbox_id: str) -> None:
        with self._lock:
            self._untrack_locked(sandbox_id)

    @contextlib.contextmanager
    def quiet(self, sandbox_id: str) -> Iterator[None]:
        # Events are in the ring before their syscalls return: draining on the
        # way in keeps everything the sandbox did before it froze, draining on
        # the way out drops only what crabd's helpers did inside.  The marks
        # that moved inside are crabd's helpers' alone (the sandbox is frozen):
        # they are added to what the slot has seen, so they count for nobody.
        self._drain()
        slot = self._set_muted(sandbox_id, True)
        before = self._counts(slot[0]) if slot is not None else []
        try:
            yield
        finally:
            self._drain()
            if slot is not None:
                with self._lock:
                    after = self._counts(slot[0])
                    state = slot[1]
                    state.seen = [s + (a - b) for s, a, b in zip(state.seen, after, before, strict=True)]
                self._set_muted(sandbox_id, False)

    def _set_muted(self, sandbox_id: str, muted: bool) -> tuple[int, _Slot] | None:
        with self._lock:
            found = self._by_sandbox.get(sandbox_id)
            if found is None:
                return None
            state = self._slots[found[0]]
            state.muted = muted
            return found[0], state

    def take(self, sandbox_id: str) -> Evidence:
        """Everything seen for the sandbox since the last call; starts a new epoch."""
        # Events are in the ring before the syscalls they describe return, so
        # draining now sees everything the turn did.
        self._drain()
        with self._lock:
            found = self._by_sandbox.get(sandbox_id)
            if found is None:
                # Unwatched: judged as the scan judges (memory digests included).
                ev = Evidence(files_dirty=True, inspector="scan")
                ev.file_notes.append("the sandbox was not being watched")
                return ev
            slot, _ = found
            state = self._slots[slot]
            # The next turn's evidence starts clean; a slot's first (Evidence()) is dirty: a
            # sandbox just tracked ran unwatched for a moment.
            ev, state.ev = state.ev, Evidence(tmpfs_dirty=False)
            ev.inspector = self.name
            counts = self._counts(slot)
            moved = [now - seen for now, seen in zip(counts, state.seen, strict=True)]
            state.seen = counts
            if moved[MARK_FILES]:
                ev.files_dirty = True
            if moved[MARK_PROC] and not ev.process_notes:
                ev.process_notes.append("a process's memory may have changed while it did not run")
            if moved[MARK_TMPFS]:
                ev.tmpfs_dirty = True
            lost, sent_or_not, ev.forks, ev.exits = moved[DROPPED], moved[EVENTS], moved[FORKS], moved[EXITS]
            if lost:
                ev.lost = lost
                ev.files_dirty = ev.tmpfs_dirty = True
                ev.file_notes.insert(0, f"{lost} events were lost (ring buffer full)")
            if sent_or_not > EVENT_BUDGET:
                # Past the budget the probes only counted: what they did not send may be a mutation.
                ev.files_dirty = ev.tmpfs_dirty = True
                ev.file_notes.append(f"{sent_or_not} events this turn; the first {EVENT_BUDGET} were read")
            self._new_epoch(slot, state)
        return ev

    # --- events ------------------------------------------------------------------------

    def _on_event(self, ctx: Any, data: Any, size: int) -> int:
        e = self._bpf["events"].event(data)
        with self._lock:
            state = self._slots.get(int(e.slot))
            if state is None or state.muted:
                return 0
            ev = state.ev
            ev.events += 1
            kind = int(e.kind)
            # Events explain; the marks decide (take()).  Paths here are only shown.
            if kind == EV_UNCERTAIN:
                note = f"process {e.tgid} used {UNCERTAIN.get(int(e.op), 'an untraceable operation')}"
                if note not in ev.process_notes:
                    ev.process_notes.append(note)
            elif kind == EV_OPEN:
                path = _text(bytes(e.path)) or "(a path the probe could not read)"
                if not path.startswith(_QUIET):
                    self._note(ev, f"opened {path} for writing")
            elif kind in (EV_PATH, EV_PATH2):
                what = OPS.get(int(e.op), "changed")
                target = _text(bytes(e.path2)) if kind == EV_PATH2 else _text(bytes(e.path))
                self._note(ev, f"{what} {target}")
            elif kind == EV_FD:
                op = int(e.op)
                path = self._fd_path(int(e.tgid), int(e.fd))
                self._note(ev, f"{OPS.get(op, 'changed')} {path if path.startswith('/') else f'fd {e.fd}'}")
            elif kind == EV_EXIT:
                self._note(ev, f"process {e.tgid} dumped core")
            elif kind == EV_EXEC:
                if ev.exec_tgids is not None:
                    ev.exec_tgids.add(int(e.tgid))
                    if len(ev.exec_tgids) > MAX_EXEC_TGIDS:
                        ev.exec_tgids = None
                self._check_32bit(ev, int(e.tgid), _text(bytes(e.path)))
                if len(ev.ran) < 50:
                    ev.ran.append(_text(bytes(e.path)))
        return 0

    @staticmethod
    def _note(ev: Evidence, text: str) -> None:
        if len(ev.file_notes) < MAX_NOTES and text not in ev.file_notes:
            ev.file_notes.append(text)

    @staticmethod
    def _fd_path(tgid: int, fd: int) -> str:
        try:
            return os.readlink(f"/proc/{tgid}/fd/{fd}")
        except OSError:
            return ""

    @staticmethod
    def _check_32bit(ev: Evidence, tgid: int, filename: str) -> None:
        try:
            with open(f"/proc/{tgid}/exe", "rb") as f:
                header = f.read(5)
        except OSError:
            return
        if header[:4] == b"\x7fELF" and header[4] == 1:
            ev.files_dirty = ev.tmpfs_dirty = True
            ev.process_notes.append(
                f"32-bit process {tgid} `{filename}`: its syscalls are invisible to the probes on x86"
            )
