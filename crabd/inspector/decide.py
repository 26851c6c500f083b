"""The turn decision: skip, fs or full — soundly first, cheaply second, always with reasons.

At a turn end the sandbox is compared with its *head* checkpoint, in three parts:

**Processes.**  The head stands for a process state: the processes in its
process image (or none, if it has no image — a restore then starts only
crab's init and a fresh session).  That state is kept as a *baseline*
(``model.Baseline``): the processes with their start times, CPU times and
thread ids, and the digest of the sandbox's tmpfs mounts.  Now (from /proc):

* a process alive now that the baseline lacks, or one the baseline has that
  is gone, is a change;
* a baseline process that *ran* (CPU time grew, or a thread came or went)
  is a change — unless proven otherwise: if its threads and open fds are
  the same and its writable memory hashes to what it was when the image was
  dumped (read while it does not run: its CPU time must not move across the
  read), it is unchanged.  This matters more than it seems: every freeze
  (each checkpoint's) interrupts a process's blocking syscall, which it
  restarts after the thaw — a few microseconds of CPU that change nothing;
* a baseline process that did not run did not change, unless something else
  changed its memory: ptrace, process_vm_writev or ``/proc/<pid>/mem``
  (the eBPF probes see those; without them the memory digest of each idle
  process is compared instead), io_uring or AIO (the kernel works for it
  without it running: always a change), or memory shared with something
  outside the sandbox;
* the tmpfs mounts (``/dev/shm``) changed: their content is only in a
  process image (so that change alone calls for a full checkpoint, and so
  does any content there when the checkpoint would have no image).  They
  are fingerprinted at a turn end unless the probes vouch that nothing
  could have changed them since the last fingerprint (no MARK_TMPFS, no
  shared mapping of a file there: :meth:`Inspector._tmpfs_now`).

crab's init (and its keeper at PID 1, :func:`.procs.crab_init`) and the
session's bash are not counted: init's state is crab's own bookkeeping,
and the session's state is captured semantically at every
turn end (the restore re-applies it).  A REPL or server the agent started
*from* the session is counted like any process.

**Files.**  The probes' marks prove a turn did not touch the files (they
judge each syscall by the inode it acted on; ``ebpf/inspector.c``); if it
did (or the probes cannot tell), the upper dir is compared with the head's
index, exactly and net (``files.py``).  Writes through a shared mapping make
no syscall: a sandbox with a process that may write through one, at this
turn end or the previous one, is compared in full too.  Files that live
processes hold open for writing are checked even without marks (a second
line of defence: the probes already count every write through them).  A changed file that a live
process holds open or mapped makes the process state inconsistent with the
old image: a change of processes.

**Session.**  The session's semantic state (cwd, env, ...) differs from the
head's: a filesystem checkpoint records it.

Verdict: **full** if processes changed and some are alive, or the tmpfs
mounts changed; **fs** if files or the session changed, or processes
changed and none are left (an image would hold nothing); else **skip**.  An fs decision with live, unchanged
processes pairs the new checkpoint with the head's process image.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from crabd.backends.fsdelta import Entry, ScanLimits
from crabd.inspector import files, mounts, procs
from crabd.inspector.base import EventSource, ScanEvents
from crabd.inspector.digests import DeferredDigests
from crabd.inspector.model import FS, FULL, SKIP, Baseline, Decision, Dumped, Evidence, Proc
from crabd.inspector.session import session_change
from crabd.inspector.vouched import VouchedProcesses
from crabd.util import cgroups

log = logging.getLogger("crabd.inspector")

#: How long a turn end waits for the session bash's own momentary forks to exit.
SESSION_FORK_WAIT_S = 0.2
#: Largest writable memory of one process that is hashed to prove it unchanged (see above).
MEMORY_PROOF_LIMIT = 64 << 20


def consistent_digest(host_pid: int, limit: int = MEMORY_PROOF_LIMIT) -> str | None:
    """The process's memory digest if it did not run while it was read, else None."""
    before = procs.runtime_ns(host_pid)
    digest = procs.memory_digest(host_pid, limit)
    return digest if before is not None and procs.runtime_ns(host_pid) == before else None


@dataclass
class TurnEnd:
    """What the coordinator knows about a sandbox at a turn end."""

    sandbox_id: str
    container_id: str
    init_host_pid: int
    upper: Path
    lowers: list[Path]
    head_tree: list[Entry] | None
    head_racy_ns: int
    head_checkpoint: str | None
    #: The sessions' bashes whose state is captured (the default one, the named ones in ``session_json``).
    session_pids: frozenset[int]
    session_json: str | None
    head_session_json: str | None


def _excluded(session_pids: frozenset[int]) -> set[int]:
    return {1} | {p for p in session_pids if p}


def _counted(now: dict[int, Proc], session_pids: frozenset[int]) -> dict[int, Proc]:
    """The processes the decision counts: all but PID 1, crab-init (its keeper's child) and the sessions' bashes
    whose state is captured."""
    skip = _excluded(session_pids) | {procs.crab_init(now)}
    return {p: v for p, v in now.items() if p not in skip}


class Inspector:
    """Decides each turn; keeps each sandbox's baseline.  One per daemon."""

    def __init__(
        self, source: EventSource, *, limits: ScanLimits, shadow: bool = False, check_memory: bool | None = None
    ) -> None:
        self.source = source
        self.limits = limits
        #: Also decide with the scan inspector, for comparison (evaluation), when the probes decided.
        self.shadow = shadow
        # Without probes, ptrace and process_vm_writev by a process that has
        # since exited are invisible: compare idle processes' memory instead.
        # None: do so exactly for the turns the scan decides (see decide()).
        self.check_memory = check_memory
        self._baselines: dict[str, Baseline] = {}
        #: Digest of the tmpfs mounts at the head's process image; None: the head has no image.
        self._tmpfs: dict[str, str | None] = {}
        #: Sandboxes whose next turn compares the whole upper dir whatever the events say:
        #: a restored container ran for a moment before it could be watched.
        self._scan_next: set[str] = set()
        #: Sandboxes that had, at their last turn end, a process that may write through a shared
        #: file mapping (such writes make no syscall; the next turn compares all files).
        self._mapped: set[str] = set()
        #: The tmpfs fingerprint at each sandbox's last decision: it stands while the probes
        #: vouch nothing could have changed the mounts (:meth:`_tmpfs_now`).
        self._fingerprints: dict[str, mounts.Tmpfs] = {}
        #: Sandboxes that had, at their last turn end, a shared mapping of a tmpfs file.
        self._tmpfs_mapped: set[str] = set()
        #: The last /proc read of sandboxes running only what is never counted, while the probes vouch for it.
        self.vouched = VouchedProcesses(source.tasks, cgroups.container_host_pids)
        #: Started sandboxes' memory digests, taken after the start answered (digests.py).
        self._deferred = DeferredDigests(consistent_digest, lambda host_pid: procs.runtime_ns(host_pid))

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def why(self) -> str:
        return self.source.why

    @property
    def pending(self) -> bool:
        return self.source.pending

    def close(self) -> None:
        self._deferred.close()
        self.source.close()

    # --- baselines ------------------------------------------------------------------

    def started(
        self,
        sandbox_id: str,
        container_id: str,
        init_host_pid: int,
        session_pids: frozenset[int],
        image: str | None,
        image_checkpoint: str | None,
        *,
        restored: bool = True,
        owner: str = "",
    ) -> None:
        """A container was started fresh, restored or forked: its processes are what ``image`` holds.

        ``restored``: started from a checkpoint, which is its head.  It ran
        for a moment before it could be watched, and what it wrote then is
        not in that head, so its first turn compares the whole file tree.  A
        fresh sandbox (``restored=False``) is cut for its first checkpoint
        only after this call: what it wrote before is in that cut, and what
        it writes after, the probes see.

        The processes' memory digests are taken after this returns, on a
        few threads of their own (digests.py), shared fairly by ``owner`` (the
        sandbox's tenant); every reader of the baseline waits for them
        (:meth:`_baseline`).
        """
        self.source.track(sandbox_id, container_id)
        self.source.take(sandbox_id)  # the start itself is nobody's turn
        self.vouched.forget(sandbox_id)
        now = procs.snapshot(container_id)
        keep = _counted(now, session_pids)
        base = Baseline(keep, image, image_checkpoint)
        self._baselines[sandbox_id] = base
        self._deferred.start(sandbox_id, base, owner)  # the memory digests, after the start answered
        self._fingerprints.pop(sandbox_id, None)
        # Without an image the head's tmpfs is what a fresh container has: nothing of the sandbox's own.
        self._tmpfs[sandbox_id] = mounts.fingerprint(init_host_pid).digest if image else None
        if restored:
            self._scan_next.add(sandbox_id)
        else:
            self._scan_next.discard(sandbox_id)

    def adopt(self, sandbox_id: str, container_id: str) -> None:
        """A running sandbox found after crabd restarted: watch it; its baseline is unknown (conservative)."""
        self.source.track(sandbox_id, container_id)
        self.vouched.forget(sandbox_id)
        self._deferred.forget(sandbox_id)
        self._baselines.pop(sandbox_id, None)
        self._tmpfs.pop(sandbox_id, None)
        self._fingerprints.pop(sandbox_id, None)
        self._scan_next.add(sandbox_id)

    def unchanged_since_image(
        self, sandbox_id: str, container_id: str, init_host_pid: int, session_pids: frozenset[int]
    ) -> str:
        """ "" if the processes are still exactly the baseline's (call while frozen), else what changed."""
        base = self._baseline(sandbox_id)
        if base is None or base.image is None:
            return "crabd has no process image to pair with"
        skip = _excluded(session_pids)
        cur = _counted(procs.snapshot(container_id, skip), session_pids)
        for pid, p in cur.items():
            b = base.procs.get(pid)
            if b is None or b.start != p.start:
                return f"process {pid} `{p.cmd}` started"
            if (p.runtime_ns != b.runtime_ns or p.tids != b.tids) and not self._proven_unchanged(base, p, b):
                return f"process {pid} `{p.cmd}` ran"
        gone = set(base.procs) - set(cur)
        if gone:
            return f"process {min(gone)} exited"
        if mounts.fingerprint(init_host_pid).digest != self._tmpfs.get(sandbox_id):
            return "the tmpfs mounts changed"
        return ""

    def at_dump(self, container_id: str, init_host_pid: int, session_pids: frozenset[int]) -> Dumped:
        """The baseline of a process dump being taken (call while the sandbox is frozen)."""
        now = procs.snapshot(container_id)
        keep = _counted(now, session_pids)
        return Dumped(Baseline(keep, None, None, self._digests(keep)), mounts.fingerprint(init_host_pid).digest)

    def settle_later(self, sandbox_id: str, container_id: str, owner: str = "") -> None:
        """Let the baseline absorb what a dump itself made its processes do (call after the thaw).

        CRIU interrupts every blocking syscall to dump a process; some return
        EINTR after the thaw and the program retries (coreutils' sleep writes
        the time left and sleeps again).  A restore of the image goes through
        the same motions, so that state is the image's.  A process that spent
        at most ``SETTLE_CPU_NS`` since the dump, with the same threads and fds,
        that read or wrote nothing (its I/O counters did not move), and now
        waits in the kernel again, has its CPU time and memory digest taken
        anew, ``SETTLE_S`` after this call (both in digests.py).

        The I/O condition matters: a full dump freezes the sandbox for longer
        than many programs' timers, so one that was due during the freeze
        runs right at the thaw (a logger appends a line, a server answers a
        request that waited).  That work is real and the image lacks it; it
        always reads or writes something, so it is never absorbed.  Work
        without any I/O that was due at the thaw is also due when the image
        is restored, so the restored process does it too.

        It runs as the baseline's pending job (digests.py), not in the
        checkpoint's call, which it cost SETTLE_S and a /proc read (22 ms of a
        small sandbox's 155 ms full checkpoint).  The sandbox's next action
        and every reader of the baseline wait for it, so, as when the call
        waited, nothing the agent does runs inside the window it looks at.
        """
        base = self._baselines.get(sandbox_id)
        if base is None or base.image is None or not base.procs:
            return
        self._deferred.settle(sandbox_id, base, lambda: procs.snapshot(container_id), owner)

    def published(self, sandbox_id: str, checkpoint_id: str, image: str | None, dumped: Dumped | None) -> None:
        """A checkpoint became the sandbox's head: the baseline follows it."""
        if dumped is not None or image is None:
            self._deferred.forget(sandbox_id)  # that baseline is replaced
        if dumped is not None:
            base = dumped.baseline
            base.image, base.image_checkpoint = image, checkpoint_id
            self._baselines[sandbox_id] = base
            self._tmpfs[sandbox_id] = dumped.tmpfs
        elif image is None:  # a head without processes: a restore starts fresh
            self._baselines[sandbox_id] = Baseline({}, None, None)
            self._tmpfs[sandbox_id] = None
        # fs paired with the previous image: the baseline stays

    def forget(self, sandbox_id: str) -> None:
        self._deferred.forget(sandbox_id)
        self.source.untrack(sandbox_id)
        self._baselines.pop(sandbox_id, None)
        self._tmpfs.pop(sandbox_id, None)
        self._scan_next.discard(sandbox_id)
        self._mapped.discard(sandbox_id)
        self._fingerprints.pop(sandbox_id, None)
        self._tmpfs_mapped.discard(sandbox_id)
        self.vouched.forget(sandbox_id)

    def baseline_pending(self, sandbox_id: str) -> bool:
        """Whether the baseline's job is still running: a start's memory digests, a dump's settling."""
        return self._deferred.pending(sandbox_id)

    def wait_baseline(self, sandbox_id: str) -> None:
        """Until that job is done (or, if it never ends, the baseline is dropped: conservative)."""
        self._baseline(sandbox_id)

    def _baseline(self, sandbox_id: str) -> Baseline | None:
        """The sandbox's baseline once its pending job is done; None if there is none or the job never ended."""
        if not self._deferred.wait(sandbox_id):
            self._baselines.pop(sandbox_id, None)  # its digests are missing: decide as after a restart
        return self._baselines.get(sandbox_id)

    def _digests(self, ps: dict[int, Proc]) -> dict[int, str]:
        out = {}
        for pid, p in ps.items():
            d = consistent_digest(p.host_pid)
            if d is not None:
                out[pid] = d
        return out

    def _proven_unchanged(self, base: Baseline, p: Proc, b: Proc) -> bool:
        """A process that ran, but whose threads, fds and memory are what the image holds."""
        known = base.memory.get(p.pid)
        if known is None or p.tids != b.tids or p.fds != b.fds:
            return False
        if consistent_digest(p.host_pid) != known:
            return False
        base.procs[p.pid] = p  # proven equal now: later turns compare with this CPU time
        return True

    # --- the decision ---------------------------------------------------------------------

    def decide(self, turn: TurnEnd) -> Decision:
        t0 = time.monotonic()
        ev = self.source.take(turn.sandbox_id)
        # Taken out with the evidence: if this decision fails half-way, the next one fingerprints.
        last_tmpfs = self._fingerprints.pop(turn.sandbox_id, None)
        if turn.sandbox_id in self._scan_next:
            self._scan_next.discard(turn.sandbox_id)
            ev.files_dirty = True
        if turn.sandbox_id in self._mapped:
            ev.files_dirty = True
            ev.file_notes.append("a process could write through a shared file mapping (no syscall to see)")
        # The source says who gathered the evidence: a deferred source's scan
        # decides the turns its probes did not watch from their start.
        name = ev.inspector or self.source.name
        check_memory = name == "scan" if self.check_memory is None else self.check_memory
        decision = self._decide(turn, ev, name, check_memory, last_tmpfs)
        decision.seconds = time.monotonic() - t0
        if self.shadow and name != "scan":
            t1 = time.monotonic()
            other = self._decide(turn, ScanEvents().take(turn.sandbox_id), "scan", True)
            decision.shadow = {
                "inspector": "scan",
                "kind": other.kind,
                "reasons": other.reasons,
                "seconds": time.monotonic() - t1,
            }
        return decision

    def _settled_snapshot(self, turn: TurnEnd, ev: Evidence, name: str) -> dict[int, Proc]:
        """The sandbox's processes, once the session's own short-lived forks are gone.

        Not read from /proc at all when the last read found only the
        processes never counted and the probes vouch nothing changed that
        since (``inspector/vouched.py``).

        The session protocol's last step, after the done marker, is a
        subshell that sets ``$?`` (``(exit N)``); on a loaded host it can
        still be alive when the turn ends.  Likewise a process that is
        exiting shows an empty command line (its memory is already gone).
        Such a process still there after SESSION_FORK_WAIT_S counts like any
        other (a process may blank its own command line).
        """
        kept = self.vouched.still(turn.sandbox_id, turn.container_id, turn.session_pids, ev, name)
        if kept is not None:
            return kept
        skip = _excluded(turn.session_pids)
        base = self._baselines.get(turn.sandbox_id)
        known = {p.key() for p in base.procs.values()} if base else set()
        deadline = time.monotonic() + SESSION_FORK_WAIT_S
        while True:
            # Read before /proc: a task begun after this reading is counted against the read below.
            tasks = self.vouched.tasks_now(turn.sandbox_id)
            now = procs.snapshot(turn.container_id, skip)
            shells = {pid: now[pid] for pid in turn.session_pids if pid in now}
            forks = [
                p
                for p in now.values()
                if p.pid not in skip
                and p.key() not in known  # a background subshell already checkpointed is not momentary
                and (p.cmd in ("", "?") or (p.ppid in shells and p.cmd == shells[p.ppid].cmd))
            ]
            if not forks or time.monotonic() > deadline:
                light = skip | {procs.crab_init(now)}
                self.vouched.read(turn.sandbox_id, turn.container_id, turn.session_pids, now, light, tasks)
                return now
            time.sleep(0.002)

    def _decide(
        self, turn: TurnEnd, ev: Evidence, name: str, check_memory: bool, last_tmpfs: mounts.Tmpfs | None = None
    ) -> Decision:
        now = self._settled_snapshot(turn, ev, name)
        if any(p.writes_mapped for p in now.values()):
            # Writes through it from now on reach no probe: this turn's files and the next's are compared.
            self._mapped.add(turn.sandbox_id)
            if not ev.files_dirty:
                ev.files_dirty = True
                ev.file_notes.append("a process could write through a shared file mapping (no syscall to see)")
        else:
            self._mapped.discard(turn.sandbox_id)
        cur = _counted(now, turn.session_pids)
        base = self._baseline(turn.sandbox_id)
        proc_changes = self._process_changes(turn, cur, base, ev, check_memory)
        tmpfs = self._tmpfs_now(turn, ev, now, last_tmpfs)
        tmpfs_change = self._tmpfs_change(turn, tmpfs) if base is not None else ""
        file_changes = self._file_changes(turn, ev, now)
        changed_paths = {c.split(" ", 1)[1] for c in file_changes if " /" in c}
        for p in cur.values():
            held = changed_paths.intersection(p.open_files)
            if held:
                proc_changes.append(f"changed {sorted(held)[0]}, which process {p.pid} `{p.cmd}` holds open")
        session = session_change(turn.session_json, turn.head_session_json)
        if turn.head_checkpoint is None:
            session = session or "the sandbox has no checkpoint yet"
        paired = bool(cur) and base is not None and base.image is not None
        if (proc_changes and cur) or tmpfs_change:
            kind = FULL
        elif proc_changes or file_changes or session:
            kind = FS
            if not paired and tmpfs.content:
                # A checkpoint without a process image would come back with empty tmpfs mounts.
                kind = FULL
                tmpfs_change = f"{tmpfs.content} is on a tmpfs: only a process checkpoint keeps it"
        else:
            kind = SKIP
        reasons = proc_changes + ([tmpfs_change] if tmpfs_change else []) + file_changes
        reasons += [session] if session else []
        if kind == SKIP:
            ran = ", ".join(dict.fromkeys(r.rsplit("/", 1)[-1] for r in ev.ran)) if ev.ran else ""
            reasons.append("no change to files, processes or the session" + (f" (ran: {ran})" if ran else ""))
        elif not file_changes and ev.file_notes and kind != FULL:
            reasons.append("file events, but no net change: " + "; ".join(ev.file_notes[:3]))
        d = Decision(kind=kind, reasons=reasons, inspector=name)
        if kind in (FS, SKIP) and paired and base is not None:
            # A skip records it too: an explicit checkpoint taken at a skip is files-only, and must
            # still bring back the live processes (named sessions, jobs) the head's image holds.
            d.paired_with, d.paired_image = base.image_checkpoint, base.image
        return d

    def _process_changes(
        self, turn: TurnEnd, cur: dict[int, Proc], base: Baseline | None, ev: Evidence, check_memory: bool
    ) -> list[str]:
        out: list[str] = []
        if base is None:
            # crabd restarted since the head (or could not watch the sandbox): nothing to compare with.
            return ["crabd has no record of the processes at this sandbox's head (crabd restarted since)"]
        for pid, p in sorted(cur.items()):
            b = base.procs.get(pid)
            if b is None or b.start != p.start:
                out.append(f"new process {pid} `{p.cmd}` alive at turn end")
            elif p.runtime_ns > b.runtime_ns or p.tids != b.tids:
                if not self._proven_unchanged(base, p, b):
                    ran = (p.runtime_ns - b.runtime_ns) / 1e6
                    out.append(f"process {pid} `{p.cmd}` ran ({ran:.1f} ms of CPU) and its memory changed")
            elif check_memory and pid in base.memory and consistent_digest(p.host_pid) != base.memory[pid]:
                out.append(f"memory of process {pid} `{p.cmd}` changed while it did not run")
        for pid, b in sorted(base.procs.items()):
            now = cur.get(pid)
            if now is None or now.start != b.start:
                out.append(f"process {pid} `{b.cmd}` exited")
        for p in cur.values():
            if p.io_uring:
                out.append(f"process {p.pid} `{p.cmd}` uses io_uring (the kernel works on its memory unseen)")
            if p.aio:
                out.append(f"process {p.pid} `{p.cmd}` uses Linux AIO (the kernel works on its memory unseen)")
            if p.traced:
                out.append(f"process {p.pid} `{p.cmd}` is being traced")
            if p.foreign_shared:
                out.append(f"process {p.pid} `{p.cmd}` shares memory with {p.foreign_shared}, outside the sandbox")
        if cur:
            out += ev.process_notes
        return out

    def _tmpfs_now(self, turn: TurnEnd, ev: Evidence, now: dict[int, Proc], last: mounts.Tmpfs | None) -> mounts.Tmpfs:
        """The tmpfs fingerprint now: the last decision's stands if nothing could have changed it.

        It stands only if the probes watched the whole turn and saw nothing
        that may change the tmpfs or mqueue mounts (``Evidence.tmpfs_dirty``:
        a write to or an open for writing of a file there, any path-based
        mutation, a mount-table change, a message-queue call, anything
        uncertain), and no process had a shared mapping of a file there at
        this turn end or the last one (writes through it make no syscall).
        The scan inspector's evidence is always dirty.
        """
        sid = turn.sandbox_id
        mapped = any(p.maps_tmpfs for p in now.values())
        vouched = last is not None and not ev.tmpfs_dirty and not mapped and sid not in self._tmpfs_mapped
        (self._tmpfs_mapped.add if mapped else self._tmpfs_mapped.discard)(sid)
        fingerprint = last if vouched and last is not None else mounts.fingerprint(turn.init_host_pid)
        self._fingerprints[sid] = fingerprint
        return fingerprint

    def _tmpfs_change(self, turn: TurnEnd, now: mounts.Tmpfs) -> str:
        known = self._tmpfs.get(turn.sandbox_id)
        if known is None:
            if not now.content:
                return ""
            return f"{now.content} appeared on a tmpfs: only a process checkpoint keeps it"
        if now.digest == known:
            return ""
        what = f" ({now.content} ...)" if now.content else ""
        return f"the sandbox's tmpfs mounts changed{what}: only a process checkpoint keeps them"

    def _file_changes(self, turn: TurnEnd, ev: Evidence, now: dict[int, Proc]) -> list[str]:
        if ev.files_dirty or turn.head_tree is None:
            return files.changes(turn.upper, turn.head_tree, turn.head_racy_ns, self.limits, turn.lowers)
        writable = sorted({f for p in now.values() for f in p.writable_files})
        if not writable:
            return []
        changed = files.files_unchanged(
            turn.upper, turn.head_tree, turn.head_racy_ns, writable, self.limits.max_entries
        )
        return [f"changed {p}" for p in changed]
