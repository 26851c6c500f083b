"""Fork on fake backends: N sandboxes or none, and nothing of a failed fork published."""

from __future__ import annotations

from pathlib import Path

import pytest

from crabd.errors import CrabError, CriuError, DockerError, InvalidRequest, PermissionDenied, QuotaExceeded, StoreError
from crabd.models import CheckpointKind, CheckpointRecord, SandboxState
from tests.fakes import ALICE, BOB, Stack, build_stack, run, spec


async def _checkpoint(st: Stack, kind: str = "fs") -> CheckpointRecord:
    rec = await st.service.create(ALICE, spec("origin", checkpoints="fs"))
    st.write(rec.id, "work/result.txt", "42")
    return await st.checkpointer.take(rec, kind=CheckpointKind(kind))


def test_fork_makes_n_sandboxes_from_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        ckpt = await _checkpoint(st, "full")
        used, forks = await st.service.fork(ALICE, ckpt.id, "", 3, "clone")
        assert used == ckpt.id
        assert [f.name for f in forks] == ["clone-1", "clone-2", "clone-3"]
        assert len({f.container_id for f in forks}) == 3
        for f in forks:
            assert (f.owner_uid, f.origin, f.state) == (ALICE.uid, ckpt.id, SandboxState.RUNNING)
            assert st.checkpointer.head_id(f.id) == ckpt.id
            assert st.files(f.id) == {"work/result.txt": "42"}
            # A process checkpoint starts the clone from its images.
            assert st.backend.containers[f.container_id].restored_from == "crab"
            # A clone may go back to what it was forked from.
            assert st.checkpointer.may_restore(f, ckpt)

    run(body())


@pytest.mark.parametrize(
    ("point", "kind", "error"),
    [
        ("backend.create", "fs", DockerError),
        ("backend.start", "fs", DockerError),
        ("backend.start", "full", CriuError),
        ("fs.materialize", "fs", StoreError),
    ],
)
@pytest.mark.parametrize("succeeding", [0, 2, 4])
def test_a_failed_clone_undoes_the_whole_fork(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    point: str,
    kind: str,
    error: type[CrabError],
    succeeding: int,
) -> None:
    """Fork x5 where clone ``succeeding + 1`` fails: no sandbox, container or published blob is left."""
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        ckpt = await _checkpoint(st, kind)
        sandboxes = [r.id for r in st.registry.list_sandboxes()]
        containers = set(st.backend.containers)
        checkpoints = st.catalog.list_checkpoints()
        blobs = st.blob_files()
        attempts = st.faults.calls.get(point, 0)
        st.faults.arm(point, after=succeeding)
        with pytest.raises(error):
            await st.service.fork(ALICE, ckpt.id, "", 5, "")
        assert st.faults.calls[point] - attempts > succeeding  # the failing clone was reached
        assert [r.id for r in st.registry.list_sandboxes()] == sandboxes
        assert set(st.backend.containers) == containers
        assert st.catalog.list_checkpoints() == checkpoints
        # What the clones that got that far stored (their stat indexes) is given back at once.
        assert st.blob_files() == blobs
        # The fork can be retried (names, ids and quota were all given back).
        st.faults.disarm(point)
        _, forks = await st.service.fork(ALICE, ckpt.id, "", 5, "")
        assert len(forks) == 5

    run(body())


def test_a_refused_fork_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch, quota={"max_sandboxes": 4})

    async def body() -> None:
        ckpt = await _checkpoint(st)
        await st.service.create(ALICE, spec("taken-2", checkpoints="none"))
        created = st.faults.calls["backend.create"]
        with pytest.raises(InvalidRequest, match="already exists"):
            await st.service.fork(ALICE, ckpt.id, "", 2, "taken")
        with pytest.raises(QuotaExceeded, match="limit of 4"):
            await st.service.fork(ALICE, ckpt.id, "", 3, "over-quota")
        with pytest.raises(PermissionDenied):
            await st.service.fork(BOB, ckpt.id, "", 1, "")
        assert st.faults.calls["backend.create"] == created
        assert {r.name for r in st.registry.list_sandboxes()} == {"origin", "taken-2"}

    run(body())


def test_a_restore_replaces_the_container_or_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        ckpt = await _checkpoint(st)
        rec = st.registry.get_sandbox(ckpt.sandbox_id)
        assert rec is not None
        st.write(rec.id, "work/result.txt", "43")
        later = await st.checkpointer.take(rec, kind=CheckpointKind.FS)
        blobs = st.blob_files()
        st.faults.arm("fs.materialize")
        with pytest.raises(StoreError):
            await st.service.restore(ALICE, "origin", ckpt.id, -1)
        after = st.registry.get_sandbox(rec.id)
        assert after is not None
        assert (after.container_id, after.branch, after.state) == (rec.container_id, 0, SandboxState.RUNNING)
        assert set(st.backend.containers) == {rec.container_id}
        assert st.checkpointer.head_id(rec.id) == later.id
        assert st.files(rec.id) == {"work/result.txt": "43"}
        assert st.blob_files() == blobs
        st.faults.disarm("fs.materialize")
        # A later failure (the new container will not start): its stat index is given back too.
        st.faults.arm("backend.start")
        with pytest.raises(DockerError):
            await st.service.restore(ALICE, "origin", ckpt.id, -1)
        assert st.faults.calls["fs.materialize"] >= 2  # the files were written before the start failed
        assert st.blob_files() == blobs
        assert st.checkpointer.head_id(rec.id) == later.id
        st.faults.disarm("backend.start")
        restored = await st.service.restore(ALICE, "origin", ckpt.id, -1)
        await st.sandboxes.close(remove_all=False)  # waits for the old container's removal
        assert restored.container_id != rec.container_id and restored.branch == 1
        assert set(st.backend.containers) == {restored.container_id}
        assert st.checkpointer.head_id(rec.id) == ckpt.id
        assert st.files(rec.id) == {"work/result.txt": "42"}

    run(body())
