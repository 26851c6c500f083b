"""Sandbox ids that arrive from outside: never another owner's.

A sandbox id names a history (turns, the head, retention policy, failure
records, "the newest checkpoint"), and that history outlives the sandbox.
An archive record, an ``ImportSandbox`` request or a bucket object may name
any id; taking it as given would hand the sender the history of whoever
used the id before.  So at each trust edge the id is compared with what
this host knows of it (the id ledger, ``store/identity.py``, plus the
sandboxes, checkpoints and remote-tier catalog):

* **Archive import** (:func:`reassign`): records naming the id of another
  uid's sandbox that lives here are refused (as they always were: the
  archive is that sandbox's, to be imported elsewhere); records naming an
  id that otherwise belongs to another uid get a fresh id, the same fresh id for every record of that
  foreign id within one import, so their lineage (parent links, turns) stays
  one sandbox's.  An id the importer already owns, or one never seen here,
  is kept: re-importing your own export keeps your sandbox's identity.
* **ImportSandbox and bucket fetches** (:func:`check_arrival`): the
  checkpoint's own sandbox is meant (a migration, a lost host), so a
  foreign id is refused, not renamed.

Which uid an id belongs to: the ledger's owner when the ledger has it (the
first use decides); otherwise any other uid that a sandbox, a checkpoint
or the bucket's catalog associates with it makes it foreign.
"""

from __future__ import annotations

import secrets
from dataclasses import replace

from crabd.errors import PermissionDenied
from crabd.models import CheckpointRecord
from crabd.store.identity import SandboxIds

#: Tries at drawing an unused id (48 random bits: a second try is already unlikely).
_DRAWS = 16


def foreign_owner(ids: SandboxIds, sandbox_id: str, owner_uid: int) -> int | None:
    """Another uid ``sandbox_id`` belongs to, or None if ``owner_uid`` may use it."""
    first = ids.owner(sandbox_id)
    if first is not None:
        return None if first == owner_uid else first
    others = ids.owners(sandbox_id) - {owner_uid}
    return min(others) if others else None


def fresh_id(ids: SandboxIds, avoid: set[str]) -> str:
    """A sandbox id this host has never seen (and not in ``avoid``)."""
    for _ in range(_DRAWS):
        sid = secrets.token_hex(6)
        if sid not in avoid and not ids.taken([sid]):
            return sid
    raise RuntimeError("no unused sandbox id in 16 draws of 48 random bits")  # pragma: no cover


def reassign(
    records: list[CheckpointRecord], owner_uid: int, ids: SandboxIds
) -> tuple[list[CheckpointRecord], dict[str, str]]:
    """``records`` (an archive's, becoming ``owner_uid``'s) with every foreign sandbox id replaced.

    Steps: for each distinct sandbox id of the records, refuse if another
    uid's sandbox with that id lives here (PermissionDenied); else find
    whether it belongs to another uid (:func:`foreign_owner`); draw one fresh id per
    foreign one; rewrite the records' ``sandbox_id`` and note the archive's
    id in their stats (``archive_sandbox_id``).  Returns the records and
    the map old id -> fresh id.
    """
    fresh: dict[str, str] = {}
    for sid in dict.fromkeys(r.sandbox_id for r in records):
        live = ids.live_owner(sid)
        if live is not None and live != owner_uid:
            first = next(r.id for r in records if r.sandbox_id == sid)
            raise PermissionDenied(
                f"checkpoint {first} belongs to sandbox {sid}, which another uid runs on this host, not you"
                f" (uid {owner_uid}); nothing was imported",
                uid=owner_uid,
                checkpoint=first,
                hint="Import it on another host, or ask that sandbox's owner to import it.",
            )
        if foreign_owner(ids, sid, owner_uid) is not None:
            fresh[sid] = fresh_id(ids, set(fresh.values()))
    out = [
        replace(r, sandbox_id=fresh[r.sandbox_id], stats={**r.stats, "archive_sandbox_id": r.sandbox_id})
        if r.sandbox_id in fresh
        else r
        for r in records
    ]
    return out, fresh


def check_arrival(ids: SandboxIds, sandbox_id: str, owner_uid: int, ckpt_id: str) -> None:
    """Refuse to bring checkpoint ``ckpt_id`` here as the history of ``sandbox_id`` for ``owner_uid``
    when that id belongs to another uid (PermissionDenied; nothing is changed)."""
    other = foreign_owner(ids, sandbox_id, owner_uid)
    if other is not None:
        raise PermissionDenied(
            f"checkpoint {ckpt_id} names sandbox {sandbox_id} as uid {owner_uid}'s, but that sandbox id belongs"
            " to another uid on this host; nothing was imported",
            uid=owner_uid,
            sandbox=sandbox_id,
            checkpoint=ckpt_id,
            hint="Sandbox ids are never reused across owners.  Fork the checkpoint instead"
            " (`crabctl fork CKPT`): the fork gets a new id.",
        )
