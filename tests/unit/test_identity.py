"""Sandbox ids across owners, on fake backends: the id ledger, foreign ids renamed on archive import and
refused on arrival, and every lookup by sandbox id blind to another owner's checkpoints of that id."""

from __future__ import annotations

import os
import secrets
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from crabd.backends.runc.cleanup import Layout, secure_dirs
from crabd.backends.runc.cni import CniSettings
from crabd.errors import InvalidRequest, PermissionDenied
from crabd.models import Caller, CheckpointKind, RetentionPolicy
from crabd.store.db import Database
from crabd.store.identity import SandboxIds
from crabd.trust import identity
from tests.archive_forge import rewrite_manifest
from tests.fake_cluster import fake_cluster
from tests.fakes import ALICE, BOB, ROOT, Stack, build_stack, engine_running, run, spec


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _export(st: Stack, caller: Caller, ckpt: str, *, ancestors: bool = False) -> bytes:
    return b"".join([c async for c in st.service.archives.export(caller, ckpt, ancestors)])


def _forge(data: bytes, sandbox_id: str, name: str) -> tuple[bytes, list[str]]:
    """``data`` with every checkpoint renamed (new ids, parents followed) and claiming ``sandbox_id``."""
    ids: dict[str, str] = {}

    def change(doc: dict[str, Any]) -> None:
        for c in doc["checkpoints"]:
            ids[c["id"]] = "ck-" + secrets.token_hex(6)
        for c in doc["checkpoints"]:
            c.update(id=ids[c["id"]], sandbox_id=sandbox_id, sandbox_name=name)
            if c.get("parent_id") in ids:
                c["parent_id"] = ids[c["parent_id"]]

    out = rewrite_manifest(data, change)
    return out, list(ids.values())


async def _victim(st: Stack) -> tuple[str, list[str]]:
    """Alice's sandbox with a secret, two turns and a failure record, removed with its checkpoints kept."""
    rec = await st.service.create(ALICE, spec("victim", checkpoints="fs", env_vars={"SECRET": "alices"}))
    await st.turn(ALICE, rec.id, "alice-1")
    await st.turn(ALICE, rec.id, "alice-2")
    st.catalog.record_failure(rec.id, 2, CheckpointKind.FULL, "alice's failure", "")
    await st.service.remove(ALICE, "victim", True, keep_checkpoints=True)
    return rec.id, [c.id for c in st.catalog.list_checkpoints(rec.id)]


def test_ledger_remembers_every_id_and_refuses_a_second_owner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        async with engine_running(st):
            vid, _ = await _victim(st)
        ids = SandboxIds(st.db)
        assert st.registry.get_sandbox(vid) is None and ids.owner(vid) == ALICE.uid  # removed, remembered
        assert identity.foreign_owner(ids, vid, BOB.uid) == ALICE.uid
        assert identity.foreign_owner(ids, vid, ALICE.uid) is None
        assert identity.foreign_owner(ids, "never-seen", BOB.uid) is None
        # The registry's own write refuses a row that would give the id to another uid.
        bobs = await st.service.create(BOB, spec("bobs", checkpoints="none"))
        with pytest.raises(PermissionDenied):
            st.registry.insert_sandbox(replace(bobs, id=vid, name="squat"))
        assert st.registry.get_sandbox(vid) is None

    run(body())


def test_backfill_gives_an_id_to_its_first_user(tmp_path: Path) -> None:
    """A database from before the ledger: an id squatted then is its first owner's after the migration."""
    path = tmp_path / "registry.db"
    Database(path).close()
    conn = sqlite3.connect(path)
    cols = "(id, sandbox_id, sandbox_name, owner_uid, branch, turn, kind, created_at, image, spec_json, index_blob,"
    cols += " delta_blob, stats_json)"
    for ck, uid, at in (("ck-alice", ALICE.uid, 1.0), ("ck-bob", BOB.uid, 2.0)):
        conn.execute(
            f"INSERT INTO checkpoints{cols} VALUES(?,?,?,?,0,0,'fs',?,'img','{{}}','i','d','{{}}')",
            (ck, "sb1", "n", uid, at),
        )
    conn.execute("INSERT INTO failures(sandbox_id, turn, kind, at, error, log_path) VALUES('sb1',1,'fs',1,'x','')")
    conn.execute("DROP TABLE sandbox_ids")
    conn.commit()
    conn.close()
    with Database(path) as db:
        assert SandboxIds(db).owner("sb1") == ALICE.uid
        assert db.conn.execute("SELECT owner_uid FROM failures").fetchone()[0] == ALICE.uid


def test_archive_naming_a_removed_sandbox_of_another_uid_gets_a_fresh_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        async with engine_running(st):
            vid, alices = await _victim(st)
            bobs = await st.service.create(BOB, spec("bobs", checkpoints="fs"))
            await st.turn(BOB, bobs.id, "bob-1")
            await st.turn(BOB, bobs.id, "bob-2")
            head = st.checkpointer.head_id(bobs.id)
            assert head is not None
            forged, new = _forge(await _export(st, BOB, head, ancestors=True), vid, "victim")
            got = await st.service.archives.import_archive(BOB, _chunks(forged))
            sids = {c.sandbox_id for c in got.checkpoints}
            # One fresh id for the whole import (its lineage stays one sandbox's), never Alice's.
            assert len(sids) == 1 and vid not in sids and len(got.checkpoints) == len(new) > 1
            fresh = sids.pop()
            assert all(c.stats["archive_sandbox_id"] == vid and c.owner_uid == BOB.uid for c in got.checkpoints)
            assert [st.catalog.get(c).parent_id for c in new[1:]] == new[:-1]
            assert SandboxIds(st.db).owner(fresh) == BOB.uid
            # ImportSandbox of the imported checkpoint: a sandbox with the fresh id, nothing of Alice's.
            out = await st.service.import_sandbox(BOB, new[-1], -1)
            assert out.sandbox.id == fresh and out.sandbox.owner_uid == BOB.uid
            assert st.registry.get_sandbox(vid) is None
            # Turn 0 is Bob's own (forged) creation checkpoint, not Alice's.
            assert st.checkpointer.resolve_turn(out.sandbox, 0).id in new
            start = await st.service.restore(BOB, out.sandbox.name, "", 0)
            assert start.id == fresh and "SECRET" not in start.spec.env_vars
            assert {f.error for f in await st.service.failures(BOB, out.sandbox.name)} == set()
            assert all(st.catalog.get(c).owner_uid == ALICE.uid for c in alices)
            # Alice re-imports her own export: her id is kept.
            mine = await _export(st, ALICE, alices[-1])
            await st.service.delete_checkpoint(ALICE, alices[-1])
            again = await st.service.archives.import_archive(ALICE, _chunks(mine))
            assert [c.sandbox_id for c in again.checkpoints] == [vid]

    run(body())


def test_archive_naming_another_uids_live_sandbox_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        async with engine_running(st):
            alices = await st.service.create(ALICE, spec("alive", checkpoints="fs"))
            bobs = await st.service.create(BOB, spec("bobs", checkpoints="fs"))
            await st.turn(BOB, bobs.id, "bob-1")
            head = st.checkpointer.head_id(bobs.id)
            assert head is not None
            forged, _ = _forge(await _export(st, BOB, head), alices.id, "alive")
            before = sorted(c.id for c in st.catalog.list_checkpoints())
            for who in (BOB, ROOT):  # root too: an id never has two owners
                with pytest.raises(PermissionDenied):
                    await st.service.archives.import_archive(who, _chunks(forged))
            assert sorted(c.id for c in st.catalog.list_checkpoints()) == before

    run(body())


def test_import_sandbox_of_a_foreign_id_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        async with engine_running(st):
            vid, _ = await _victim(st)
            bobs = await st.service.create(BOB, spec("bobs", checkpoints="fs"))
            await st.turn(BOB, bobs.id, "bob-1")
            head = st.checkpointer.head_id(bobs.id)
            assert head is not None
            # A record as a bucket object or an old catalog could carry it: Bob's, naming Alice's id.
            forged = replace(st.catalog.get(head), sandbox_id=vid, sandbox_name="victim")
            with pytest.raises(PermissionDenied, match="belongs to another uid"):
                await st.recovery.arrive(forged, -1)
            assert st.registry.get_sandbox(vid) is None

    run(body())


def _squatted(st: Stack, victim_id: str, squatter_id: str) -> None:
    """What a squat before the ledger left: the victim's kept checkpoints and failure records carry the
    id of a sandbox another uid runs now."""
    with st.db.tx() as conn:
        conn.execute("UPDATE checkpoints SET sandbox_id=? WHERE sandbox_id=?", (squatter_id, victim_id))
        conn.execute("UPDATE failures SET sandbox_id=? WHERE sandbox_id=?", (squatter_id, victim_id))


def test_lookups_by_sandbox_id_see_only_the_owners_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        async with engine_running(st):
            vid, alices = await _victim(st)
            bobs = await st.service.create(BOB, spec("bobs", checkpoints="none"))
            _squatted(st, vid, bobs.id)
            assert {c.owner_uid for c in st.catalog.list_checkpoints(bobs.id)} == {ALICE.uid}
            # Turn resolution: turn 0 is not Alice's creation checkpoint.
            assert st.catalog.by_turn(bobs.id, 0, BOB.uid) == []
            with pytest.raises(InvalidRequest, match="no checkpoint of its creation"):
                await st.service.restore(BOB, "bobs", "", 0)
            # Failures: Alice's are not Bob's.
            assert await st.service.failures(BOB, "bobs") == []
            assert all(f.sandbox_id != bobs.id for f in await st.service.failures(BOB, ""))
            # Recovery: nothing of Bob's to recover from, so it is refused, not Alice's newest.
            st.backend.kill(st.registry.get_sandbox(bobs.id).container_id)  # type: ignore[union-attr]
            with pytest.raises(InvalidRequest, match="no checkpoint to recover from"):
                await st.service.recover(BOB, "bobs")
            # Retention: Bob's policy thins none of Alice's kept checkpoints.
            await st.service.retention.set_policy(BOB, "bobs", RetentionPolicy(keep_last=1))
            report = await st.service.retention.thin(BOB, "bobs", False)
            assert report.deleted == [] and all(st.catalog.find(c) is not None for c in alices)
            why = await st.service.retention.annotate([st.catalog.get(c) for c in alices])
            assert all(r.kept_for for r in why)
            # The tree from Bob's sandbox shows none of Alice's checkpoints.
            tree = await st.service.tree(BOB, "bobs", "")
            assert not tree.nodes

    run(body())


def test_existing_listable_dirs_are_made_private_at_start(tmp_path: Path) -> None:
    """A directory an older crabd left 0755 is 0700 after ``secure_dirs`` (run at every start)."""
    base = tmp_path / "run"
    layout = Layout(
        runc_root=base / "runc",
        bundles=base / "bundles",
        netns=base / "netns",
        rootfs=base / "rootfs",
        cni=CniSettings(cache_dir=base / "cni"),
    )
    for d in (layout.runc_root, layout.bundles, layout.netns, layout.cni.cache_dir):
        d.mkdir(parents=True)
        os.chmod(d, 0o755)
    secure_dirs(layout)
    for d in (layout.runc_root, layout.bundles, layout.netns, layout.cni.cache_dir):
        assert d.stat().st_mode & 0o777 == 0o700, d


def test_a_lost_hosts_sandbox_comes_back_from_its_owners_newest_checkpoint_only() -> None:
    """A newer bucket record of another uid naming the lost sandbox's id is not its newest checkpoint."""
    cluster, pool, fakes = fake_cluster()
    kept = cluster.create("busybox", name="kept", host="c")
    cluster.call("kept", "run", "v=1")
    own = cluster.call("kept", "checkpoint_full")
    fakes["c"].push(own["id"])
    fakes["c"].bucket.checkpoints[own["id"]]["owner_uid"] = ALICE.uid
    squat = dict(fakes["c"].bucket.checkpoints[own["id"]], id="ck-" + "5" * 12, owner_uid=BOB.uid)
    squat["created_at"] = own["created_at"] + 100.0
    squat["files"] = {"v": "bob's"}
    fakes["c"].bucket.checkpoints[squat["id"]] = squat
    pool.down.add("c")
    report = cluster.recover_host("c")
    (got,) = report["recovered"]
    assert got["sandbox"]["id"] == kept["id"] and got["checkpoint"] == own["id"]
    assert fakes[got["host"]].sandboxes[kept["id"]]["files"] == {"v": "1"}


def test_a_socket_directory_crabd_makes_is_crab_only(tmp_path: Path) -> None:
    """0750 root:crab where the group exists (its members must reach the socket), else 0700."""
    import grp

    from crabd.api.peercred import prepare_socket_path

    made = tmp_path / "made-here"
    prepare_socket_path(made / "crabd.sock")
    try:
        gid: int | None = grp.getgrnam("crab").gr_gid
    except KeyError:
        gid = None
    st = made.stat()
    assert st.st_mode & 0o777 == (0o700 if gid is None else 0o750)
    assert gid is None or st.st_gid == gid
    # A directory that exists and is not crab's own (e.g. a shared one) is left as it was.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    prepare_socket_path(shared / "crabd.sock")
    assert shared.stat().st_mode & 0o777 == 0o755


def test_a_bucket_checkpoint_naming_another_uids_sandbox_id_is_not_fetched(tmp_path: Path) -> None:
    """Host b's uid 2000 had sandbox "sb-1"; host a's uid 1000 checkpoint of a sandbox "sb-1" in the bucket
    is refused before a blob moves (and the catalog's own write would refuse it too)."""
    import asyncio

    from crabd.config import EngineConfig
    from crabd.coordinator.replication import Replication
    from crabd.engine import HostEngine
    from crabd.store import identity as ledger
    from crabd.util.aiolock import RWLock
    from tests.fakes import MemoryObjectStore
    from tests.unit.test_remote_tier import make_host

    objects = MemoryObjectStore()

    async def go() -> None:
        for a in make_host(tmp_path / "a", "host-a", objects):
            a.publish("ck-0", [b"a", b"b"])  # sandbox "sb-1", uid 1000
            a.tier.upload("ck-0")
        for b in make_host(tmp_path / "b", "host-b", objects):
            with b.db.tx() as conn:
                ledger.claim(conn, "sb-1", 2000, "create")
            async with HostEngine(EngineConfig.model_validate({"bandwidth_mib_s": 0})) as eng:
                rep = Replication(b.tier, eng, RWLock(), max_inflight=1, retry_initial_s=1, retry_max_s=1)
                gets = objects.gets
                with pytest.raises(PermissionDenied, match="belongs to another uid"):
                    await rep.fetch("ck-0", lambda _uid: None)
                assert objects.gets == gets + 1 and b.catalog.find("ck-0") is None  # the manifest only
                with pytest.raises(PermissionDenied):
                    b.tier.adopt(b.tier.manifest("ck-0"))
                assert b.catalog.find("ck-0") is None

    asyncio.run(asyncio.wait_for(go(), 30))
