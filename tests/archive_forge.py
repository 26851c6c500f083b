"""Forging archives for tests: a real export with its manifest rewritten, the blob members as they were
(:func:`rewrite_manifest`), or taken apart and packed again consistently with forged blobs
(:func:`open_archive`, :meth:`Opened.pack`): what a hostile user with a text editor and zstd can make."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zstandard

from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store.archive import MANIFEST_NAME, ArchiveManifest, member_name
from crabd.trust.provenance import Provenance
from crabd.trust.seals import seal_archive


def canonical(doc: dict[str, Any]) -> bytes:
    """A manifest document spelled as crab writes it (so that only its meaning differs from a real one)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def rewrite_manifest(
    data: bytes, change: Callable[[dict[str, Any]], object], encode: Callable[[dict[str, Any]], bytes] | None = None
) -> bytes:
    """``data`` (an archive crab wrote) with ``change`` applied to its manifest document (written by ``encode``)."""
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(data), mode="r:") as src,
        tarfile.open(fileobj=out, mode="w:", format=tarfile.USTAR_FORMAT) as dst,
    ):
        for info in src.getmembers():
            f = src.extractfile(info)
            assert f is not None
            body = f.read()
            if info.name == MANIFEST_NAME:
                doc = json.loads(body)
                change(doc)
                body = encode(doc) if encode is not None else json.dumps(doc).encode()
                info.size = len(body)
            dst.addfile(info, io.BytesIO(body))
    return out.getvalue()


@dataclass
class Opened:
    """An archive taken apart: its manifest document and every blob's content, by address."""

    doc: dict[str, Any]
    blobs: dict[str, bytes] = field(default_factory=dict)

    def put(self, content: bytes) -> str:
        """Add a blob (a forger can make any content it likes); its address."""
        hex_ = hashlib.sha256(content).hexdigest()
        self.blobs[hex_] = content
        return hex_

    def checkpoint(self, i: int = -1) -> dict[str, Any]:
        cks: list[dict[str, Any]] = self.doc["checkpoints"]
        return cks[i]

    def pack(self, signer: Provenance | None = None) -> bytes:
        """A consistent archive again: blob sizes, member sizes and hashes recomputed for what ``blobs`` holds
        (only those the manifest's blob list names, plus any blob the caller added to it).

        With ``signer``, every record is signed and the manifest sealed with that host's key, as a trusted
        host that went rogue would: what is tested is then what crab checks beyond provenance."""
        names = sorted(set(self.doc["blobs"]))
        members: dict[str, dict[str, Any]] = {}
        frames: dict[str, bytes] = {}
        for hex_ in names:
            frame = zstandard.ZstdCompressor(level=3).compress(self.blobs[hex_])
            frames[hex_] = frame
            members[member_name(hex_)] = {"size": len(frame), "sha256": hashlib.sha256(frame).hexdigest()}
        self.doc["blobs"] = {h: len(self.blobs[h]) for h in names}
        self.doc["members"] = members
        if signer is not None:
            self._sign(signer)
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w:", format=tarfile.USTAR_FORMAT) as dst:
            body = canonical(self.doc) if signer is not None else json.dumps(self.doc).encode()
            info = tarfile.TarInfo(MANIFEST_NAME)
            info.size = len(body)
            dst.addfile(info, io.BytesIO(body))
            for hex_ in names:
                info = tarfile.TarInfo(member_name(hex_))
                info.size = len(frames[hex_])
                dst.addfile(info, io.BytesIO(frames[hex_]))
        return out.getvalue()

    def _sign(self, signer: Provenance) -> None:
        for c in self.doc["checkpoints"]:
            rec = CheckpointRecord(**{**c, "kind": CheckpointKind(c["kind"])})
            c["provenance"] = signer.sign(rec)
        self.doc["seal"] = ""
        self.doc["seal"] = seal_archive(signer.ring, ArchiveManifest.model_validate(self.doc)).seal


def open_archive(data: bytes) -> Opened:
    """``data`` (an archive crab wrote) taken apart."""
    opened = Opened(doc={})
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as src:
        for info in src.getmembers():
            f = src.extractfile(info)
            assert f is not None
            body = f.read()
            if info.name == MANIFEST_NAME:
                opened.doc = json.loads(body)
            else:
                hex_ = info.name.removeprefix("blobs/").removesuffix(".zst")
                opened.blobs[hex_] = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 30)
    return opened
