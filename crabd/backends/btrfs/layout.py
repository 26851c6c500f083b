"""crab's names inside a btrfs pool, and the rules that keep them safe.

On-disk layout (the pool is one btrfs file system, mounted at
``[btrfs] mount_point``; only crab writes to it)::

    <mount_point>/                  top-level subvolume (id 5)
        sandboxes/                  plain directory
            <sandbox-id>/           subvolume, writable: the sandbox's overlay upper/ and work/
            tmp-<sandbox-id>-<hex>  being made; renamed to <sandbox-id> once complete
        snapshots/                  plain directory
            <checkpoint-id>/        subvolume, read-only: a filesystem checkpoint
            tmp-<checkpoint-id>-<hex>

A visible name (one without ``tmp-``) is always complete: every subvolume is
made under a ``tmp-`` name and published with ``renameat2(RENAME_NOREPLACE)``.
A crash leaves at worst a ``tmp-`` entry, which orphan clean-up deletes.

Ids are crab-generated (``secrets.token_hex``, ``ck-...``), but they are
still validated here: one path component of a small alphabet, never ``.``,
``..``, a slash, or the ``tmp-`` prefix.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from enum import StrEnum

from crabd.errors import InvalidRequest

#: An id: what crab generates, with room to spare; no dots, so never "." or "..".
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}\Z")
#: Prefix of a half-made subvolume's name.
TMP_PREFIX = "tmp-"


class SubvolKind(StrEnum):
    """What a subvolume holds; the value is its directory under the mount point."""

    SANDBOX = "sandboxes"
    SNAPSHOT = "snapshots"


def validate_id(value: str) -> str:
    """``value`` if it is a usable id, else :class:`InvalidRequest`."""
    if not isinstance(value, str) or not ID_RE.match(value) or value.startswith(TMP_PREFIX):
        raise InvalidRequest(f"{value!r} is not a valid btrfs pool id (letters, digits, '_' and '-'; no 'tmp-')")
    return value


@dataclass(frozen=True)
class SubvolRef:
    """One crab subvolume: its kind and id (validated on construction)."""

    kind: SubvolKind
    id: str

    def __post_init__(self) -> None:
        validate_id(self.id)

    @classmethod
    def sandbox(cls, sandbox_id: str) -> SubvolRef:
        return cls(SubvolKind.SANDBOX, sandbox_id)

    @classmethod
    def snapshot(cls, checkpoint_id: str) -> SubvolRef:
        return cls(SubvolKind.SNAPSHOT, checkpoint_id)

    @property
    def relpath(self) -> str:
        """``<kind dir>/<id>``, relative to the mount point."""
        return f"{self.kind.value}/{self.id}"

    def tmp_name(self) -> str:
        """A fresh name to build this subvolume under before publishing it."""
        return f"{TMP_PREFIX}{self.id}-{secrets.token_hex(4)}"


def is_tmp_name(name: str) -> bool:
    return name.startswith(TMP_PREFIX)


def is_id(name: str) -> bool:
    return bool(ID_RE.match(name)) and not is_tmp_name(name)
