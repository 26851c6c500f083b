"""Provenance: who produced a checkpoint, signed, and whether this host may restore its processes.

**The statement.** At publication the producing host signs a canonical statement of the
checkpoint (:func:`statement`): everything that decides what a restore or fork does — its
id, kind, image, spec, the addresses of its index, delta, session and process blobs, its
racy tick, branch, turn and time — and, for the record, who produced it (sandbox, owner at
production, parent, host, key).  Stored with the checkpoint in the catalog
(``checkpoints.provenance``) as a JSON text::

    {"v": 1,
     "statement": "<canonical JSON of the statement, exactly the signed text>",
     "key": "<key id: sha256 hex of the signer's raw Ed25519 public key (crabd/trust/keys.py)>",
     "sig": "<base64 Ed25519 signature of b'crab-provenance/1\\0' + statement>"}

The statement is kept as the signed text, not re-serialised, so verifying never depends on
how JSON is re-encoded.  Exports and uploads carry the text unchanged; a host that imports a
checkpoint never signs it again (no laundering: what another host produced stays theirs,
trusted or not).

**Why the blob addresses suffice here, and what covers the rest.** The four roots are
content addresses: every blob below them is named by hash from its parent's content (a
Merkle tree), so the statement commits to every byte the checkpoint restores, provided an
import checks that the declared edges are what the parsed contents name
(``crabd/trust/references.py``).  The closure is not put in the statement: it would cost a
walk of the catalog on every checkpoint's publication, on the hot path.  Instead the
manifests that list closures (an archive's, a bucket object's) are signed as a whole by the
host that wrote them (``crabd/trust/seals.py``), so a changed blob list, size, edge, member
hash or host field there fails the seal even before the references are checked.

**Verification** (:func:`verify`) answers whether the statement is signed by a trusted key
and says what the record says: the decisive fields equal the record's (the process blob and
kind only where the record still has its process image; owner and sandbox only for records
that did not come from an archive, whose owner is the importer).  Process images are
restored only from records that verify (:meth:`Provenance.require`).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from crabd.errors import ProvenanceRefused
from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store.catalog import Catalog
from crabd.trust.keys import KeyRing

log = logging.getLogger("crabd.trust")

FORMAT = "crab-provenance/1"
_DOMAIN = b"crab-provenance/1\0"
#: Largest provenance text read (a statement holds one spec of at most 1 MiB).
MAX_TEXT = 4 << 20
#: Stats that mark a record as having come from another host (an archive or the bucket).
FOREIGN_STATS = ("archive", "imported_from", "remote_parent")

#: Fields whose values decide what a restore does: equal in the statement and the record.
_DECISIVE = ("id", "image", "spec_json", "index_blob", "delta_blob", "session_blob", "racy_ns", "branch", "turn")
#: Compared only while the record still has its process image (an import may have dropped it).
_PROCESS = ("kind", "process_blob")
#: Compared only for records that kept their producer's identity (not an archive's: the importer owns those).
_IDENTITY = ("owner_uid",)


class Signed(Protocol):
    """What a statement is made of: a catalog record or an archive's / bucket's record of one."""

    @property
    def id(self) -> str: ...

    @property
    def sandbox_id(self) -> str: ...

    @property
    def owner_uid(self) -> int: ...

    @property
    def parent_id(self) -> str | None: ...

    @property
    def branch(self) -> int: ...

    @property
    def turn(self) -> int: ...

    @property
    def kind(self) -> CheckpointKind: ...

    @property
    def created_at(self) -> float: ...

    @property
    def image(self) -> str: ...

    @property
    def spec_json(self) -> str: ...

    @property
    def index_blob(self) -> str: ...

    @property
    def delta_blob(self) -> str: ...

    @property
    def session_blob(self) -> str | None: ...

    @property
    def process_blob(self) -> str | None: ...

    @property
    def racy_ns(self) -> int: ...

    @property
    def stats(self) -> dict[str, Any]: ...

    @property
    def provenance(self) -> str: ...


def statement(rec: Signed, host: str, kid: str) -> str:
    """The canonical statement of ``rec`` as ``host`` (key ``kid``) signs it."""
    doc = {
        "format": FORMAT,
        "id": rec.id,
        "sandbox_id": rec.sandbox_id,
        "owner_uid": rec.owner_uid,
        "parent_id": rec.parent_id,
        "branch": rec.branch,
        "turn": rec.turn,
        "kind": str(rec.kind),
        "created_at": rec.created_at,
        "image": rec.image,
        "spec_json": rec.spec_json,
        "index_blob": rec.index_blob,
        "delta_blob": rec.delta_blob,
        "session_blob": rec.session_blob,
        "process_blob": rec.process_blob,
        "racy_ns": rec.racy_ns,
        "host": host,
        "key": kid,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sign(ring: KeyRing, rec: Signed) -> str:
    """The provenance text of ``rec`` signed by this host (the module doc's format)."""
    text = statement(rec, ring.host, ring.key_id)
    kid, sig = ring.sign(_DOMAIN + text.encode())
    return json.dumps({"v": 1, "statement": text, "key": kid, "sig": base64.b64encode(sig).decode()}, sort_keys=True)


@dataclass(frozen=True)
class Verdict:
    """What verifying a record's provenance found."""

    #: Its statement is signed by a trusted key and says what the record says.
    trusted: bool
    #: Why not ("" when trusted).
    reason: str = ""
    #: The producing host and key as the statement names them ("" if there is no readable statement).
    host: str = ""
    key: str = ""


def strict_b64(text: object) -> bytes:
    """Base64 in the one spelling crab writes (padding bits zero): another spelling of the same bytes is refused."""
    if not isinstance(text, str):
        raise ValueError("a signature is not a string")
    raw = base64.b64decode(text, validate=True)
    if base64.b64encode(raw).decode() != text:
        raise ValueError("a signature is not in canonical base64")
    return raw


def _statement_of(text: str) -> tuple[str, str, bytes, dict[str, Any]] | str:
    """(statement text, key id, signature, statement) from a provenance text, or why it is unreadable."""
    if not text:
        return "it has no provenance (published before crab signed checkpoints, or by a host that does not)"
    if len(text) > MAX_TEXT:
        return "its provenance is too large"
    try:
        doc = json.loads(text)
        stmt_text, kid, sig = doc["statement"], doc["key"], strict_b64(doc["sig"])
        if doc.get("v") != 1 or not isinstance(stmt_text, str) or not isinstance(kid, str):
            raise ValueError("not version 1")
        if json.dumps(doc, sort_keys=True) != text:
            raise ValueError("not in the one form crab writes")
        stmt = json.loads(stmt_text)
        if not isinstance(stmt, dict) or stmt.get("format") != FORMAT:
            raise ValueError("not a crab provenance statement")
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        return f"its provenance is not readable: {str(exc)[:200]}"
    return stmt_text, kid, sig, stmt


def verify(ring: KeyRing, rec: Signed) -> Verdict:
    """Whether ``rec``'s provenance makes it trusted (steps: read, signature, fields; module doc)."""
    got = _statement_of(rec.provenance)
    if isinstance(got, str):
        return Verdict(False, got)
    stmt_text, kid, sig, stmt = got
    host, key = str(stmt.get("host", "")), kid
    if stmt.get("key") != kid:
        return Verdict(False, "its statement names another key than the one that signed it", host, key)
    problem = ring.verify(kid, _DOMAIN + stmt_text.encode(), sig)
    if problem:
        return Verdict(False, f"its provenance (produced by {host or '?'}): {problem}", host, key)
    fields = list(_DECISIVE)
    if rec.process_blob:
        fields += _PROCESS
    if not rec.stats.get("archive"):
        fields += _IDENTITY
    for name in fields:
        ours = getattr(rec, name)
        if name == "kind":
            ours = str(ours)
        if stmt.get(name) != ours:
            return Verdict(False, f"its {name} is not what its producer {host or '?'} signed", host, key)
    if stmt.get("created_at") != rec.created_at:
        return Verdict(False, f"its created_at is not what its producer {host or '?'} signed", host, key)
    return Verdict(True, "", host, key)


def foreign(rec: CheckpointRecord) -> bool:
    """Whether ``rec`` came from another host (an archive or the bucket), by the stats an import adds."""
    return any(k in rec.stats for k in FOREIGN_STATS)


class Provenance:
    """The provenance rules as the coordinator applies them: sign at publication, check before a restore."""

    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring

    def sign(self, rec: CheckpointRecord) -> str:
        """The provenance text of a checkpoint this host is publishing now."""
        return sign(self.ring, rec)

    def verify(self, rec: Signed) -> Verdict:
        return verify(self.ring, rec)

    def require(self, rec: CheckpointRecord) -> None:
        """Before a process image is restored: ProvenanceRefused unless ``rec``'s provenance verifies."""
        if not rec.process_blob:
            return
        v = self.verify(rec)
        if not v.trusted:
            raise ProvenanceRefused(
                f"checkpoint {rec.id}'s processes are not restored: {v.reason}",
                checkpoint=rec.id,
                reason=v.reason,
            )

    def describe(self, rec: Signed) -> dict[str, Any]:
        """Who produced ``rec`` and whether this host trusts it (for listings and inspection)."""
        v = self.verify(rec)
        return {"producer": v.host, "key": v.key[:16], "trusted": v.trusted, "reason": v.reason}

    def backfill(self, catalog: Catalog) -> int:
        """At start: sign the checkpoints this host produced before provenance existed; how many.

        Only records with no provenance and no mark of an import (:data:`FOREIGN_STATS`): what
        came from an archive or the bucket is never signed here, so its process images stay
        refused.
        """
        done = 0
        for rec in catalog.list_checkpoints():
            if rec.provenance or foreign(rec):
                continue
            if catalog.set_provenance(rec.id, self.sign(rec)):
                done += 1
        if done:
            log.info("checkpoints of this host signed", extra={"checkpoints": done})
        return done
