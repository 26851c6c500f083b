"""Provenance through the service on fake backends: archives exported here come back with their processes,
another host's (or a changed byte anywhere) come with files only, and a restore checks before it starts."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from crabd.coordinator.archives import Imported
from crabd.errors import ArchiveRejected, ProvenanceRefused
from crabd.models import Caller, CheckpointKind, CheckpointRecord
from crabd.store.archive import MANIFEST_NAME, ArchiveManifest
from crabd.trust.keys import PUB_FILE, TRUSTED_DIR
from crabd.trust.seals import seal_archive
from tests.archive_forge import canonical, rewrite_manifest
from tests.fakes import ALICE, BOB, Stack, build_stack, run, spec


async def _chunks(data: bytes, n: int = 65536) -> AsyncIterator[bytes]:
    for i in range(0, len(data), n):
        yield data[i : i + n]


async def _export(st: Stack, caller: Caller, ckpt: str) -> bytes:
    return b"".join([c async for c in st.service.archives.export(caller, ckpt, False)])


async def _import(st: Stack, caller: Caller, data: bytes) -> Imported:
    return await st.service.archives.import_archive(caller, _chunks(data))


def _stack(root: Path, monkeypatch: pytest.MonkeyPatch) -> Stack:
    root.mkdir()
    return build_stack(root, monkeypatch)


def _trust(st: Stack, peer: Stack) -> None:
    """``st`` trusts ``peer``'s key, as root installs it (a file in trusted/, not writable by others)."""
    ring = st.provenance.ring
    dst = ring.directory / TRUSTED_DIR / f"peer-{peer.provenance.ring.key_id[:8]}.pub"
    shutil.copyfile(peer.provenance.ring.directory / PUB_FILE, dst)
    os.chmod(dst, 0o644)


async def _full(st: Stack, caller: Caller, name: str) -> CheckpointRecord:
    """A full checkpoint (files, session, process image) of a new sandbox of ``caller``'s."""
    rec = await st.service.create(caller, spec(name, checkpoints="fs"))
    await st.turn(caller, rec.id, f"{name} state")
    full = await st.service.create_checkpoint(caller, rec.id, "", "full")
    assert full.process_blob and full.provenance
    return full


async def _gone(st: Stack, caller: Caller, ckpt: CheckpointRecord) -> None:
    """Remove ``ckpt``'s sandbox with its checkpoints, so an archive of it imports anew."""
    await st.service.remove(caller, ckpt.sandbox_id, True)
    assert st.catalog.find(ckpt.id) is None


class _engines:
    def __init__(self, *stacks: Stack) -> None:
        self.stacks = stacks

    async def __aenter__(self) -> None:
        for st in self.stacks:
            await st.engine.start()

    async def __aexit__(self, *exc: object) -> None:
        for st in self.stacks:
            await st.engine.close()


@pytest.fixture
def two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Stack, Stack]:
    return _stack(tmp_path / "a", monkeypatch), _stack(tmp_path / "b", monkeypatch)


def test_an_export_from_here_reimports_here_with_its_processes(two: tuple[Stack, Stack]) -> None:
    a, _ = two

    async def body() -> None:
        async with _engines(a):
            full = await _full(a, ALICE, "srv")
            data = await _export(a, ALICE, full.id)
            await _gone(a, ALICE, full)
            got = await _import(a, ALICE, data)
            assert not got.dropped
            here = a.catalog.get(full.id)
            assert here.kind is CheckpointKind.FULL and here.process_blob == full.process_blob
            assert here.provenance == full.provenance and a.provenance.verify(here).trusted
            _, forks = await a.service.fork(ALICE, full.id, "", 1, "")
            assert forks[0].state.value == "running"
            # What came from an archive is never signed here, even with none of its own.
            assert a.provenance.backfill(a.catalog) == 0

    run(body())


def test_another_hosts_export_imports_files_only_until_its_key_is_trusted(two: tuple[Stack, Stack]) -> None:
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            full = await _full(a, ALICE, "srv")
            data = await _export(a, ALICE, full.id)
            got = await _import(b, BOB, data)
            why = got.dropped[full.id]
            assert "does not trust" in why
            here = b.catalog.get(full.id)
            assert here.kind is CheckpointKind.FS and here.process_blob is None
            assert here.stats["process_image_dropped"] == why
            assert here.provenance == full.provenance  # carried, never re-signed
            _, forks = await b.service.fork(BOB, full.id, "", 1, "")
            assert forks[0].state.value == "running"
            await b.service.remove(BOB, forks[0].id, True)
            # Root trusts host a's key: the same archive now brings the processes.
            await b.service.delete_checkpoint(BOB, full.id)
            _trust(b, a)
            got = await _import(b, BOB, data)
            assert not got.dropped and b.catalog.get(full.id).process_blob == full.process_blob

    run(body())


def test_a_reexport_carries_the_producers_provenance_never_the_exporters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c = (_stack(tmp_path / n, monkeypatch) for n in "abc")

    async def body() -> None:
        async with _engines(a, b, c):
            # c is trusted by nobody; b imports c's checkpoint (files only) and exports it on.
            theirs = await _full(c, ALICE, "evil")
            got = await _import(b, ALICE, await _export(c, ALICE, theirs.id))
            assert theirs.id in got.dropped
            _trust(a, b)
            laundered = await _export(b, ALICE, theirs.id)
            doc = _manifest(laundered)
            assert json.loads(doc["checkpoints"][0]["provenance"])["key"] == c.provenance.ring.key_id
            got = await _import(a, ALICE, laundered)
            assert a.catalog.get(theirs.id).process_blob is None
            # The forger puts the process image back into b's (sealed) export: the seal breaks.
            forged = rewrite_manifest(laundered, lambda d: d["checkpoints"][0].update(kind="full"))
            await a.service.delete_checkpoint(ALICE, theirs.id)
            with pytest.raises(ArchiveRejected):  # the process blob is not in the archive at all
                await _import(
                    a, ALICE, rewrite_manifest(forged, lambda d: d["checkpoints"][0].update(process_blob="0" * 64))
                )
            # b trusts a: a's checkpoint through b comes to a third host that trusts b only as files.
            _trust(b, a)
            mine = await _full(a, ALICE, "srv")
            got = await _import(b, ALICE, await _export(a, ALICE, mine.id))
            assert not got.dropped
            again = await _export(b, ALICE, mine.id)
            assert json.loads(_manifest(again)["checkpoints"][0]["provenance"])["key"] == a.provenance.ring.key_id
            got = await _import(c, ALICE, again)
            assert "does not trust" in got.dropped[mine.id]

    run(body())


def _manifest(data: bytes) -> dict[str, Any]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        f = tar.extractfile(MANIFEST_NAME)
        assert f is not None
        doc: dict[str, Any] = json.loads(f.read())
        return doc


def _members(data: bytes) -> list[tuple[int, int, str]]:
    """(offset, size, name) of each member's body in the tar stream."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        return [(m.offset_data, m.size, m.name) for m in tar.getmembers()]


def _flips(data: bytes) -> list[tuple[str, bytes]]:
    """Copies of ``data``, each with one byte of one member's body changed (several places per member).

    In the manifest, a letter or digit is swapped for another so that the JSON stays JSON:
    what is tested is the seal and the provenance, not the parser.
    """
    out = []
    for off, size, name in _members(data):
        places = range(0, size, max(1, size // 60)) if name == MANIFEST_NAME else {0, size // 2, size - 1}
        for at in places:
            b = data[off + at]
            if name == MANIFEST_NAME:
                ch = chr(b)
                if not ch.isalnum():
                    continue
                new = (ord("1") if ch != "1" else ord("2")) if ch.isdigit() else (ord("a") if ch != "a" else ord("b"))
            else:
                new = b ^ 0x01
            forged = bytearray(data)
            forged[off + at] = new
            out.append((f"{name}@{at}", bytes(forged)))
    return out


def test_a_byte_changed_anywhere_never_brings_processes(two: tuple[Stack, Stack]) -> None:
    """Imported into the host that made it (which trusts its own key): the strongest case."""
    a, _ = two

    async def body() -> None:
        async with _engines(a):
            full = await _full(a, ALICE, "srv")
            data = await _export(a, ALICE, full.id)
            await _gone(a, ALICE, full)
            flips = _flips(data)
            assert len(flips) > 30
            outcomes: dict[str, int] = {"rejected": 0, "files only": 0}
            for where, forged in flips:
                try:
                    got = await _import(a, ALICE, forged)
                except ArchiveRejected:
                    outcomes["rejected"] += 1
                    assert a.catalog.find(full.id) is None, where
                    continue
                recs = [r for r in got.checkpoints if r.process_blob]
                assert not recs, f"{where}: a process image came through"
                outcomes["files only"] += 1
                for r in got.checkpoints:
                    await a.service.delete_checkpoint(ALICE, r.id)
            assert outcomes["rejected"] and outcomes["files only"]
            # And the archive as it was still brings them.
            got = await _import(a, ALICE, data)
            assert a.catalog.get(full.id).process_blob == full.process_blob

    run(body())


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda d: d["checkpoints"][0].update(spec_json=d["checkpoints"][0]["spec_json"] + " "), id="spec"),
        pytest.param(lambda d: d["checkpoints"][0].update(provenance=""), id="no-provenance"),
        pytest.param(lambda d: d.update(seal=""), id="no-seal"),
        pytest.param(lambda d: d.update(kernel="6.99.0"), id="host-field"),
        pytest.param(lambda d: d["checkpoints"][0].update(racy_ns=d["checkpoints"][0]["racy_ns"] + 1), id="racy"),
    ],
)
def test_forged_manifests_import_files_only(two: tuple[Stack, Stack], change: Any) -> None:
    a, _ = two

    async def body() -> None:
        async with _engines(a):
            full = await _full(a, ALICE, "srv")
            data = await _export(a, ALICE, full.id)
            await _gone(a, ALICE, full)
            got = await _import(a, ALICE, rewrite_manifest(data, change, canonical))
            assert full.id in got.dropped and a.catalog.get(full.id).process_blob is None
            assert "byte for byte" not in got.dropped[full.id]  # the seal or the provenance caught it

    run(body())


def test_a_forged_provenance_re_signed_by_an_untrusted_host_is_refused(two: tuple[Stack, Stack]) -> None:
    """The forger has a crab host of its own: it signs and seals a changed record with that host's key."""
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            full = await _full(a, ALICE, "srv")
            data = await _export(a, ALICE, full.id)
            await _gone(a, ALICE, full)

            def resign(d: dict[str, Any]) -> None:
                rec = a.catalog.list_checkpoints()  # nothing: the forger works from the archive alone
                assert not [r for r in rec if r.id == full.id]
                c = d["checkpoints"][0]
                c["spec_json"] = c["spec_json"].replace('"env"', '"env" ')
                forged = CheckpointRecord(**{**c, "stats": c["stats"], "kind": CheckpointKind(c["kind"])})
                c["provenance"] = b.provenance.sign(forged)
                d["seal"] = ""
                sealed = seal_archive(b.provenance.ring, ArchiveManifest.model_validate(d))
                d["seal"] = sealed.seal

            got = await _import(a, ALICE, rewrite_manifest(data, resign, canonical))
            assert "does not trust" in got.dropped[full.id]

    run(body())


def test_a_restore_checks_provenance_first_and_changes_nothing(two: tuple[Stack, Stack]) -> None:
    a, _ = two

    async def body() -> None:
        async with _engines(a):
            full = await _full(a, ALICE, "srv")
            before = a.sandboxes.row(full.sandbox_id)
            assert before is not None
            n = len(a.sandboxes.list_sandboxes(None))
            with a.db.tx() as conn:  # a catalog row changed behind crabd's back (or a bug)
                conn.execute("UPDATE checkpoints SET spec_json=spec_json || ' ' WHERE id=?", (full.id,))
            with pytest.raises(ProvenanceRefused) as err:
                await a.service.fork(ALICE, full.id, "", 1, "")
            assert err.value.checkpoint == full.id and "spec_json" in err.value.reason
            with pytest.raises(ProvenanceRefused):
                await a.service.restore(ALICE, full.sandbox_id, full.id, -1)
            after = a.sandboxes.row(full.sandbox_id)
            assert after is not None and after.container_id == before.container_id
            assert len(a.sandboxes.list_sandboxes(None)) == n

    run(body())


def test_checkpoints_from_before_provenance_are_signed_at_start_if_made_here(two: tuple[Stack, Stack]) -> None:
    a, b = two

    async def body() -> None:
        async with _engines(a, b):
            sign = a.checkpointer.provenance
            a.checkpointer.provenance = None  # as published before this change
            old = await _full_unsigned(a)
            a.checkpointer.provenance = sign
            with pytest.raises(ProvenanceRefused, match="no provenance"):
                await a.service.fork(ALICE, old.id, "", 1, "")
            # One that came from another host before the change (no provenance, marked as imported).
            b.checkpointer.provenance = None
            theirs = await _full_unsigned(b)
            await _import(a, ALICE, await _export(b, ALICE, theirs.id))
            with a.db.tx() as conn:  # as an import before this change recorded it: image kept, unsigned
                conn.execute(
                    "UPDATE checkpoints SET kind='full', process_blob=?, provenance='' WHERE id=?",
                    (theirs.process_blob, theirs.id),
                )
            assert a.provenance.backfill(a.catalog) == 2  # the full checkpoint and its sandbox's creation baseline
            assert a.catalog.get(old.id).provenance and not a.catalog.get(theirs.id).provenance
            _, forks = await a.service.fork(ALICE, old.id, "", 1, "")
            assert forks[0].state.value == "running"
            with pytest.raises(ProvenanceRefused):
                await a.service.fork(ALICE, theirs.id, "", 1, "")

    run(body())


async def _full_unsigned(st: Stack) -> CheckpointRecord:
    rec = await st.service.create(ALICE, spec("old", checkpoints="fs"))
    full = await st.service.create_checkpoint(ALICE, rec.id, "", "full")
    assert full.process_blob and not full.provenance
    return full
