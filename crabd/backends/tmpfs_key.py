"""The CRIU external-mount key of a tmpfs a dump found exactly as runc made it (runc/tmpfs_copies.py).

CRIU saves each tmpfs with a ``tar | gzip`` while the sandbox is frozen and
extracts it at every restore (about 5 ms and 4 ms each on this host kind).
When a tmpfs holds only what runc put there (runc's cgroup tmpfs: a
directory per hierarchy, each covered by its mount; an unused /dev/shm;
/dev: its links, and the directories and files its mounts cover) all there
is to it fits in a key, and a restore mounts a fresh tmpfs with that
content.  Its owner is the sandbox's root by construction, never the key's
to say.

Key (``:`` between the fields, ``+`` between the entries)::

    crab-tmpfs:<mount point>:<root's mode, octal>:<root's mtime, ns>:<entry>+<entry>...

    entry:  d=<name>                      a directory that a mount covers
            f=<name>                      a file that a mount covers (a bind of a device node)
            l=<name>=<target>=<mtime ns>  a symbolic link, the sandbox's root's

The mount point makes each key one mount's: CRIU maps a key to one source,
and two mounts must never share a tmpfs.  What a covering mount hides is
runc's (a sandbox holds no CAP_SYS_ADMIN to unmount it), so only its name
and type matter.  Keys come back from images, which may be a tenant's
archive: :meth:`TmpfsCopy.parse` accepts plain names and link targets only,
and a bounded number of entries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

#: A name in the tmpfs: no "/", nor the key's separators (":", "+", "="), nor "]" (CRIU's key ends there).
_NAME_RE = re.compile(r"[A-Za-z0-9_,@-][A-Za-z0-9_.,@-]{0,63}")
#: A link's target: a path of such characters ("/proc/self/fd/0", "pts/ptmx").
_TARGET_RE = re.compile(r"[A-Za-z0-9_.,@/-]{1,255}")
#: A tmpfs copy's mount point: a plain absolute path.
_POINT_RE = re.compile(r"(/[A-Za-z0-9_,@-][A-Za-z0-9_.,@-]{0,63}){1,8}")
#: More entries than runc ever puts in one tmpfs (/dev: 14 here): a key with more is not crab's.
MAX_ENTRIES = 48
_MAX_NS = 1 << 63

EntryKind = Literal["dir", "file", "link"]
_CODES: dict[EntryKind, str] = {"dir": "d", "file": "f", "link": "l"}
_KINDS: dict[str, EntryKind] = {code: kind for kind, code in _CODES.items()}


@dataclass(frozen=True)
class CopyEntry:
    """One entry of a tmpfs copy's root directory."""

    kind: EntryKind
    name: str
    #: A link's target and mtime; "" and 0 for the others.
    target: str = ""
    mtime_ns: int = 0

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"tmpfs copy: {self.name!r} is not a plain name")
        if self.kind == "link":
            if not _TARGET_RE.fullmatch(self.target) or not 0 <= self.mtime_ns < _MAX_NS:
                raise ValueError(f"tmpfs copy: link {self.name!r} to {self.target!r} at {self.mtime_ns}")
        elif self.target or self.mtime_ns:
            raise ValueError(f"tmpfs copy: a {self.kind} {self.name!r} with a target or mtime")

    @property
    def text(self) -> str:
        code = _CODES[self.kind]
        return f"{code}={self.name}={self.target}={self.mtime_ns}" if self.kind == "link" else f"{code}={self.name}"

    @classmethod
    def parse(cls, text: str) -> CopyEntry:
        parts = text.split("=")
        kind = _KINDS.get(parts[0])
        if kind == "link" and len(parts) == 4 and re.fullmatch(r"[0-9]{1,19}", parts[3]):
            return cls(kind, parts[1], parts[2], int(parts[3]))
        if kind in ("dir", "file") and len(parts) == 2:
            return cls(kind, parts[1])
        raise ValueError(f"tmpfs copy: malformed entry {text!r}")


@dataclass(frozen=True)
class TmpfsCopy:
    """A tmpfs's content in a key (see the module)."""

    PREFIX = "crab-tmpfs"

    #: Where it is mounted, as the sandbox sees it.
    point: str
    #: Permission bits of its root (sticky, setgid included).
    mode: int
    #: Its root's modification time, in nanoseconds since the epoch.
    mtime_ns: int
    #: Its root's entries, sorted by name.
    entries: tuple[CopyEntry, ...] = ()

    def __post_init__(self) -> None:
        if not _POINT_RE.fullmatch(self.point):
            raise ValueError(f"tmpfs copy: {self.point!r} is not a plain absolute path")
        if not 0 <= self.mode <= 0o7777 or not 0 <= self.mtime_ns < _MAX_NS:
            raise ValueError(f"tmpfs copy: mode {self.mode:o} or mtime {self.mtime_ns} out of range")
        names = [e.name for e in self.entries]
        if len(names) > MAX_ENTRIES or names != sorted(set(names)):
            raise ValueError("tmpfs copy: entries not a short list sorted by distinct names")

    @property
    def key(self) -> str:
        entries = "+".join(e.text for e in self.entries)
        return f"{self.PREFIX}:{self.point}:{self.mode:o}:{self.mtime_ns}:{entries}"

    @classmethod
    def is_key(cls, key: str | None) -> bool:
        return key is not None and key.startswith(cls.PREFIX + ":")

    @classmethod
    def parse(cls, key: str) -> TmpfsCopy:
        """The copy a key describes (:meth:`is_key` first); ValueError for a malformed one."""
        parts = key.split(":")
        if len(parts) != 5 or parts[0] != cls.PREFIX:
            raise ValueError(f"malformed tmpfs copy key {key!r}")
        _, point, mode, mtime, entries = parts
        if not re.fullmatch(r"[0-7]{1,4}", mode) or not re.fullmatch(r"[0-9]{1,19}", mtime):
            raise ValueError(f"malformed tmpfs copy key {key!r}")
        if entries.count("+") >= MAX_ENTRIES:
            raise ValueError(f"tmpfs copy: more than {MAX_ENTRIES} entries")
        listed = tuple(CopyEntry.parse(e) for e in entries.split("+")) if entries else ()
        return cls(point, int(mode, 8), int(mtime), listed)
