"""A seeded mutator over real archives (hypothesis is not in the venv): every outcome of an import is
either a clean success whose content is what it says, or a CrabError that changed nothing — never
another exception, never partial state.

Mutations: bytes flipped, inserted or deleted anywhere in the tar stream; manifest fields changed
(inconsistent archives); and blob contents changed then re-packed consistently (tests/archive_forge.py),
so the process image and index decoders see hostile input that every hash vouches for.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crabd.backends.fsdelta import Entry, Extent, Kind, ScanLimits
from crabd.backends.overlay.entries import encode_page, encode_root
from crabd.backends.overlay.index import outline_index
from crabd.errors import CrabError, StoreError
from tests.archive_forge import Opened, open_archive, rewrite_manifest
from tests.fakes import ALICE, run, spec
from tests.unit.test_archive_import import _engines, _export, _import, _stack, _staging_empty, _world

SEED = 33
ROUNDS = 300


def _flip(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _insert(rng: random.Random, data: bytes) -> bytes:
    at = rng.randrange(len(data))
    return data[:at] + rng.randbytes(rng.randint(1, 600)) + data[at:]


def _delete(rng: random.Random, data: bytes) -> bytes:
    at = rng.randrange(len(data))
    return data[:at] + data[at + rng.randint(1, 600) :]


_VALUES: list[Any] = [None, -1, 0, 1, 1 << 40, "", "x" * 300, "ck-" + "0" * 12, [], {}, 3.5, True]


def _mutate_doc(rng: random.Random, doc: dict[str, Any]) -> None:
    """Change one field somewhere in the manifest document (a checkpoint's, a blob size, an edge)."""
    where = rng.choice(["top", "checkpoint", "blobs", "edges"])
    if where == "top":
        doc[rng.choice(list(doc))] = rng.choice(_VALUES)
    elif where == "checkpoint":
        ck = rng.choice(doc["checkpoints"])
        key = rng.choice(list(ck))
        blobs = list(doc["blobs"])
        ck[key] = rng.choice([*_VALUES, rng.choice(blobs)]) if blobs else rng.choice(_VALUES)
    elif where == "blobs" and doc["blobs"]:
        hex_ = rng.choice(list(doc["blobs"]))
        doc["blobs"][hex_] = rng.choice([0, 1, doc["blobs"][hex_] + 1, 1 << 40])
    elif doc["blobs"]:
        parent, child = rng.choice(list(doc["blobs"])), rng.choice(list(doc["blobs"]))
        kids = doc["edges"].setdefault(parent, [])
        if child in kids:
            kids.remove(child)
        else:
            kids.append(child)


def _mutate_blob(rng: random.Random, o: Opened) -> None:
    """Change a metadata blob's content (flip, cut or repeat a run) and re-address it everywhere."""
    ck = o.checkpoint()
    role = rng.choice([k for k in ("process_blob", "index_blob", "session_blob") if ck.get(k)])
    old = ck[role]
    data = bytearray(o.blobs[old])
    if data and rng.random() < 0.5:
        data[rng.randrange(len(data))] = rng.randrange(256)
    elif len(data) > 60:
        at = rng.randrange(12, len(data) - 40)
        data[at:at] = data[at : at + 40] * rng.randint(1, 50)
    new = o.put(bytes(data))
    ck[role] = new
    o.doc["blobs"][new] = o.doc["blobs"].pop(old)
    if old in o.doc["edges"]:
        o.doc["edges"][new] = o.doc["edges"].pop(old)


def test_every_mutated_archive_imports_cleanly_or_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _stack(tmp_path / "a", monkeypatch)
    b = _stack(tmp_path / "b", monkeypatch)
    rng = random.Random(SEED)
    seen: dict[str, int] = {}

    async def check(forged: bytes) -> None:
        before = _world(b)
        try:
            got = await _import(b, ALICE, forged)
        except CrabError as exc:
            seen[type(exc).__name__] = seen.get(type(exc).__name__, 0) + 1
            assert _world(b) == before, f"a refused import changed something: {exc.message}"
            assert _staging_empty(b)
            return
        seen["ok"] = seen.get("ok", 0) + 1
        assert _staging_empty(b)
        for rec in got.checkpoints:
            # Verified content: the files load, the process image writes back within its bound.
            b.fs.load(rec.index_blob)
            if rec.process_blob:
                with tempfile.TemporaryDirectory(dir=tmp_path) as out:
                    b.images.write_from_blobs(rec.process_blob, Path(out))
        for rec in got.checkpoints:
            if rec.id not in got.present:
                await b.service.delete_checkpoint(ALICE, rec.id)

    async def body() -> None:
        async with _engines(a, b):
            rec = await a.service.create(ALICE, spec("srv", checkpoints="fs"))
            a.write(rec.id, "state.txt", "v1")
            full = await a.service.create_checkpoint(ALICE, rec.id, "", "full")
            data = await _export(a, ALICE, full.id)
            mutators: list[Callable[[], bytes]] = [
                lambda: _flip(rng, data),
                lambda: _insert(rng, data),
                lambda: _delete(rng, data),
                lambda: rewrite_manifest(data, lambda d: _mutate_doc(rng, d)),
            ]

            def consistent(change: Callable[[Opened], None]) -> bytes:
                o = open_archive(data)
                change(o)
                return o.pack()

            mutators += [
                lambda: consistent(lambda o: _mutate_doc(rng, o.doc)),
                lambda: consistent(lambda o: _mutate_blob(rng, o)),
                lambda: consistent(lambda o: _mutate_blob(rng, o)),
            ]
            for _ in range(ROUNDS):
                try:
                    forged = rng.choice(mutators)()
                except (KeyError, ValueError, TypeError, IndexError, json.JSONDecodeError):
                    continue  # the forger's tool could not make this one
                await check(forged)
            await check(data)  # and the archive itself imports
            assert seen.get("ok", 0) >= 1 and len(seen) >= 2, seen

    run(body())


def _real_index(n: int, blob: str) -> dict[str, bytes]:
    entries = [
        Entry(b"d%03d/f" % i, Kind.REG, 0o644, 0, 0, 10, 0, 0, 0, 0, 1, extents=[Extent(0, 10, blob)]) for i in range(n)
    ]
    page = encode_page(entries)
    page_hex = hashlib.sha256(page).hexdigest()
    root = encode_root(n, [(page_hex, n)])
    return {"root": root, "page": page, "page_hex": page_hex.encode()}


def test_the_overlay_decoders_refuse_mutated_pages_and_roots_with_store_errors_only() -> None:
    """The index outline on hostile bytes: a StoreError or TooManyEntries (CrabErrors), or a sound outline."""
    rng = random.Random(SEED)
    blob = "ab" * 32
    parts = _real_index(20, blob)
    outcomes: dict[str, int] = {}
    for _ in range(400):
        root, page = bytearray(parts["root"]), bytearray(parts["page"])
        target = root if rng.random() < 0.3 else page
        for _ in range(rng.randint(1, 3)):
            target[rng.randrange(len(target))] = rng.randrange(256)
        page_hex = hashlib.sha256(page).hexdigest()
        if target is page and rng.random() < 0.7:  # keep the root naming the mutated page (hashes vouch)
            root = bytearray(encode_root(20, [(page_hex, 20)]))
        store = {hashlib.sha256(root).hexdigest(): bytes(root), page_hex: bytes(page)}

        def read(hex_: str, limit: int, store: dict[str, bytes] = store) -> bytes:
            if hex_ not in store:
                raise StoreError(f"no blob {hex_}")
            return store[hex_][: limit + 1]

        try:
            out = outline_index(hashlib.sha256(root).hexdigest(), read, ScanLimits(max_entries=1000))
            assert out.entries <= 1000
            outcomes["ok"] = outcomes.get("ok", 0) + 1
        except CrabError as exc:
            outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
    assert outcomes.get("StoreError", 0) > 0, outcomes
