"""Retention: the rules (pure), and thinning over fake backends with the real catalog and blob store."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from crabd.coordinator.retention_rules import to_thin, verdict
from crabd.errors import CheckpointNotFound, InvalidRequest, PermissionDenied, QuotaExceeded
from crabd.models import CheckpointKind, KeepReason, RetentionPolicy
from crabd.store import accounting
from crabd.store.lineage import Lineage, Node
from crabd.store.maintenance import verify
from tests.fakes import ALICE, BOB, Stack, build_stack, run, spec

K = KeepReason
HOUR = 3600.0


def _lineage(chain: list[tuple[str, str | None, float]], sandbox: str = "s1", **extra: object) -> Lineage:
    """Checkpoints (id, parent, created_at) of one sandbox; the last one is its head."""
    lin = Lineage()
    for ck, parent, at in chain:
        lin.nodes[ck] = Node(ck, sandbox, 1000, parent, sandbox if parent else "", at, 0, False, False, 10)
        if parent:
            lin.children.setdefault(parent, []).append(sandbox)
    lin.heads = {chain[-1][0]}
    for k, v in extra.items():
        setattr(lin, k, v)
    return lin


def _chain(n: int, step: float = 1.0) -> list[tuple[str, str | None, float]]:
    return [(f"c{i}", f"c{i - 1}" if i else None, i * step) for i in range(n)]


def _why(
    lin: Lineage, policy: RetentionPolicy | None, *, now: float = 1e6, live: bool = True, in_use: set[str] | None = None
) -> dict[str, list[K]]:
    return verdict(lin, ["s1"] if live else [], lambda _s: policy, now=now, in_use=in_use)


def test_keep_last_thins_the_middle_and_keeps_root_and_head() -> None:
    lin = _lineage(_chain(10))
    why = _why(lin, RetentionPolicy(keep_last=3))
    assert to_thin(lin, why) == ["c1", "c2", "c3", "c4", "c5", "c6"]
    assert why["c0"] == [K.ROOT]
    assert why["c9"] == [K.HEAD, K.LAST]
    assert why["c7"] == [K.LAST]


def test_no_policy_keeps_everything_and_says_so() -> None:
    lin = _lineage(_chain(5))
    for policy in (None, RetentionPolicy()):
        why = _why(lin, policy)
        assert to_thin(lin, why) == []
        assert all(K.NO_POLICY in r for r in why.values())


def test_a_restore_line_end_and_its_branch_point_are_never_thinned() -> None:
    # c0 - c1 - c2 - c3 (abandoned by a restore to c1) ; c1 - c4 - c5 - c6 (the new line, head c6)
    chain = [*_chain(4), ("c4", "c1", 4.0), ("c5", "c4", 5.0), ("c6", "c5", 6.0)]
    lin = _lineage(chain)
    why = _why(lin, RetentionPolicy(keep_last=1))
    assert K.BRANCH_POINT in why["c1"]
    assert K.LINE_END in why["c3"]
    assert to_thin(lin, why) == ["c2", "c4", "c5"]


def test_fork_origins_pinned_and_in_use_are_kept() -> None:
    lin = _lineage(_chain(6), origins={"c2"})
    lin.nodes["c3"] = Node("c3", "s1", 1000, "c2", "s1", 3.0, 0, True, False, 10)
    lin.children["c4"] = [*lin.children["c4"], "s2"]  # another sandbox's checkpoint descends from c4
    why = _why(lin, RetentionPolicy(keep_last=1), in_use={"c1"})
    assert why["c1"] == [K.IN_USE]
    assert why["c2"] == [K.FORK_ORIGIN]
    assert why["c3"] == [K.PINNED]
    assert K.FORK_ORIGIN in why["c4"] and K.BRANCH_POINT in why["c4"]
    assert to_thin(lin, why) == []


def test_hourly_daily_and_within_select_as_snapshot_tools_do() -> None:
    # One checkpoint every 20 minutes for two days.
    lin = _lineage(_chain(144, step=HOUR / 3))
    now = 144 * HOUR / 3
    hourly = _why(lin, RetentionPolicy(keep_hourly=4), now=now)
    kept = sorted((c for c, r in hourly.items() if K.HOURLY in r), key=lambda c: int(c[1:]))
    # The newest of each of the last 4 hours: checkpoints 143, 140, 137, 134.
    assert kept == ["c134", "c137", "c140", "c143"]
    daily = _why(lin, RetentionPolicy(keep_daily=5), now=now)
    assert sorted(c for c, r in daily.items() if K.DAILY in r) == ["c143", "c71"]  # two days have any
    within = _why(lin, RetentionPolicy(keep_within_s=HOUR), now=now)
    assert sorted((c for c, r in within.items() if K.WITHIN in r), key=lambda c: int(c[1:])) == [
        "c141",
        "c142",
        "c143",
    ]


def test_a_removed_sandbox_keeps_everything() -> None:
    lin = _lineage(_chain(5))
    why = _why(lin, RetentionPolicy(keep_last=1), live=False)
    assert to_thin(lin, why) == [] and all(K.KEPT in r for r in why.values())


@pytest.mark.parametrize(
    "bad",
    [{"keep_last": -1}, {"keep_daily": 10**7}, {"keep_within_s": float("nan")}, {"keep_hourly": True}],
)
def test_bad_policies_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest):
        RetentionPolicy(**bad)  # type: ignore[arg-type]


# --- thinning over the fake stack -----------------------------------------------------------


async def _sandbox_with_history(st: Stack, turns: int, policy: RetentionPolicy | None) -> tuple[str, list[str]]:
    rec = await st.service.create(ALICE, spec("hist", checkpoints="fs"))
    if policy is not None:
        await st.service.retention.set_policy(ALICE, rec.id, policy)
    ids = []
    for i in range(turns):
        st.write(rec.id, f"turn{i}.txt", f"content {i}")
        rec = st.sandboxes.row(rec.id) or rec
        ids.append((await st.checkpointer.take(rec, kind=CheckpointKind.FS)).id)
    return rec.id, ids


def test_thinning_keeps_the_policy_and_every_kept_checkpoint_restores_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch, snapshots=True)

    async def body() -> None:
        sid, ids = await _sandbox_with_history(st, 12, RetentionPolicy(keep_last=4))
        assert set(ids) <= set(st.fs.snapshots)
        dry = await st.service.retention.thin(ALICE, sid, dry_run=True)
        assert dry.deleted == ids[:8] and len(st.catalog.list_checkpoints(sid)) == 13
        report = await st.service.retention.thin(ALICE, sid, dry_run=False)
        assert report.deleted == ids[:8]
        left = st.catalog.list_checkpoints(sid)
        assert [c.id for c in left][1:] == ids[8:]  # the root (turn-0 baseline) and the last 4
        assert report.bytes_freed > 0
        # Exactly the thinned checkpoints' snapshots are gone.
        assert not set(report.deleted) & set(st.fs.snapshots) and set(ids[8:]) <= set(st.fs.snapshots)
        # Lineage re-parented: every kept checkpoint's parent is kept.
        assert {c.parent_id for c in left} - {c.id for c in left} == {None}
        assert verify(st.catalog, st.blobs).ok
        # Each kept checkpoint restores exactly what the sandbox had at its turn.
        for n, ck in enumerate(ids[8:], start=8):
            rec = st.sandboxes.row(sid)
            assert rec is not None
            await st.service.restore(ALICE, sid, ck, -1)
            assert st.files(sid) == {f"turn{i}.txt": f"content {i}" for i in range(n + 1)}
        listed = await st.service.list_checkpoints(ALICE, sid)
        assert all(c.kept_for for c in listed)

    run(body())


def test_background_thinning_runs_in_the_engine_after_each_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        await st.engine.start()
        try:
            sid, ids = await _sandbox_with_history(st, 10, RetentionPolicy(keep_last=2))
            for _ in range(200):
                if len(st.catalog.list_checkpoints(sid)) == 3:
                    break
                await asyncio.sleep(0.02)
            assert [c.id for c in st.catalog.list_checkpoints(sid)][1:] == ids[-2:]
            assert any(j.kind == "thin" for j in st.engine.jobs(None))
        finally:
            await st.engine.close()

    run(body())


def test_a_held_checkpoint_is_not_thinned_and_a_thinned_one_cannot_be_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        sid, ids = await _sandbox_with_history(st, 6, RetentionPolicy(keep_last=1))
        async with st.restorer.leases.hold(ids[1]):
            report = await st.service.retention.thin(ALICE, sid, dry_run=False)
            assert ids[1] not in report.deleted and ids[2] in report.deleted
            listed = {c.id: c for c in await st.service.list_checkpoints(ALICE, sid)}
            assert listed[ids[1]].kept_for == (K.IN_USE,)
        await st.service.retention.thin(ALICE, sid, dry_run=False)
        with pytest.raises(CheckpointNotFound, match="deleted"):
            async with st.restorer.leases.hold(ids[1]):
                pass

    run(body())


def test_pinned_checkpoints_survive_until_unpinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        sid, ids = await _sandbox_with_history(st, 5, RetentionPolicy(keep_last=1))
        pinned = await st.service.retention.pin(ALICE, ids[1], True)
        assert pinned.pinned and pinned.kept_for == (K.PINNED,)
        await st.service.retention.thin(ALICE, sid, dry_run=False)
        assert st.catalog.find(ids[1]) is not None and st.catalog.find(ids[2]) is None
        assert (await st.service.retention.pin(ALICE, ids[1], False)).kept_for == ()
        await st.service.retention.thin(ALICE, sid, dry_run=False)
        assert st.catalog.find(ids[1]) is None

    run(body())


def test_near_the_quota_retention_makes_room_and_a_refusal_names_what_holds_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each checkpoint below adds a few KiB of incompressible file content.
    st = build_stack(tmp_path, monkeypatch, quota={"max_store_bytes": 64 << 10})

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("q", checkpoints="fs"))
        await st.service.retention.set_policy(ALICE, rec.id, RetentionPolicy(keep_last=2))
        for _ in range(30):
            st.write(rec.id, "blob.bin", os.urandom(6000).hex())  # replaced each turn: the sandbox stays small
            rec = st.sandboxes.row(rec.id) or rec
            await st.checkpointer.take(rec, kind=CheckpointKind.FS)  # never refused: retention made room
        # Thinned whenever the use neared the quota: at most what fits under it (~6 KiB a checkpoint;
        # before issue 33 the fake's delta also carried its base's files, twice that, and at most 4 fit).
        assert len(st.catalog.list_checkpoints(rec.id)) <= 10
        assert accounting.store_bytes_used(st.db, ALICE.uid) <= 64 << 10
        # Pinned checkpoints cannot be thinned: once they fill the quota, the refusal names them.
        for c in st.catalog.list_checkpoints(rec.id):
            await st.service.retention.pin(ALICE, c.id, True)
        with pytest.raises(QuotaExceeded) as caught:
            for _ in range(30):
                st.write(rec.id, "blob.bin", os.urandom(6000).hex())
                rec = st.sandboxes.row(rec.id) or rec
                c = await st.checkpointer.take(rec, kind=CheckpointKind.FS)
                await st.service.retention.pin(ALICE, c.id, True)
        assert "crabctl checkpoint unpin" in (caught.value.hint or "")

    run(body())


def test_another_tenant_can_neither_pin_thin_nor_set_a_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        sid, ids = await _sandbox_with_history(st, 3, None)
        before = [(c.id, c.pinned) for c in st.catalog.list_checkpoints(sid)]
        with pytest.raises(PermissionDenied):
            await st.service.retention.pin(BOB, ids[0], True)
        with pytest.raises(PermissionDenied):
            await st.service.retention.thin(BOB, sid, dry_run=False)
        with pytest.raises(PermissionDenied):
            await st.service.retention.set_policy(BOB, sid, RetentionPolicy(keep_last=1))
        rec = st.sandboxes.row(sid)
        assert rec is not None and rec.spec.retention is None
        assert [(c.id, c.pinned) for c in st.catalog.list_checkpoints(sid)] == before

    run(body())
