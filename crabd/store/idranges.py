"""Host id ranges for user-namespaced sandboxes: one range per running container, unique on the host.

A runc sandbox's root is host uid ``base`` (docs/runc.md, "User
namespaces").  This module hands out those bases so that no two containers
on one host ever share a host id: each claim is one file, made with
O_EXCL, in one host-wide directory (default ``/var/lib/crab/userns``)::

    <dir>/
        <slot>          one claim: JSON {"owner": "<container id>", "pid": <crabd pid>, "at": <unix time>}
        owners/<owner>  the index: the slot number of <owner>'s claim, as decimal text (written
                        after the claim; a hint, always checked against the claim it names)
        .lock           flock(2) while a claim is chosen (claims are still O_EXCL: the lock only
                        keeps two crabds from racing to the same free slot and both retrying)

The claim files are the truth; the index only makes "which slot is this
owner's?" one small read instead of a read of every claim on the host (a
create and a removal ask it, and a host runs a thousand sandboxes).  An
index entry that is missing (a claim made before the index existed, or a
crash between the two writes) costs a full scan on release; one that is
stale (its claim gone or another owner's) is ignored and replaced.

Slot ``n`` is host ids ``[FIRST_BASE + n * RANGE_SIZE, FIRST_BASE + (n+1) * RANGE_SIZE)``:
65536 ids each (a whole 16-bit id space inside, as Docker's ``userns-remap`` and
``/etc/subuid`` give), from 2^24 up (above any id a distribution hands out to users).

Why a directory and not a table of crabd's SQLite store: several crabd
instances (the service, test daemons) share one host, each with its own
store; a range must be unique among all of them, and survive their
restarts.  O_EXCL in one directory gives both without a shared database.

Why per container (not per tenant, not per sandbox lineage): on disk nothing
depends on the range (idmapped mounts keep in-sandbox ids on disk, and a
restore rewrites the range in the process images, :mod:`crabd.backends.runc.userns_image`),
so a fork or restore may get any range; and the kernel counts some limits
per host uid (RLIMIT_NPROC and the key quotas: per uid within a user namespace's
ucounts), which a shared range would let one sandbox exhaust for another.
A range is released when its container is removed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from crabd.errors import ContainerRuntimeError

DEFAULT_DIR = Path("/var/lib/crab/userns")
FIRST_BASE = 1 << 24
RANGE_SIZE = 1 << 16
#: Slots up to host id 2^32 - 2 (4294967295 is "no id"; the last range stops short of it).
MAX_SLOTS = ((1 << 32) - 1 - FIRST_BASE) // RANGE_SIZE - 1
_LOCK = ".lock"
#: Bytes read of a claim file (a few hundred at most; anything longer is not crab's).
_MAX_CLAIM = 4096
_INDEX = "owners"
#: An owner is a container id; it names a file of the index, so it is held to a file name's letters.
_OWNER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")


def _check_owner(owner: str) -> None:
    if not _OWNER_RE.fullmatch(owner):
        raise ContainerRuntimeError(f"not a valid id range owner: {owner!r}", container=owner[:200])


@dataclass(frozen=True)
class Claim:
    """A claimed range: ``slot`` and the host ids ``base .. base + size - 1`` it stands for."""

    slot: int
    owner: str

    @property
    def base(self) -> int:
        return FIRST_BASE + self.slot * RANGE_SIZE

    @property
    def size(self) -> int:
        return RANGE_SIZE


class IdRanges:
    """The host-wide claims in ``directory`` (see the module's docstring).  Thread- and process-safe."""

    def __init__(self, directory: Path = DEFAULT_DIR, *, slots: int = MAX_SLOTS) -> None:
        if not 0 < slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_SLOTS}")
        self.directory = directory
        self.slots = slots

    def _dir(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.directory

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self._dir() / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _slots(self) -> set[int]:
        return {int(n) for n in os.listdir(self._dir()) if n.isdigit() and len(n) <= 6}

    def _index(self, owner: str) -> Path:
        return self.directory / _INDEX / owner

    def claim(self, owner: str) -> Claim:
        """A free range for ``owner`` (a container id), or the one it holds already.

        Steps: under the lock, the owner's own claim if the index names one
        (a retried start keeps its range); else the lowest free slot, made
        with O_EXCL, and then its index entry.
        """
        _check_owner(owner)
        with self._locked():
            held = self.find(owner)
            if held is not None:
                return held
            taken = self._slots()
            record = json.dumps({"owner": owner, "pid": os.getpid(), "at": int(time.time())}).encode()
            for slot in range(self.slots):
                if slot in taken:
                    continue
                try:
                    fd = os.open(self.directory / str(slot), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                except FileExistsError:
                    continue
                try:
                    os.write(fd, record)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self._write_index(owner, slot)
                return Claim(slot, owner)
        raise ContainerRuntimeError(
            f"no free user-namespace id range for {owner} ({self.slots} ranges of {RANGE_SIZE} ids in use)",
            container=owner,
            hint=f"Remove sandboxes that are no longer needed, or look for stale claims in {self.directory}.",
        )

    def _write_index(self, owner: str, slot: int) -> None:
        # Not fsynced: after a power loss a missing entry only costs release a scan (see the module's docstring).
        index = self.directory / _INDEX
        index.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(index / owner, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, str(slot).encode())
        finally:
            os.close(fd)

    def _read(self, slot: int) -> str | None:
        """The owner named by ``slot``'s claim; None if there is none or it is not crab's."""
        try:
            with open(self.directory / str(slot), "rb") as f:
                data = json.loads(f.read(_MAX_CLAIM))
        except (OSError, ValueError):
            return None
        owner = data.get("owner") if isinstance(data, dict) else None
        return owner if isinstance(owner, str) else None

    def find(self, owner: str) -> Claim | None:
        """``owner``'s claim as the index names it (checked against the claim), if it holds one."""
        if not _OWNER_RE.fullmatch(owner):
            return None
        try:
            fd = os.open(self._index(owner), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            text = os.read(fd, 16).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        if not text.isdigit() or len(text) > 6:
            return None
        slot = int(text)
        return Claim(slot, owner) if self._read(slot) == owner else None

    def _scan(self, owner: str) -> list[int]:
        """Every slot whose claim names ``owner``: the slow path, for claims the index does not name."""
        return [slot for slot in sorted(self._slots()) if self._read(slot) == owner]

    def release(self, owner: str) -> bool:
        """Give ``owner``'s range back (call once nothing of it runs); False if it held none.

        The indexed claim if there is one; else every claim that names
        ``owner`` (made before the index, or its entry lost in a crash).
        """
        if not _OWNER_RE.fullmatch(owner):
            return False
        with self._locked():
            held = self.find(owner)
            slots = [held.slot] if held is not None else self._scan(owner)
            for slot in slots:
                (self.directory / str(slot)).unlink(missing_ok=True)
            self._index(owner).unlink(missing_ok=True)
            return bool(slots)

    def owners(self, prefix: str = "") -> dict[str, Claim]:
        """Every claim whose owner starts with ``prefix`` (one crabd instance's: ``<instance>-``)."""
        out: dict[str, Claim] = {}
        for slot in sorted(self._slots()):
            owner = self._read(slot)
            if owner is not None and owner.startswith(prefix):
                out[owner] = Claim(slot, owner)
        return out
