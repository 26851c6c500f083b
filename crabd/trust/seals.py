"""Seals: the writing host's signature of a whole archive manifest or bucket manifest.

A seal is a JSON text in the manifest's ``seal`` field (``store/archive.py``,
``store/remote/manifest.py``)::

    {"host": "<writing host>", "key": "<key id>", "sig": "<base64 Ed25519 signature>", "v": 1}

(exactly as ``json.dumps(..., sort_keys=True)`` writes it).  The signature is of DOMAIN +
host + NUL + the manifest's canonical JSON with ``seal`` = "", DOMAIN being
``crab-seal/archive/1\\0`` for an archive and ``crab-seal/bucket/1\\0`` for a bucket
manifest (a signature of one can never pass as the other).  The canonical JSON is the
manifest as parsed, re-encoded with sorted keys and no spaces: the signature covers what the
manifest *means* to crab (every checkpoint record and its provenance text, every blob address
and size, every edge, every member's size and hash, the host fields), so a byte changed in
any of them fails it.  The manifest must also be byte for byte its canonical JSON (else
its decoder voids the seal: ``VOID_SEAL``), so a byte changed without changing the meaning (an escape, the spelling of
a number) fails too.  A blob member's bytes are covered by its hash in the manifest and by
its content address (both checked while it streams, ``store/archive_tar.py``).  A bucket
manifest is checked as decompressed: the document is what is sealed (a zstd frame that
decodes to the very same bytes is the same manifest).

Why a seal beside the provenance (``crabd/trust/provenance.py``): the provenance statement
is per checkpoint and travels unchanged from host to host; the seal says that *this*
manifest, with these closures, was written by a trusted host's crabd.  An archive re-exported
by a host is sealed by that host, while its checkpoints keep their producers' statements.

**The rule** (:func:`archive_refusals`, :func:`bucket_refusal`): a checkpoint's process image
is taken only when the manifest's seal and the checkpoint's provenance both verify under keys
this host trusts; otherwise it comes with files and session only, and the reason is reported.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from crabd.models import CheckpointKind
from crabd.store.archive import ArchiveManifest, reachable
from crabd.store.remote.manifest import VOID_SEAL, Manifest, RemoteCheckpoint
from crabd.trust.keys import KeyRing
from crabd.trust.provenance import strict_b64, verify

ARCHIVE_DOMAIN = b"crab-seal/archive/1\0"
_NOT_CANONICAL = "its manifest is not byte for byte as crab writes it (it was changed)"
BUCKET_DOMAIN = b"crab-seal/bucket/1\0"


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps({**doc, "seal": ""}, sort_keys=True, separators=(",", ":")).encode()


def _message(domain: bytes, host: str, doc: dict[str, Any]) -> bytes:
    # The seal's host label is signed too: no byte of the seal goes unchecked.
    return domain + host.encode("utf-8", "surrogateescape") + b"\0" + _canonical(doc)


def _sign(ring: KeyRing, domain: bytes, doc: dict[str, Any]) -> str:
    kid, sig = ring.sign(_message(domain, ring.host, doc))
    return json.dumps({"v": 1, "host": ring.host, "key": kid, "sig": base64.b64encode(sig).decode()}, sort_keys=True)


def _check(ring: KeyRing, domain: bytes, doc: dict[str, Any], what: str) -> str:
    """Why ``doc``'s seal does not verify ("" if it does)."""
    seal = doc.get("seal") or ""
    if not seal:
        return f"the {what} is not sealed by a crab host"
    if seal == VOID_SEAL:
        return _NOT_CANONICAL
    try:
        s = json.loads(seal)
        kid, host, sig = s["key"], str(s.get("host", "")), strict_b64(s["sig"])
        if s.get("v") != 1 or not isinstance(kid, str):
            raise ValueError("not version 1")
        if json.dumps(s, sort_keys=True) != seal:
            raise ValueError("not in the one form crab writes")
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        return f"the {what}'s seal is not readable: {str(exc)[:200]}"
    problem = ring.verify(kid, _message(domain, host, doc), sig)
    return f"the {what}'s seal (by {host or '?'}): {problem}" if problem else ""


# --- archives ------------------------------------------------------------------------------


def seal_archive(ring: KeyRing, m: ArchiveManifest) -> ArchiveManifest:
    """``m`` sealed by this host (at export)."""
    return m.model_copy(update={"seal": _sign(ring, ARCHIVE_DOMAIN, m.model_dump(mode="json"))})


def archive_refusals(ring: KeyRing, m: ArchiveManifest) -> dict[str, str]:
    """Checkpoint id -> why its process image is not imported, for each of ``m``'s that has one."""
    images = [c for c in m.checkpoints if c.process_blob]
    if not images:
        return {}
    sealed = _check(ring, ARCHIVE_DOMAIN, m.model_dump(mode="json"), "archive")
    out: dict[str, str] = {}
    for c in images:
        why = sealed or _provenance_problem(ring, c)
        if why:
            out[c.id] = why
    return out


def _provenance_problem(ring: KeyRing, c: RemoteCheckpoint) -> str:
    v = verify(ring, c)
    return "" if v.trusted else f"its process image is not from a trusted host: {v.reason}"


# --- the bucket ----------------------------------------------------------------------------


def seal_bucket(ring: KeyRing, m: Manifest) -> Manifest:
    """``m`` sealed by this host (at upload)."""
    return m.model_copy(update={"seal": _sign(ring, BUCKET_DOMAIN, m.model_dump(mode="json"))})


def bucket_refusal(ring: KeyRing, m: Manifest) -> str:
    """Why the process image of the checkpoint ``m`` describes is not taken ("" if it is, or it has none)."""
    if not m.checkpoint.process_blob:
        return ""
    return _check(ring, BUCKET_DOMAIN, m.model_dump(mode="json"), "remote manifest") or _provenance_problem(
        ring, m.checkpoint
    )


def without_process(m: Manifest, reason: str) -> Manifest:
    """``m`` less its process image: kind ``fs``, only the blobs its other roots need, the reason in its stats.

    Its seal no longer matches (it was checked before); the result is only used here.
    """
    c = m.checkpoint
    stats = {**c.stats, "process_image_dropped": reason}
    ck = c.model_copy(update={"kind": CheckpointKind.FS, "process_blob": None, "stats": stats})
    keep = reachable({b for b in (c.index_blob, c.delta_blob, c.session_blob) if b}, m.edges)
    blobs = {b: n for b, n in m.blobs.items() if b in keep}
    edges = {p: kids for p, kids in m.edges.items() if p in keep}
    return m.model_copy(update={"checkpoint": ck, "blobs": blobs, "edges": edges})


def vet_bucket(ring: KeyRing, m: Manifest) -> Manifest:
    """A manifest fetched from the bucket as this host may adopt it: less its process image if refused."""
    why = bucket_refusal(ring, m)
    return without_process(m, why) if why else m
