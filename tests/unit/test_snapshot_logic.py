"""Checkpoints kept as local snapshots (the btrfs backend's way), on fake backends.

Restores and forks take a checkpoint's files from its snapshot when it has
one (never reading its tree from the blobs), and from the blobs when it has
none; a snapshot lives exactly as long as its checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from crabd.backends.fsdelta import Tree
from crabd.errors import QuotaExceeded, StoreError
from crabd.models import CheckpointKind, CheckpointRecord
from tests.fakes import ALICE, FakeFsDelta, Stack, build_stack, run, spec


async def _two_checkpoints(st: Stack) -> tuple[str, CheckpointRecord, CheckpointRecord]:
    rec = await st.service.create(ALICE, spec("snap", checkpoints="fs"))
    st.write(rec.id, "notes", "v1")
    first = await st.checkpointer.take(rec, kind=CheckpointKind.FS)
    st.write(rec.id, "notes", "v2")
    second = await st.checkpointer.take(rec, kind=CheckpointKind.FS)
    return rec.id, first, second


def _fs(st: Stack) -> FakeFsDelta:
    assert isinstance(st.fs, FakeFsDelta)
    return st.fs


def test_every_published_checkpoint_has_its_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch, snapshots=True)

    async def body() -> None:
        sid, first, second = await _two_checkpoints(st)
        assert _fs(st).snapshots[first.id] == {"notes": "v1"}
        assert _fs(st).snapshots[second.id] == {"notes": "v2"}
        assert set(_fs(st).snapshots) == {c.id for c in st.checkpointer.list_checkpoints(sid, None)}

    run(body())


def test_a_restore_takes_the_snapshot_and_never_the_blobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch, snapshots=True)

    async def body() -> None:
        sid, first, _ = await _two_checkpoints(st)
        # Reading the tree or writing it out would fail: the snapshot must be enough.
        st.faults.arm("fs.materialize", after=0)
        loads: list[str] = []
        real_load = st.fs.load

        def load(blob: str) -> Tree:
            loads.append(blob)
            return real_load(blob)

        monkeypatch.setattr(st.fs, "load", load)
        rec = st.registry.get_sandbox(sid)
        assert rec is not None
        restored = await st.service.restore(ALICE, sid, first.id, 0)
        assert st.files(sid) == {"notes": "v1"}
        assert first.index_blob not in loads
        # The head's stat index is the checkpoint's own index: the files are its inodes.
        head = st.catalog.head(sid)
        assert head is not None and head.index_blob == first.index_blob
        assert restored.container_id != rec.container_id

    run(body())


def test_without_its_snapshot_a_restore_writes_the_blobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch, snapshots=True)

    async def body() -> None:
        sid, first, _ = await _two_checkpoints(st)
        del _fs(st).snapshots[first.id]  # deleted, or the checkpoint came from another host
        await st.service.restore(ALICE, sid, first.id, 0)
        assert st.files(sid) == {"notes": "v1"}
        assert st.faults.calls.get("fs.materialize") == 1

    run(body())


def test_forks_share_one_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch, snapshots=True)

    async def body() -> None:
        _, _, second = await _two_checkpoints(st)
        st.faults.arm("fs.materialize", after=0)
        _, forks = await st.service.fork(ALICE, second.id, "", 3, "branch")
        assert [st.files(f.id) for f in forks] == [{"notes": "v2"}] * 3

    run(body())


def _refuse_new_bytes(uid: int, added: int) -> None:
    if added > 0:
        raise QuotaExceeded("no room", uid=uid, quota="store", limit=0, used=0, requested=added)


@pytest.mark.parametrize("point", ["store", "quota"])
def test_a_checkpoint_that_fails_after_its_cut_leaves_no_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    st = build_stack(tmp_path, monkeypatch, snapshots=True)

    async def body() -> None:
        rec = await st.service.create(ALICE, spec("snap", checkpoints="fs"))
        before = set(_fs(st).snapshots)
        st.write(rec.id, "notes", "v1")
        if point == "store":
            st.faults.arm("fs.store", after=0)
        else:
            st.checkpointer.store_quota = _refuse_new_bytes  # refused just before publication
        with pytest.raises(StoreError if point == "store" else QuotaExceeded):
            await st.checkpointer.take(rec, kind=CheckpointKind.FS)
        assert st.faults.calls.get("fs.capture")  # the cut was taken
        assert set(_fs(st).snapshots) == before

    run(body())


def test_deleting_a_checkpoint_deletes_its_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch, snapshots=True)

    async def body() -> None:
        sid, first, second = await _two_checkpoints(st)
        await st.housekeeping.delete(first)
        assert first.id not in _fs(st).snapshots and second.id in _fs(st).snapshots
        rec = st.registry.get_sandbox(sid)
        assert rec is not None
        await st.sandboxes.remove(rec, force=True)
        await st.housekeeping.forget_sandbox(rec, keep=False)
        assert _fs(st).snapshots == {}

    run(body())


def test_start_up_deletes_snapshots_nothing_publishes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch, snapshots=True)

    async def body() -> None:
        _, first, _ = await _two_checkpoints(st)
        _fs(st).snapshots["ck-crashed"] = {"half": "made"}  # a crash between the cut and its publication
        await st.housekeeping.reconcile()
        assert "ck-crashed" not in _fs(st).snapshots and first.id in _fs(st).snapshots

    run(body())


def test_a_failed_snapshot_restore_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch, snapshots=True)

    async def body() -> None:
        sid, first, second = await _two_checkpoints(st)
        rec = st.registry.get_sandbox(sid)
        assert rec is not None
        st.faults.arm("fs.restore_snapshot", after=0)
        with pytest.raises(StoreError):
            await st.service.restore(ALICE, sid, first.id, 0)
        after = st.registry.get_sandbox(sid)
        assert after is not None and after.container_id == rec.container_id
        assert st.files(sid) == {"notes": "v2"}
        assert st.checkpointer.head_id(sid) == second.id
        assert set(st.backend.containers) == {rec.container_id}

    run(body())
