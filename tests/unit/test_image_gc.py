"""Pinned images and their collection (coordinator/image_gc.py): references, grace, claims, the lock.

On the fake stack (a fake backend whose pins are a dict; a real SQLite store and
a claims dir under tmp_path); the keeper's clock is moved instead of waiting.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from crabd.coordinator.image_gc import ImageKeeper
from crabd.errors import PermissionDenied
from crabd.models import CheckpointKind
from crabd.service.pinned_images import PinnedImages
from crabd.store.image_claims import ImageClaims
from tests.fakes import ALICE, BOB, ROOT, Stack, build_stack, engine_running, run, spec

GRACE = 100.0
TOOL = "sha256:" + hashlib.sha256(b"tool:1").hexdigest()


def _stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Stack, ImageKeeper, list[float]]:
    st = build_stack(tmp_path, monkeypatch, images={"gc_grace_s": GRACE})
    keeper = st.sandboxes.images
    now = [0.0]
    keeper.clock = lambda: now[0]
    return st, keeper, now


def _later(now: list[float], seconds: float) -> None:
    import time

    now[0] = time.time() + seconds


def test_a_create_from_any_image_pins_and_claims_it_an_env_create_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st, keeper, _ = _stack(tmp_path, monkeypatch)

    async def body() -> None:
        async with engine_running(st):
            await st.service.create(ALICE, spec("envsb"))
            assert st.backend.pins == {}
            rec = await st.service.create(ALICE, replace(spec("anyimg"), env="", image="tool:1"))
            assert rec.image == TOOL
            assert list(st.backend.pins) == [TOOL]
            claims = keeper.claims.read()
            assert [c.instance for c in claims[TOOL]] == ["test-instance"]
            assert json.loads((keeper.claims.root / TOOL[7:] / "test-instance").read_text())["state_dir"] == str(
                st.cfg.paths.state_dir
            )

    run(body())


def test_a_kept_checkpoint_keeps_the_image_and_the_grace_holds_it_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st, keeper, now = _stack(tmp_path, monkeypatch)

    async def body() -> None:
        async with engine_running(st):
            rec = await st.service.create(ALICE, replace(spec("anyimg", checkpoints="fs"), env="", image="tool:1"))
            await st.checkpointer.take(rec, kind=CheckpointKind.FS)
            cks = st.catalog.list_checkpoints(rec.id)  # the create's baseline and this one
            _later(now, GRACE * 10)
            # A live sandbox names it.
            assert keeper.collect().removed == [] and TOOL in st.backend.pins
            rows = {r.digest: r for r in keeper.listing()}
            assert (rows[TOOL].sandboxes, rows[TOOL].checkpoints, rows[TOOL].state) == (1, len(cks), "in use")
            # Removed, its checkpoint kept: still needed.
            await st.service.remove(ALICE, rec.id, force=True, keep_checkpoints=True)
            assert keeper.collect().removed == [] and TOOL in st.backend.pins
            assert {r.digest: r for r in keeper.listing()}[TOOL].checkpoints == len(cks)
            # The checkpoints go: within the grace of the last pin the image stays ...
            for ck in cks:
                await st.service.delete_checkpoint(ALICE, ck.id)
            now[0] = keeper.claims.read()[TOOL][0].at + GRACE / 2
            assert keeper.listing()[0].state == "grace"
            assert keeper.collect().removed == [] and TOOL in st.backend.pins
            # ... a dry run says what would go and changes nothing ...
            now[0] += GRACE
            dry = keeper.collect(dry_run=True)
            assert dry.removed == [TOOL] and TOOL in st.backend.pins and TOOL in keeper.claims.read()
            # ... and past it, the image and its claim go.
            done = keeper.collect()
            assert done.removed == [TOOL] and st.backend.unpinned == [TOOL]
            assert done.bytes_freed == 1000 and done.exports_removed == 1
            assert keeper.claims.read() == {}
            assert keeper.listing() == []

    run(body())


def test_a_create_pins_again_and_restarts_the_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st, keeper, now = _stack(tmp_path, monkeypatch)

    async def body() -> None:
        async with engine_running(st):
            rec = await st.service.create(ALICE, replace(spec("one"), env="", image="tool:1"))
            await st.service.remove(ALICE, rec.id, force=True)
            claim = keeper.claims.root / TOOL[7:] / "test-instance"
            os.utime(claim, (1000.0, 1000.0))  # pinned long ago
            now[0] = 1000.0 + GRACE * 2
            assert keeper.listing()[0].state == "removable"
            rec = await st.service.create(ALICE, replace(spec("two"), env="", image="tool:1"))
            await st.service.remove(ALICE, rec.id, force=True)
            _later(now, GRACE / 2)  # the second create pinned it just now
            assert keeper.collect().removed == [] and TOOL in st.backend.pins

    run(body())


def test_a_collection_never_races_a_create_holding_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st, keeper, now = _stack(tmp_path, monkeypatch)
    st.backend.pin_image("tool:1")
    _later(now, GRACE * 10)
    with keeper.claims.shared():  # a create between its pin and its registry row (another process, say)
        busy = keeper.collect()
        assert busy.busy and busy.removed == [] and TOOL in st.backend.pins
    assert keeper.collect().removed == [TOOL]


def test_another_live_instances_claim_keeps_the_image_a_stale_one_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st, keeper, now = _stack(tmp_path, monkeypatch)
    other_state = tmp_path / "other-state"
    other_state.mkdir()
    (other_state / "registry.db").write_bytes(b"")
    other = ImageClaims(keeper.claims.root, "other-instance", other_state)

    async def body() -> None:
        async with engine_running(st):
            rec = await st.service.create(ALICE, replace(spec("anyimg"), env="", image="tool:1"))
            await st.service.remove(ALICE, rec.id, force=True)
            other.claim(TOOL)
            _later(now, GRACE * 10)
            report = keeper.collect()
            assert report.removed == [] and "another crabd instance" in report.left[TOOL]
            # This instance dropped its own claim; the other's stays, and so does the image.
            assert [c.instance for c in keeper.claims.read()[TOOL]] == ["other-instance"]
            assert TOOL in st.backend.pins
            # The other instance is gone (an embedded daemon's state dir, removed with it): stale.
            (other_state / "registry.db").unlink()
            assert keeper.collect().removed == [TOOL]
            assert keeper.claims.read() == {}

    run(body())


def test_crab_only_touches_its_own_pins_and_reports_a_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st, keeper, now = _stack(tmp_path, monkeypatch)
    st.backend.pin_image("tool:1")
    st.backend.pin_image("crab-env/bookworm:abc")  # an env image is never pinned
    assert list(st.backend.pins) == [TOOL]
    st.backend.refuse_unpin.add(TOOL)
    _later(now, GRACE * 10)
    report = keeper.collect()
    assert report.removed == [] and "container" in report.left[TOOL] and TOOL in st.backend.pins


def test_a_pinned_image_the_database_names_is_adopted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pin from before claims existed: claimed by the instance whose records name it, never collected then."""
    st, keeper, now = _stack(tmp_path, monkeypatch)

    async def body() -> None:
        async with engine_running(st):
            await st.service.create(ALICE, replace(spec("anyimg"), env="", image="tool:1"))
            keeper.claims.drop(TOOL, "test-instance")
            assert keeper.claims.read() == {}
            assert keeper.adopt() == 1
            assert [c.instance for c in keeper.claims.read()[TOOL]] == ["test-instance"]
            _later(now, GRACE * 10)
            assert keeper.collect().removed == []

    run(body())


def test_listing_counts_the_callers_own_records_and_prune_is_root_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st, keeper, _ = _stack(tmp_path, monkeypatch)
    edge = PinnedImages(keeper)

    async def body() -> None:
        async with engine_running(st):
            await st.service.create(ALICE, replace(spec("a"), env="", image="tool:1"))
            await st.service.create(BOB, replace(spec("b"), env="", image="tool:1"))
            assert [(r.digest, r.sandboxes) for r in await edge.listing(ROOT)] == [(TOOL, 2)]
            assert [(r.digest, r.sandboxes, r.state) for r in await edge.listing(ALICE)] == [(TOOL, 1, "in use")]
            with pytest.raises(PermissionDenied, match="only root"):
                await edge.prune(ALICE, dry_run=True)
            assert (await edge.prune(ROOT, dry_run=False)).removed == []

    run(body())
