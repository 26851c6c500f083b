"""Taking checkpoints on fake backends: a failure is recorded, publishes nothing and leaves the head."""

from __future__ import annotations

from pathlib import Path

import pytest

from crabd.backends.procdump import DumpResult
from crabd.errors import CriuError, QuotaExceeded, StoreError
from crabd.models import CheckpointKind, SandboxRecord, SandboxState
from tests.fakes import ALICE, Stack, build_stack, run, spec


async def _sandbox(st: Stack) -> SandboxRecord:
    rec = await st.service.create(ALICE, spec("a", checkpoints="fs"))
    st.write(rec.id, "notes.txt", "first")
    return rec


@pytest.mark.parametrize(
    ("point", "kind", "error"),
    [
        ("fs.prepare", "fs", StoreError),
        ("fs.capture", "fs", StoreError),
        ("fs.store", "fs", StoreError),
        ("fs.capture", "full", StoreError),
        ("dump", "full", CriuError),
    ],
)
def test_a_backend_failure_is_recorded_and_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str, kind: str, error: type[Exception]
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await _sandbox(st)
        head = st.checkpointer.head_id(rec.id)
        assert head is not None  # the baseline
        before = (st.catalog.list_checkpoints(rec.id), st.blob_files())
        st.faults.arm(point)
        with pytest.raises(error, match=f"injected failure at {point}"):
            await st.checkpointer.take(rec, kind=CheckpointKind(kind), label="doomed")
        assert st.faults.calls[point] >= 1
        failures = st.catalog.failures(rec.id)
        assert len(failures) == 1
        f = failures[0]
        sandbox_id, turn, failed_kind, message = f.sandbox_id, f.turn, f.kind, f.error
        assert (sandbox_id, turn, failed_kind) == (rec.id, 0, kind)
        assert point in message
        assert st.checkpointer.head_id(rec.id) == head
        assert (st.catalog.list_checkpoints(rec.id), st.blob_files()) == before
        # The sandbox runs on, thawed, and no dump is left behind.
        assert st.backend.frozen_now == set()
        assert (await st.sandboxes.refresh(rec))[0].state is SandboxState.RUNNING
        assert list(st.checkpointer.dump_root.iterdir()) == []
        # The next attempt works and descends from the same head.
        st.faults.disarm(point)
        ckpt = await st.checkpointer.take(rec, kind=CheckpointKind(kind))
        assert ckpt.parent_id == head
        assert st.checkpointer.head_id(rec.id) == ckpt.id

    run(body())


def test_blobs_written_before_a_late_refusal_are_released(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store quota is checked again with the new bytes just before publication: refused, what was written goes."""
    st = build_stack(tmp_path, monkeypatch)

    def quota(uid: int, new_bytes: int) -> None:
        if new_bytes > 0:
            raise QuotaExceeded(
                f"uid {uid} may not store {new_bytes} more bytes",
                uid=uid,
                quota="max_store_bytes",
                limit=0,
                used=0,
                requested=new_bytes,
            )

    async def body() -> None:
        rec = await _sandbox(st)
        head = st.checkpointer.head_id(rec.id)
        blobs = st.blob_files()
        st.write(rec.id, "big.txt", "new content, new blobs")
        st.checkpointer.store_quota = quota
        with pytest.raises(QuotaExceeded):
            await st.checkpointer.take(rec, kind=CheckpointKind.FULL)
        assert st.blob_files() == blobs
        assert st.checkpointer.head_id(rec.id) == head
        assert [f.kind for f in st.catalog.failures(rec.id)] == ["full"]

    run(body())


def test_a_checkpoint_records_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await _sandbox(st)
        baseline = st.checkpointer.head_id(rec.id)
        first = await st.checkpointer.take(rec, kind=CheckpointKind.FS, label="one")
        st.write(rec.id, "notes.txt", "second")
        second = await st.checkpointer.take(rec, kind=CheckpointKind.FULL, turn=7)
        assert (first.parent_id, second.parent_id) == (baseline, first.id)
        assert (first.kind, second.kind) == ("fs", "full")
        assert (first.process_blob, second.process_blob is not None) == (None, True)
        assert (first.turn, second.turn, first.label) == (0, 7, "one")
        assert [c.id for c in st.catalog.lineage(second.id)] == [baseline, first.id, second.id]
        assert st.stored_files(first) == {"notes.txt": "first"}
        assert st.stored_files(second) == {"notes.txt": "second"}
        assert st.catalog.failures(rec.id) == []

    run(body())


def test_a_full_checkpoints_line_says_where_the_frozen_time_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await _sandbox(st)
        with caplog.at_level("INFO", logger="crabd.checkpoints"):
            await st.checkpointer.take(rec, kind=CheckpointKind.FULL)
            await st.checkpointer.take(rec, kind=CheckpointKind.FS)
        lines = [r for r in caplog.records if r.getMessage() == "checkpoint published"]
        full, fs = (vars(r) for r in lines)
        steps = {k: v for k, v in full.items() if k.startswith("freeze_") and k != "freeze_ms"}
        # The baseline's step is the inspector's, which these fake stacks run without.
        assert (
            {"freeze_dump_ms", "freeze_rewalk_ms"}
            <= set(steps)
            <= {"freeze_dump_ms", "freeze_baseline_ms", "freeze_rewalk_ms"}
        )
        assert all(v >= 0 for v in steps.values()) and sum(steps.values()) <= full["freeze_ms"] + 0.5
        assert [k for k in fs if k.startswith("freeze_") and k != "freeze_ms"] == ["freeze_rewalk_ms"]  # no dump

    run(body())


def test_a_dead_sandbox_is_not_checkpointed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        rec = await _sandbox(st)
        head = st.checkpointer.head_id(rec.id)
        st.backend.kill(rec.container_id)
        with pytest.raises(Exception, match="is dead"):
            await st.checkpointer.take(rec, kind=CheckpointKind.FS)
        assert st.checkpointer.head_id(rec.id) == head
        assert len(st.catalog.failures(rec.id)) == 1
        got = st.registry.get_sandbox(rec.id)
        assert got is not None and got.state is SandboxState.DEAD

    run(body())


def test_a_published_dump_is_kept_hot_and_a_restore_links_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a published checkpoint's dump is kept (a sandbox's newest few); a restore from it reports
    images_from "hot", from a dump no longer kept "blobs"."""
    st = build_stack(tmp_path, monkeypatch)
    hot = st.images.hot
    assert hot is not None

    dumps = [0]
    fake_dump = st.checkpointer.dumper.dump

    def dump(container_id: str, images_dir: Path, work_dir: Path) -> DumpResult:
        dumps[0] += 1  # each dump's memory differs
        (images_dir / "mm-1.img").write_text(f"dump {dumps[0]}")
        return fake_dump(container_id, images_dir, work_dir)

    monkeypatch.setattr(st.checkpointer.dumper, "dump", dump)

    def restored_from() -> list[object]:
        return [getattr(r, "images_from", None) for r in caplog.records if r.getMessage() == "sandbox restored"]

    async def body() -> None:
        rec = await _sandbox(st)
        first = await st.checkpointer.take(rec, kind=CheckpointKind.FULL)
        assert first.process_blob is not None and first.process_blob in hot
        assert list(st.checkpointer.dump_root.iterdir()) == []  # the work dir went, the images moved
        st.write(rec.id, "notes.txt", "second")
        second = await st.checkpointer.take(rec, kind=CheckpointKind.FULL)
        assert second.process_blob not in (None, first.process_blob)
        assert (first.process_blob in hot, second.process_blob in hot) == (True, True)

        # A checkpoint refused at publication keeps nothing: the sandbox's hot copy stays the published one.
        def refuse(uid: int, new_bytes: int) -> None:
            if new_bytes:
                raise QuotaExceeded("no", uid=uid, quota="max_store_bytes", limit=0, used=0, requested=new_bytes)

        st.write(rec.id, "notes.txt", "third")
        st.checkpointer.store_quota = refuse
        with pytest.raises(QuotaExceeded):
            await st.checkpointer.take(rec, kind=CheckpointKind.FULL)
        st.checkpointer.store_quota = None
        assert hot.usage()[0] == 2 and second.process_blob in hot
        assert list(st.checkpointer.dump_root.iterdir()) == []

        with caplog.at_level("INFO", logger="crabd.restore"):
            await st.service.restore(ALICE, "a", second.id, -1)
            await st.service.restore(ALICE, "a", first.id, -1)
            hot.drop(first.process_blob)
            await st.service.restore(ALICE, "a", first.id, -1)
        assert restored_from() == ["hot", "hot", "blobs"]
        await st.sandboxes.close(remove_all=False)

    run(body())
