"""Processes the probes vouch for: a turn end that needs no read of /proc (issue 34, item 5).

Most agent sandboxes run nothing between commands but crab's own processes
(the keeper at PID 1, crab-init) and the session's bash, none of which the
decision counts.  Reading them from /proc at every turn end (status, stat,
threads, I/O, fds, maps: about 20 files) is most of a skip turn's inspector
work, and it can only ever find them as they were, unless one of these
happened, each of which the eBPF probes see:

* a task (process or thread) began in the sandbox and is still alive: the
  probes count every task forked in the sandbox's cgroup and every task that
  exits there, so "as many exits as forks" since the last read means every
  new task is gone again, a thread of the light processes included;
* one of them exec'd another program (an exec event names its tgid);
* a shared mapping of a file open for writing, any write or mutation (the
  files mark), anything on a tmpfs, anything uncertain (ptrace,
  process_vm_writev, io_uring, AIO: the process mark), lost events or a turn
  past the event budget.

So after a read that found only those processes (each single-threaded, none
with a shared writable mapping or io_uring), the next turn end takes the
processes as that read found them when, and only when, the probes watched
the whole turn, saw none of the above, the session's bash is the same
process, and the sandbox's cgroup (and its children) holds the same pids.
The last check is one read per cgroup and covers what counting cannot: a
process that entered the cgroup without being forked in it.  Anything else
reads /proc as before.  Counting is exact, never sampled: the counters only
ever grow, and each is read with one map lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from crabd.inspector.model import Evidence, Proc, TaskCounts
from crabd.util.promtext import labelled_counter


@dataclass(frozen=True)
class Vouched:
    """A /proc read that found only the processes the decision never counts, and when it was taken."""

    container_id: str
    session_pids: frozenset[int]
    procs: dict[int, Proc]
    host_pids: frozenset[int]
    #: The probes' task counters read just before that /proc read.
    tasks: TaskCounts


def light_only(now: dict[int, Proc], light: set[int]) -> bool:
    """Whether a read holds only the uncounted processes, in a state the probes can vouch for."""
    return all(
        pid in light and len(p.tids) == 1 and not (p.writes_mapped or p.maps_tmpfs or p.io_uring or p.aio)
        for pid, p in now.items()
    )


class VouchedProcesses:
    """Per sandbox: the last light-only read, and whether the probes vouch it still holds."""

    def __init__(self, tasks: Callable[[str], TaskCounts | None], host_pids: Callable[[str], list[int]]) -> None:
        self._tasks = tasks
        self._host_pids = host_pids
        self._kept: dict[str, Vouched] = {}
        #: Turn ends that read /proc, and those the probes answered for (``crabctl engine``).
        self.walked = 0
        self.vouched = 0

    def snapshot(self) -> dict[str, int]:
        """How turn ends knew the sandbox's processes: ``read`` from /proc, ``vouched`` for by the probes."""
        return {"read": self.walked, "vouched": self.vouched}

    def prometheus(self) -> str:
        return labelled_counter(
            "crab_inspector_process_reads_total",
            "Turn ends by how the sandbox's processes were known.",
            "how",
            self.snapshot(),
        )

    def tasks_now(self, sandbox_id: str) -> TaskCounts | None:
        return self._tasks(sandbox_id)

    def still(
        self, sandbox_id: str, container_id: str, session_pids: frozenset[int], ev: Evidence, gathered_by: str
    ) -> dict[int, Proc] | None:
        """The kept read's processes if the probes vouch nothing changed them since; else None (read /proc).

        ``gathered_by``: the source of ``ev`` ("ebpf" or "scan"); the scan vouches for nothing.
        """
        kept = self._kept.get(sandbox_id)
        if kept is None or kept.container_id != container_id or kept.session_pids != session_pids:
            return None
        if gathered_by != "ebpf" or ev.files_dirty or ev.tmpfs_dirty or ev.lost or ev.process_notes:
            return None
        if ev.exec_tgids is None or not ev.exec_tgids.isdisjoint(kept.host_pids):
            return None  # one of them is another program now (or too many execs to tell)
        now = self._tasks(sandbox_id)
        if now is None or now[0] != kept.tasks[0] or now[1] - kept.tasks[1] != now[2] - kept.tasks[2]:
            return None  # a task began and lives on (or the probes stopped watching, or watch it anew)
        if frozenset(self._host_pids(container_id)) != kept.host_pids:
            return None
        self.vouched += 1
        return dict(kept.procs)  # the caller's to change; the kept read stays as read

    def read(
        self,
        sandbox_id: str,
        container_id: str,
        session_pids: frozenset[int],
        now: dict[int, Proc],
        light: set[int],
        tasks: TaskCounts | None,
    ) -> None:
        """Record a /proc read (``tasks``: the counters read just before it)."""
        self.walked += 1
        if tasks is not None and now and light_only(now, light):
            self._kept[sandbox_id] = Vouched(
                container_id, session_pids, now, frozenset(p.host_pid for p in now.values()), tasks
            )
        else:
            self._kept.pop(sandbox_id, None)

    def forget(self, sandbox_id: str) -> None:
        self._kept.pop(sandbox_id, None)
