"""A checkpoint's manifest in the remote tier: what it is and every blob it needs.

Bucket layout (every key under the configured ``[remote] prefix``)::

    blobs/<hh>/<64 hex>         one blob: a zstd frame of its content; <hex> = SHA-256 of the content,
                                the same address and framing as the local store (store/fsblobs.py)
    checkpoints/<id>.json.zst   one manifest per checkpoint (this module), zstd-compressed JSON

Every object is written once with a conditional put (``If-None-Match: *``)
and never changed, so two hosts uploading the same blob is harmless and a
manifest, once visible, always names the same checkpoint.  A manifest is
uploaded only after every blob it names, so a visible manifest means a
complete checkpoint: that is what ``remote`` means.

Manifest document (``format`` = :data:`FORMAT`)::

    {"format": "crab-checkpoint/1",
     "host": "<host id that took it>",
     "checkpoint": {id, sandbox_id, sandbox_name, owner_uid, parent_id, branch, turn, kind,
                    created_at, label, image, spec_json, index_blob, delta_blob, session_blob,
                    process_blob, racy_ns, stats},
     "blobs": {"<hex>": <content size>, ...},       -- every blob the checkpoint needs (its closure)
     "edges": {"<parent hex>": ["<child hex>", ...]},  -- which of them name others (as blob_edges)
     "seal": "<the uploader's signature of the rest>"}  -- crabd/trust/seals.py ("" = unsealed)

``checkpoint.provenance`` is its producer's signed statement (crabd/trust/provenance.py).
A manifest whose seal or provenance does not verify under a key this host trusts is
fetched without its process image (crabd/coordinator/replication.py).

The bucket is shared by the hosts of one cluster and written only by their
crabds, but a manifest is still parsed as untrusted input: strict schema,
bounded size, addresses checked, the edges closed over the blob set, every
root present.  Blob contents are verified against their address when
fetched, exactly as local reads are.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crabd.errors import StoreError
from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store.blobs import valid_address

FORMAT = "crab-checkpoint/1"
#: Largest manifest accepted, compressed and decompressed (a checkpoint of ~1M blobs).
MAX_MANIFEST_BYTES = 256 << 20

#: Largest provenance statement or seal a record or manifest carries.
MAX_PROVENANCE = 1 << 20
#: The seal a manifest read from outside gets when it is not byte for byte as crab writes it
#: (crabd/trust/seals.py then refuses its process images, whatever seal it carried).
VOID_SEAL = "void: the manifest is not byte for byte as crab writes it"

_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


def valid_checkpoint_id(ckpt_id: str) -> bool:
    """Whether ``ckpt_id`` can name a manifest key (crab's ids: ``ck-`` and lower hex/alnum)."""
    return 0 < len(ckpt_id) <= 64 and ckpt_id.startswith("ck-") and set(ckpt_id) <= _ID_CHARS


def blob_key(hex_: str) -> str:
    return f"blobs/{hex_[:2]}/{hex_}"


def manifest_key(ckpt_id: str) -> str:
    if not valid_checkpoint_id(ckpt_id):
        raise StoreError(f"{ckpt_id!r} is not a checkpoint id", hint="Checkpoint ids look like ck-0123abcd...")
    return f"checkpoints/{ckpt_id}.json.zst"


MANIFEST_PREFIX = "checkpoints/"
MANIFEST_SUFFIX = ".json.zst"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RemoteCheckpoint(_Strict):
    id: str
    sandbox_id: str = Field(max_length=128)
    sandbox_name: str = Field(max_length=256)
    owner_uid: int = Field(ge=0, le=(1 << 32) - 1)
    parent_id: str | None
    branch: int = Field(ge=0)
    turn: int = Field(ge=0)
    kind: CheckpointKind
    created_at: float
    label: str = Field(max_length=4096)
    image: str = Field(max_length=1024)
    spec_json: str = Field(max_length=1 << 20)
    index_blob: str
    delta_blob: str
    session_blob: str | None
    process_blob: str | None
    racy_ns: int
    stats: dict[str, Any]
    #: Its producer's signed statement (crabd/trust/provenance.py), carried as it came ("" = none).
    provenance: str = Field(default="", max_length=MAX_PROVENANCE)


class Manifest(_Strict):
    format: Literal["crab-checkpoint/1"]
    host: str = Field(min_length=1, max_length=63)
    checkpoint: RemoteCheckpoint
    blobs: dict[str, int]
    edges: dict[str, list[str]]
    #: The uploading host's signature of this whole document less ``seal`` (crabd/trust/seals.py).
    seal: str = Field(default="", max_length=MAX_PROVENANCE)

    @property
    def roots(self) -> set[str]:
        c = self.checkpoint
        return {b for b in (c.index_blob, c.delta_blob, c.session_blob, c.process_blob) if b}

    def record(self, *, parent_id: str | None) -> CheckpointRecord:
        """The catalog record of this checkpoint on a host that imports it (``parent_id``: its parent there)."""
        c = self.checkpoint
        stats = {**c.stats, "imported_from": self.host, "remote_parent": c.parent_id}
        return CheckpointRecord(**{**c.model_dump(), "parent_id": parent_id, "stats": stats})


#: Stats an import adds to a checkpoint (see Manifest.record), not the checkpoint's own.
IMPORT_STATS = ("imported_from", "remote_parent")


def remote_record(rec: CheckpointRecord) -> RemoteCheckpoint:
    """A local checkpoint's record as a manifest (or a portable archive, store/archive.py) carries it."""
    return RemoteCheckpoint(
        **{name: getattr(rec, name) for name in RemoteCheckpoint.model_fields if name != "stats"},
        stats={k: v for k, v in rec.stats.items() if k not in IMPORT_STATS},
    )


def build(rec: CheckpointRecord, host: str, sizes: dict[str, int], edges: dict[str, list[str]]) -> Manifest:
    """The manifest of a local checkpoint whose closure is ``sizes`` (blob -> size) with ``edges``."""
    return Manifest(
        format=FORMAT,
        host=host,
        checkpoint=remote_record(rec),
        blobs=dict(sorted(sizes.items())),
        edges={p: sorted(kids) for p, kids in sorted(edges.items()) if kids},
    )


def _text(manifest: Manifest) -> bytes:
    return json.dumps(manifest.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


def encode(manifest: Manifest) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(_text(manifest))


def decode(data: bytes, *, expect_id: str) -> Manifest:
    """Parse and check a manifest fetched from the bucket; StoreError naming the checkpoint if it is not sound."""
    try:
        # max_output_size bounds only a frame that does not declare its size: one that does is
        # decompressed whole, whatever it declares, so that declaration is checked first.
        if zstandard.frame_content_size(data) > MAX_MANIFEST_BYTES:
            raise zstandard.ZstdError(f"it decompresses to more than {MAX_MANIFEST_BYTES} bytes")
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_MANIFEST_BYTES)
        manifest = Manifest.model_validate(json.loads(raw))
    except (zstandard.ZstdError, ValueError, ValidationError) as exc:
        raise StoreError(
            f"the remote manifest of checkpoint {expect_id} is damaged or not crab's: {str(exc)[:300]}",
            hint="The checkpoint cannot be fetched from the remote store; restore another one.",
        ) from exc
    problem = _problem(manifest, expect_id)
    if problem:
        raise StoreError(
            f"the remote manifest of checkpoint {expect_id} is inconsistent: {problem}",
            hint="The checkpoint cannot be fetched from the remote store; restore another one.",
        )
    if raw != _text(manifest):
        # Not byte for byte what crab writes: voided, as store/archive.py's decode_manifest does.
        manifest = manifest.model_copy(update={"seal": VOID_SEAL})
    return manifest


def _problem(m: Manifest, expect_id: str) -> str:
    """What is wrong with ``m`` (empty if nothing)."""
    if m.checkpoint.id != expect_id:
        return f"it names checkpoint {m.checkpoint.id!r}"
    return closure_problem(m.blobs, m.edges, m.roots)


def closure_problem(blobs: dict[str, int], edges: dict[str, list[str]], roots: set[str]) -> str:
    """What is wrong with a blob list (blob -> size) and its edges as the closure of ``roots`` ("" if nothing)."""
    bad = next((b for b in blobs if not valid_address(b)), None)
    if bad is not None:
        return f"{bad[:80]!r} is not a blob address"
    if any(size < 0 for size in blobs.values()):
        return "a blob has a negative size"
    missing = roots - blobs.keys()
    if missing:
        return f"its blob list lacks {sorted(missing)[0]}, which the checkpoint names"
    for parent, kids in edges.items():
        if parent not in blobs or not set(kids) <= blobs.keys():
            return f"the edges of {parent[:80]!r} leave its blob list"
    return ""


def record_from_meta(meta: dict[str, Any]) -> CheckpointRecord:
    """A remote-only checkpoint's record, from what ``remote_index`` keeps of its manifest."""
    fields = {k: v for k, v in meta.items() if k != "host"}
    c = RemoteCheckpoint.model_validate(fields)
    rec = Manifest(format=FORMAT, host=str(meta.get("host") or "?"), checkpoint=c, blobs={}, edges={}).record(
        parent_id=c.parent_id
    )
    return replace(rec, remote=True, remote_only=True, host=str(meta.get("host") or ""))


def manifest_meta(m: Manifest) -> dict[str, Any]:
    """What the local index of remote checkpoints keeps of a manifest (everything but the blob lists)."""
    return {"host": m.host, **m.checkpoint.model_dump(mode="json")}
