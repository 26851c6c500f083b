"""Export and import through the service on fake backends: ownership, quotas, idempotence, conflicts,
process images a host refuses, and that a refused import changes nothing."""

from __future__ import annotations

import secrets
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from crabd.coordinator.archives import Archives, Imported
from crabd.errors import ArchiveRejected, CrabError, PermissionDenied, QuotaExceeded
from crabd.models import Caller, CheckpointKind
from crabd.store.archive_tar import ArchiveReader
from tests.archive_forge import rewrite_manifest
from tests.fakes import ALICE, BOB, Stack, build_stack, run, spec


async def _chunks(data: bytes, n: int = 65536) -> AsyncIterator[bytes]:
    for i in range(0, len(data), n):
        yield data[i : i + n]


async def _export(st: Stack, caller: Caller, ckpt: str, *, ancestors: bool = False) -> bytes:
    return b"".join([c async for c in st.service.archives.export(caller, ckpt, ancestors)])


async def _import(st: Stack, caller: Caller, data: bytes) -> Imported:
    return await st.service.archives.import_archive(caller, _chunks(data))


def _world(st: Stack) -> tuple[Any, ...]:
    """What a refused import must leave as it was."""
    cks = sorted((c.id, c.owner_uid, c.kind, c.process_blob) for c in st.catalog.list_checkpoints())
    return cks, st.blob_files(), sorted(st.catalog.live_blobs())


def _staging_empty(st: Stack) -> bool:
    root = st.cfg.paths.state_dir / "archives"
    return not root.exists() or not any(root.iterdir())


async def _sandbox_with_turns(st: Stack, caller: Caller, name: str, *contents: str) -> tuple[str, list[str]]:
    rec = await st.service.create(caller, spec(name, checkpoints="fs"))
    for text in contents:
        await st.turn(caller, rec.id, text)
    return rec.id, [c.id for c in st.catalog.list_checkpoints(rec.id)]


def _stack(root: Path, monkeypatch: pytest.MonkeyPatch, **config: Any) -> Stack:
    root.mkdir()
    return build_stack(root, monkeypatch, **config)


@pytest.fixture
def two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Stack, Stack]:
    return _stack(tmp_path / "a", monkeypatch), _stack(tmp_path / "b", monkeypatch)


def test_export_import_fork_keeps_files_and_ownership(two: tuple[Stack, Stack]) -> None:
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            _, cks = await _sandbox_with_turns(a, ALICE, "web", "v1", "v2")
            data = await _export(a, ALICE, cks[-1])
            got = await _import(b, BOB, data)  # another user on another host: it becomes theirs
            assert [c.id for c in got.checkpoints] == [cks[-1]] and not got.present and not got.dropped
            rec = b.catalog.get(cks[-1])
            assert rec.owner_uid == BOB.uid and rec.kept and rec.parent_id is None
            assert rec.stats["remote_parent"] == cks[-2] and rec.stats["new_bytes"] > 0
            assert b.stored_files(rec) == a.stored_files(a.catalog.get(cks[-1]))
            _, forks = await b.service.fork(BOB, rec.id, "", 1, "")
            assert b.files(forks[0].id)["state.txt"] == "v2"
            # Housekeeping keeps it although its sandbox never lived here.
            await b.housekeeping.reconcile()
            assert b.catalog.find(rec.id) is not None
            # Again: already present, nothing new stored.
            again = await _import(b, BOB, data)
            assert again.present == [rec.id] and again.stored_blobs == 0
            assert _staging_empty(a) and _staging_empty(b)

    run(body())


def test_ancestors_come_along_parent_first(two: tuple[Stack, Stack]) -> None:
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            _, cks = await _sandbox_with_turns(a, ALICE, "web", "v1", "v2", "v3")
            data = await _export(a, ALICE, cks[-1], ancestors=True)
            got = await _import(b, ALICE, data)
            assert [c.id for c in got.checkpoints] == cks
            assert [b.catalog.get(c).parent_id for c in cks] == [None, *cks[:-1]]
            assert b.stored_files(b.catalog.get(cks[1]))["state.txt"] == "v1"
            # Each blob new here is charged once, to the first checkpoint that needs it.
            charged = sum(b.catalog.get(c).stats["new_bytes"] for c in cks)
            assert charged == ArchiveReader([data]).manifest().member_bytes() > 0

    run(body())


def test_only_a_readable_checkpoint_is_exported(two: tuple[Stack, Stack]) -> None:
    a, _ = two

    async def body() -> None:
        async with _engines(a):
            _, cks = await _sandbox_with_turns(a, ALICE, "web", "v1")
            with pytest.raises(PermissionDenied):
                await _export(a, BOB, cks[-1])
            assert _staging_empty(a)

    run(body())


def test_a_live_sandbox_of_another_uid_refuses_the_import(two: tuple[Stack, Stack]) -> None:
    a, _ = two

    async def body() -> None:
        async with _engines(a):
            _, cks = await _sandbox_with_turns(a, ALICE, "web", "v1", "v2")
            data = await _export(a, ALICE, cks[-1])
            await a.service.delete_checkpoint(ALICE, cks[-1])
            before = _world(a)
            with pytest.raises(PermissionDenied):
                await _import(a, BOB, data)  # alice's sandbox lives here
            assert _world(a) == before and _staging_empty(a)
            got = await _import(a, ALICE, data)  # the owner may bring it back
            assert a.catalog.get(cks[-1]).owner_uid == ALICE.uid and got.stored_blobs >= 0

    run(body())


def test_a_checkpoint_here_with_other_content_refuses_the_import(two: tuple[Stack, Stack]) -> None:
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            _, cks = await _sandbox_with_turns(a, ALICE, "web", "v1", "v2")
            data = await _export(a, ALICE, cks[-1])
            await _import(b, ALICE, data)
            other, mine = a.catalog.get(cks[0]).delta_blob, b.catalog.get(cks[-1]).delta_blob
            with b.db.tx() as conn:  # the same id, another content (hand-made: ids are random)
                conn.execute("UPDATE checkpoints SET delta_blob=? WHERE id=?", (other, cks[-1]))
            before = _world(b)
            with pytest.raises(ArchiveRejected) as err:
                await _import(b, ALICE, data)
            assert err.value.reason == "conflict" and _world(b) == before
            # Another uid's checkpoint of the same id: refused, not reported as theirs.
            with b.db.tx() as conn:
                conn.execute("UPDATE checkpoints SET delta_blob=? WHERE id=?", (mine, cks[-1]))
            with pytest.raises(PermissionDenied):
                await _import(b, BOB, data)

    run(body())


def test_the_store_quota_is_checked_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = _stack(tmp_path / "a", monkeypatch)
    b = _stack(tmp_path / "b", monkeypatch, quota={"max_store_bytes": 10})

    async def body() -> None:
        async with _engines(a, b):
            _, cks = await _sandbox_with_turns(a, ALICE, "web", "v1" * 1000)
            data = await _export(a, ALICE, cks[-1])
            before = _world(b)
            with pytest.raises(QuotaExceeded):
                await _import(b, ALICE, data)
            assert _world(b) == before and _staging_empty(b)

    run(body())


@pytest.mark.parametrize("cut", [0.3, 0.7, 0.95])
def test_a_truncated_archive_changes_nothing(two: tuple[Stack, Stack], cut: float) -> None:
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            _, cks = await _sandbox_with_turns(a, ALICE, "web", secrets.token_hex(200_000))  # incompressible
            data = await _export(a, ALICE, cks[-1])
            before = _world(b)
            with pytest.raises(ArchiveRejected) as err:
                await _import(b, ALICE, data[: int(len(data) * cut)])
            assert err.value.reason == "truncated"
            assert _world(b) == before and _staging_empty(b)

    run(body())


def test_process_images_an_older_criu_cannot_restore_are_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _stack(tmp_path / "a", monkeypatch)
    b = _stack(tmp_path / "b", monkeypatch)
    old = b.service.archives.archives
    assert old is not None
    b.service.archives.archives = Archives(
        old.catalog,
        old.blobs,
        old.store_lock,
        old.root,
        lambda: "Version: 3.17.1",
        checker=old.checker,
        limits=old.limits,
    )

    async def body() -> None:
        async with _engines(a, b):
            rec = await a.service.create(ALICE, spec("srv", checkpoints="fs"))
            full = await a.service.create_checkpoint(ALICE, rec.id, "", "full")
            assert full.process_blob
            got = await _import(b, ALICE, await _export(a, ALICE, full.id))
            why = got.dropped[full.id]
            assert "CRIU 4.2.1" in why and "3.17.1" in why
            here = b.catalog.get(full.id)
            assert here.kind is CheckpointKind.FS and here.process_blob is None
            assert here.stats["process_image_dropped"] == why
            # The image's blobs were verified but not stored; files and session fork.
            assert full.process_blob not in b.blob_files()
            _, forks = await b.service.fork(ALICE, full.id, "", 1, "")
            assert forks[0].state.value == "running"

    run(body())


def test_sqlite_sees_one_transaction_for_the_whole_line(two: tuple[Stack, Stack]) -> None:
    """Every checkpoint of an archive appears at once: a reader between never sees part of the line."""
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            _, cks = await _sandbox_with_turns(a, ALICE, "web", "v1", "v2")
            data = await _export(a, ALICE, cks[-1], ancestors=True)
            seen: list[int] = []
            real = b.catalog.adopt_all

            def spy(*args: Any) -> list[str]:
                seen.append(_count(b))
                out = real(*args)
                seen.append(_count(b))
                return out

            b.catalog.adopt_all = spy  # type: ignore[method-assign,assignment]
            await _import(b, ALICE, data)
            assert seen == [0, len(cks)]

    run(body())


def _count(st: Stack) -> int:
    conn = sqlite3.connect(st.cfg.paths.state_dir / "registry.db")
    try:
        return int(
            conn.execute(
                "SELECT COUNT(*) FROM checkpoints WHERE sandbox_id NOT IN (SELECT id FROM sandboxes)"
            ).fetchone()[0]
        )
    finally:
        conn.close()


class _engines:
    """The host engines of some stacks, running for an ``async with`` body."""

    def __init__(self, *stacks: Stack) -> None:
        self.stacks = stacks

    async def __aenter__(self) -> None:
        for st in self.stacks:
            await st.engine.start()

    async def __aexit__(self, *exc: object) -> None:
        for st in self.stacks:
            await st.engine.close()


def test_errors_cross_the_wire_as_archive_rejected() -> None:
    err = ArchiveRejected("x", member="blobs/a.zst", reason="hash")
    assert isinstance(err, CrabError) and err.attrs == {"member": "blobs/a.zst", "reason": "hash"}


def test_a_sandbox_spec_past_this_hosts_limits_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork of an imported checkpoint gets its spec: it must be one a create request here could ask for."""
    a = _stack(tmp_path / "a", monkeypatch)
    b = _stack(tmp_path / "b", monkeypatch, limits={"max_memory_bytes": 64 << 20, "default_memory_bytes": 32 << 20})

    async def body() -> None:
        async with _engines(a, b):
            rec = await a.service.create(ALICE, spec("big", checkpoints="fs", memory_bytes=1 << 30))
            ck = await a.service.create_checkpoint(ALICE, rec.id, "", "fs")
            before = _world(b)
            with pytest.raises(ArchiveRejected) as err:
                await _import(b, ALICE, await _export(a, ALICE, ck.id))
            assert "memory" in err.value.message and _world(b) == before and _staging_empty(b)

    run(body())


@pytest.mark.parametrize(
    "image", ["docker.io/library/alpine:latest", "crab-env/busybox:0123abcd", "crab-env/bookworm:../x", ""]
)
def test_a_record_naming_an_image_that_is_not_its_env_image_is_refused(two: tuple[Stack, Stack], image: str) -> None:
    """A fork starts the image the record names: an archive must not pick any image the host happens to have."""
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            rec = await a.service.create(ALICE, spec("img", checkpoints="fs"))
            ck = await a.service.create_checkpoint(ALICE, rec.id, "", "fs")
            assert ck.image.startswith("crab-env/bookworm:")  # the fakes' env
            forged = rewrite_manifest(await _export(a, ALICE, ck.id), lambda d: d["checkpoints"][0].update(image=image))
            before = _world(b)
            with pytest.raises(ArchiveRejected, match="not one of crab's env images"):
                await _import(b, ALICE, forged)
            assert _world(b) == before and _staging_empty(b)

    run(body())
