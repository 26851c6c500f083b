"""Forging archives for tests: a real export with its manifest rewritten, the blob members as they were."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable
from typing import Any

from crabd.store.archive import MANIFEST_NAME


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
