"""The remote tier's manifest: round trip, and refusal of every kind of unsound input (no bucket needed)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import pytest
import zstandard

from crabd.errors import StoreError
from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store.remote import manifest as mf

CK = "ck-0123abcd"


def h(tag: str) -> str:
    return hashlib.sha256(tag.encode()).hexdigest()


INDEX, DELTA, SESSION, PROC, PAGE, LEAF = (h(t) for t in ("index", "delta", "session", "proc", "page", "leaf"))


def record(**kw: Any) -> CheckpointRecord:
    base: dict[str, Any] = {
        "id": CK,
        "sandbox_id": "sb-1",
        "sandbox_name": "one",
        "owner_uid": 1000,
        "parent_id": "ck-parent",
        "branch": 1,
        "turn": 7,
        "kind": CheckpointKind.FULL,
        "created_at": 1234.5,
        "label": "after tests",
        "image": "bookworm",
        "spec_json": '{"cpus": 1}',
        "index_blob": INDEX,
        "delta_blob": DELTA,
        "session_blob": SESSION,
        "process_blob": PROC,
        "racy_ns": 42,
        "stats": {"files": 3, "imported_from": "old-host", "remote_parent": "ck-x"},
    }
    base.update(kw)
    return CheckpointRecord(**base)


def manifest() -> mf.Manifest:
    sizes = {INDEX: 10, DELTA: 20, SESSION: 30, PROC: 40, PAGE: 5, LEAF: 1}
    return mf.build(record(), "host-a", sizes, {INDEX: [PAGE], PAGE: [LEAF], LEAF: []})


def doc() -> dict[str, Any]:
    return manifest().model_dump(mode="json")


def pack(d: object) -> bytes:
    return zstandard.ZstdCompressor().compress(json.dumps(d).encode())


def test_round_trip_keeps_everything_and_drops_import_stats() -> None:
    m = manifest()
    back = mf.decode(mf.encode(m), expect_id=CK)
    assert back == m
    assert back.format == mf.FORMAT and back.host == "host-a"
    assert back.blobs[PROC] == 40 and back.edges == {INDEX: [PAGE], PAGE: [LEAF]}  # empty edge lists dropped
    assert back.checkpoint.stats == {"files": 3}  # a re-upload does not carry the old import's provenance
    assert back.roots == {INDEX, DELTA, SESSION, PROC}
    rec = back.record(parent_id=None)
    assert rec.parent_id is None and rec.process_blob == PROC and rec.turn == 7 and rec.kind is CheckpointKind.FULL
    assert rec.stats == {"files": 3, "imported_from": "host-a", "remote_parent": "ck-parent"}
    # Encoding is deterministic: the same checkpoint always makes the same bytes.
    assert mf.encode(m) == mf.encode(mf.decode(mf.encode(m), expect_id=CK))


def _mutate(change: Callable[[dict[str, Any]], None]) -> bytes:
    d = doc()
    change(d)
    return pack(d)


def _set(path: tuple[str, ...], value: object) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        for p in path[:-1]:
            d = d[p]
        d[path[-1]] = value

    return change


def _drop_blob(blob: str) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        del d["blobs"][blob]
        d["edges"].pop(blob, None)
        for kids in d["edges"].values():
            if blob in kids:
                kids.remove(blob)

    return change


BAD: dict[str, bytes] = {
    "not zstd": json.dumps(doc()).encode(),
    "not json": zstandard.ZstdCompressor().compress(b"{not json"),
    "not utf-8": zstandard.ZstdCompressor().compress(b"\xff\xfe{}"),
    "a list": pack([doc()]),
    "extra top key": _mutate(_set(("extra",), 1)),
    "extra checkpoint key": _mutate(_set(("checkpoint", "evil"), "x")),
    "wrong format": _mutate(_set(("format",), "crab-checkpoint/2")),
    "missing key": _mutate(lambda d: d.pop("edges")),
    "another checkpoint": _mutate(_set(("checkpoint", "id"), "ck-other")),
    "non-hex blob": _mutate(_set(("blobs", "../../etc/passwd"), 1)),
    "upper-case hex blob": _mutate(_set(("blobs", LEAF.upper()), 1)),
    "negative size": _mutate(_set(("blobs", LEAF), -1)),
    "edge child outside": _mutate(_set(("edges", PAGE), [LEAF, h("elsewhere")])),
    "edge parent outside": _mutate(_set(("edges", h("elsewhere")), [LEAF])),
    "index missing": _mutate(_drop_blob(INDEX)),
    "delta missing": _mutate(_drop_blob(DELTA)),
    "session missing": _mutate(_drop_blob(SESSION)),
    "process missing": _mutate(_drop_blob(PROC)),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_decode_refuses_unsound_manifests_naming_the_checkpoint(case: str) -> None:
    with pytest.raises(StoreError) as err:
        mf.decode(BAD[case], expect_id=CK)
    assert type(err.value) is StoreError
    assert CK in err.value.message


def test_decode_accepts_a_checkpoint_without_session_or_process() -> None:
    m = mf.build(record(session_blob=None, process_blob=None), "h", {INDEX: 1, DELTA: 2}, {})
    assert mf.decode(mf.encode(m), expect_id=CK).roots == {INDEX, DELTA}


def test_decompression_bomb_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    data = mf.encode(manifest())
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", 4096)
    # The real manifest is small: it passes; padding its label past the limit does not.
    assert mf.decode(data, expect_id=CK).checkpoint.id == CK
    bomb = _mutate(_set(("checkpoint", "label"), " " * 5000))
    assert len(bomb) < 4096  # tiny compressed, too big decompressed
    with pytest.raises(StoreError, match=CK):
        mf.decode(bomb, expect_id=CK)
    # A frame that does not declare its content size is bounded too.
    cobj = zstandard.ZstdCompressor().compressobj()
    streamed = cobj.compress(json.dumps({**doc(), "label": "h" * 5000}).encode()) + cobj.flush()
    with pytest.raises(StoreError, match=CK):
        mf.decode(streamed, expect_id=CK)


@pytest.mark.parametrize(
    "bad", ["", "../x", "ck-/a", "ck-../../x", "ck-ABC", "CK-abc", "ck-a b", "ck-a.json", "x-abc", "ck-" + "a" * 62]
)
def test_valid_checkpoint_id_refuses_path_tricks(bad: str) -> None:
    assert not mf.valid_checkpoint_id(bad)
    with pytest.raises(StoreError):
        mf.manifest_key(bad)


def test_keys() -> None:
    assert mf.valid_checkpoint_id("ck-" + "a" * 61)
    assert mf.manifest_key("ck-0a1b") == "checkpoints/ck-0a1b.json.zst"
    assert mf.blob_key(LEAF) == f"blobs/{LEAF[:2]}/{LEAF}"


def test_record_from_meta_is_remote_only() -> None:
    meta = mf.manifest_meta(manifest())
    rec = mf.record_from_meta(json.loads(json.dumps(meta)))
    assert rec.remote and rec.remote_only
    assert rec.host == "host-a" and rec.id == CK and rec.parent_id == "ck-parent"
    assert rec.stats["imported_from"] == "host-a"
    with pytest.raises(ValueError):
        mf.record_from_meta({**meta, "owner_uid": -1})
