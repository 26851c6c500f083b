"""What the inspector works with: process snapshots, the evidence of a turn, and decisions."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from crabd.models import DecisionKind

SKIP, FS, FULL = DecisionKind.SKIP, DecisionKind.FS, DecisionKind.FULL


@dataclass(frozen=True)
class Proc:
    """One process of a sandbox at one moment (from /proc)."""

    pid: int  # inside the sandbox's pid namespace
    host_pid: int
    ppid: int
    start: int  # clock ticks after boot: tells a process from a later one with the same pid
    cmd: str  # command line, shortened
    runtime_ns: int  # CPU time of its current threads (schedstat)
    tids: frozenset[int]  # thread ids (host): a thread that came or went means the process ran
    io: tuple[int, ...] | None = None  # rchar, wchar, syscr, syscw (procs.io_counters)
    io_uring: bool = False
    aio: bool = False
    traced: bool = False
    foreign_shared: str = ""  # a writable shared mapping of a file outside the sandbox
    writes_mapped: bool = False  # a shared file mapping it may write through (no syscall needed)
    maps_tmpfs: bool = False  # a shared mapping of a file on the sandbox's tmpfs mounts (ditto)
    writable_files: tuple[str, ...] = ()  # regular files open for writing (paths inside the sandbox)
    open_files: tuple[str, ...] = ()  # regular files open or mapped, any mode
    fds: frozenset[str] = frozenset()  # every open fd and what it is (a socket accepted, a file opened...)

    def key(self) -> tuple[int, int]:
        return self.pid, self.start


#: (which tracking of the sandbox, tasks forked, tasks exited) as the probes counted them: two
#: readings of one tracking say whether every task begun in between is gone (inspector/vouched.py).
TaskCounts = tuple[int, int, int]
#: (which tracking, how many operations so far that may change a process's memory while it does not run:
#: ptrace, process_vm_writev, /proc/<pid>/mem, io_uring, AIO), counted by the probes per sandbox.
MemoryWrites = tuple[int, int]


@dataclass
class Evidence:
    """What a turn's events say (since the previous decision for the sandbox)."""

    #: Something may have changed files: compare the upper dir with the head's index.
    files_dirty: bool = False
    #: Why (the first few mutations, for the explanation).
    file_notes: list[str] = field(default_factory=list)
    #: Evidence that processes or memory changed beyond what /proc shows (ptrace, io_uring, ...).
    process_notes: list[str] = field(default_factory=list)
    #: Something may have changed the tmpfs and mqueue mounts: fingerprint them again
    #: (``mounts.py``).  True unless probes watched the whole turn and saw nothing of the kind.
    tmpfs_dirty: bool = True
    #: Short-lived processes seen (for the explanation).
    ran: list[str] = field(default_factory=list)
    events: int = 0
    lost: int = 0
    #: Processes forked and exited in the sandbox (counted by the probes).
    forks: int = 0
    exits: int = 0
    #: Host tgids of the processes that exec'd (None: more than the probes' source keeps).
    exec_tgids: set[int] | None = field(default_factory=set)
    #: The source that gathered it ("ebpf" or "scan"): the decision is that inspector's.
    inspector: str = ""


@dataclass
class Baseline:
    """The process state a sandbox's head process image stands for."""

    procs: dict[int, Proc]
    image: str | None  # the process image (manifest blob) that holds them
    image_checkpoint: str | None
    #: Memory digests of the processes (scan inspector only; see decide.py).
    memory: dict[int, str] = field(default_factory=dict)


@dataclass
class Dumped:
    """A process dump's baseline, taken while the sandbox was frozen; its image id comes at publication."""

    baseline: Baseline
    tmpfs: str


@dataclass
class Decision:
    kind: DecisionKind
    reasons: list[str]
    inspector: str
    seconds: float = 0.0
    #: For an fs decision with live processes: the checkpoint whose process image it pairs with.
    paired_with: str | None = None
    paired_image: str | None = None
    #: The other inspector's verdict, when crabd runs both (evaluation).
    shadow: dict[str, Any] | None = None

    def to_json(self) -> str:
        # By hand: dataclasses.asdict deep-copies, and this runs twice per turn.
        fields = {
            "kind": self.kind,
            "reasons": self.reasons,
            "inspector": self.inspector,
            "seconds": self.seconds,
            "paired_with": self.paired_with,
            "paired_image": self.paired_image,
            "shadow": self.shadow,
        }
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Decision:
        data = json.loads(text)
        return cls(**{**data, "kind": DecisionKind(data["kind"])})
