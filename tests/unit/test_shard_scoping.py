"""With ``[daemon] workers`` > 1, what each process does only for its own sandboxes (``SandboxRecord.shard``),
and what the processes sharing one state dir must not trip over each other on."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from crabd.backends.criu.runc import keep_log
from crabd.backends.runc import bundle
from crabd.backends.runc.naming import container_id
from crabd.config import EngineConfig
from crabd.coordinator.replication import Replication, shard_owns
from crabd.engine import HostEngine
from crabd.errors import AlreadyExists, QuotaExceeded, StoreError
from crabd.models import SandboxRecord, SandboxSpec, SandboxState, ShardPlace
from crabd.store.db import Database
from crabd.store.registry import Registry
from crabd.util.aiolock import RWLock
from tests.fakes import ALICE, MemoryObjectStore, Stack, build_stack, run, spec
from tests.unit.test_remote_tier import make_host


def _set_shard(st: Stack, sandbox_id: str, shard: int) -> None:
    with st.db.tx() as conn:
        conn.execute("UPDATE sandboxes SET shard=? WHERE id=?", (shard, sandbox_id))


def _kill(st: Stack, rec: SandboxRecord) -> None:
    fresh = st.registry.get_sandbox(rec.id)
    assert fresh is not None
    st.backend.kill(fresh.container_id)


def _state(st: Stack, sandbox_id: str) -> SandboxState:
    got = st.registry.get_sandbox(sandbox_id)
    assert got is not None
    return got.state


# --- recovery -----------------------------------------------------------------------------------


def test_the_recovery_watch_leaves_another_process_s_dead_sandbox_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        mine = await st.service.create(ALICE, spec("mine", checkpoints="fs", recovery="auto"))
        theirs = await st.service.create(ALICE, spec("theirs", checkpoints="fs", recovery="auto"))
        _set_shard(st, theirs.id, 1)
        _kill(st, mine)
        _kill(st, theirs)
        # Both containers are in the runtime instance's exited list; only this process's is acted on.
        assert await st.recovery.sweep() == [mine.id]
        assert _state(st, mine.id) is SandboxState.RUNNING
        assert _state(st, theirs.id) is SandboxState.RUNNING  # not even marked dead: process 1's to find
        # Once it is this process's again (e.g. rehomed), the next sweep recovers it.
        _set_shard(st, theirs.id, 0)
        assert await st.recovery.sweep() == [theirs.id]

    run(body())


# --- replication --------------------------------------------------------------------------------


def test_shard_owns_takes_own_rows_and_process_0_the_rowless() -> None:
    rows = {
        "sb-0": SandboxRecord("sb-0", "a", 1, SandboxSpec(env="e"), "i", "", SandboxState.RUNNING, 0.0, shard=0),
        "sb-1": SandboxRecord("sb-1", "b", 1, SandboxSpec(env="e"), "i", "", SandboxState.RUNNING, 0.0, shard=1),
    }
    zero, one = shard_owns(0, rows.get), shard_owns(1, rows.get)
    assert [zero(s) for s in ("sb-0", "sb-1", "gone")] == [True, False, True]
    assert [one(s) for s in ("sb-0", "sb-1", "gone")] == [False, True, False]


def test_each_process_queues_only_its_own_backlog(tmp_path: Path) -> None:
    async def go() -> None:
        for h in make_host(tmp_path / "a", "host-a", MemoryObjectStore()):
            registry = Registry(h.db)
            for sid, name, shard in (("sb-1", "one", 0), ("sb-2", "two", 1)):
                registry.insert_sandbox(
                    SandboxRecord(
                        sid, name, 1000, SandboxSpec(env="e"), "i", "", SandboxState.RUNNING, 0.0, shard=shard
                    )
                )
            for i, sid in enumerate(("sb-1", "sb-2", "sb-gone")):
                h.publish(f"ck-{i}", [b"x%d" % i], turn=i + 1)
                with h.db.tx() as conn:
                    conn.execute("UPDATE checkpoints SET sandbox_id=? WHERE id=?", (sid, f"ck-{i}"))
            cfg = EngineConfig.model_validate({"max_concurrent": 1, "bandwidth_mib_s": 0})
            eng = HostEngine(cfg)  # not started: only the queue is looked at
            got = {}
            for label, owns in (
                ("shard-0", shard_owns(0, registry.get_sandbox)),
                ("shard-1", shard_owns(1, registry.get_sandbox)),
                ("default", None),
            ):
                if owns is None:
                    rep = Replication(h.tier, eng, RWLock(), max_inflight=1, retry_initial_s=1, retry_max_s=1)
                else:
                    rep = Replication(
                        h.tier, eng, RWLock(), max_inflight=1, retry_initial_s=1, retry_max_s=1, owns=owns
                    )
                await rep._queue_backlog()
                got[label] = sorted(rep._queue)
            assert got == {
                "default": ["ck-0", "ck-1", "ck-2"],  # one process: everything, as before
                "shard-0": ["ck-0", "ck-2"],  # its sandbox's, and the one whose sandbox has no row
                "shard-1": ["ck-1"],
            }

    asyncio.run(asyncio.wait_for(go(), 30))


# --- sandboxes: ephemeral shutdown, and names taken by another process ----------------------------


def test_an_ephemeral_shutdown_removes_only_this_process_s_sandboxes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        mine = await st.service.create(ALICE, spec("mine", checkpoints="none"))
        theirs = await st.service.create(ALICE, spec("theirs", checkpoints="none"))
        _set_shard(st, theirs.id, 1)
        await st.sandboxes.close(remove_all=True)
        assert st.registry.get_sandbox(mine.id) is None
        left = st.registry.get_sandbox(theirs.id)
        assert left is not None and left.container_id in st.backend.containers

    run(body())


def test_a_name_inserted_by_another_process_is_already_exists(tmp_path: Path) -> None:
    """Two connections to one database, as two crabd processes: the UNIQUE name refuses the second."""
    path = tmp_path / "registry.db"
    with Database(path) as d1, Database(path) as d2:
        r1, r2 = Registry(d1), Registry(d2)

        def rec(sid: str, name: str) -> SandboxRecord:
            return SandboxRecord(sid, name, 1000, SandboxSpec(env="e", name=name), "i", "", SandboxState.CREATING, 0.0)

        r1.insert_sandbox(rec("aaaa", "web"))
        with pytest.raises(AlreadyExists, match="a sandbox named 'web' already exists") as err:
            r2.insert_sandbox(rec("bbbb", "web"))
        assert err.value.name == "web"
        assert r2.get_sandbox("bbbb") is None
        # Nothing of the refused insert stays: its id was never claimed.
        assert d2.conn.execute("SELECT 1 FROM sandbox_ids WHERE id='bbbb'").fetchone() is None
        # Any other constraint is still the store's error.
        with pytest.raises(StoreError):
            r2.insert_sandbox(rec("aaaa", "other"))


def test_reserve_turns_a_lost_race_for_a_name_into_already_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        await st.service.create(ALICE, spec("web", checkpoints="none"))
        # Another process inserts between this one's check and its insert: the check saw nothing.
        monkeypatch.setattr(st.registry, "name_taken", lambda _name: False)
        with pytest.raises(AlreadyExists, match="a sandbox named 'web' already exists"):
            await st.sandboxes.reserve(ALICE.uid, spec("web", checkpoints="none"), "img")
        # Unnamed: the short name lost, the long one is taken instead.
        sid = "abcdef123456"
        await st.sandboxes.reserve(ALICE.uid, spec(checkpoints="none"), "img", sandbox_id="abcdef999999")
        got = await st.sandboxes.reserve(ALICE.uid, spec(checkpoints="none"), "img", sandbox_id=sid)
        assert got.name == f"sb-{sid}" and got.spec.name == got.name
        assert {r.name for r in st.registry.list_sandboxes(None)} == {"web", "sb-abcdef", f"sb-{sid}"}

    run(body())


def test_a_fork_that_loses_a_name_race_makes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        origin = await st.service.create(ALICE, spec("origin", checkpoints="fs"))
        ckpt = await st.service.create_checkpoint(ALICE, origin.id, "", "fs")
        await st.service.create(ALICE, spec("clone-2", checkpoints="none"))
        monkeypatch.setattr(st.registry, "name_taken", lambda _name: False)
        with pytest.raises(AlreadyExists, match="a sandbox named 'clone-2' already exists"):
            await st.service.fork(ALICE, ckpt.id, "", 3, "clone")
        assert {r.name for r in st.registry.list_sandboxes(None)} == {"origin", "clone-2"}

    run(body())


# --- files several processes write ----------------------------------------------------------------


def test_write_atomic_from_concurrent_writers_never_fails(tmp_path: Path) -> None:
    target = tmp_path / "crab.conflist"
    errors: list[BaseException] = []
    payloads = [(b"%d" % i) * 4096 for i in range(8)]

    def writer(data: bytes) -> None:
        try:
            for _ in range(50):
                bundle.write_atomic(target, data)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_bytes() in payloads
    assert [p.name for p in tmp_path.iterdir()] == ["crab.conflist"]  # no tmp file left
    assert target.stat().st_mode & 0o777 == 0o600


def test_write_atomic_removes_its_tmp_file_when_the_rename_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_: object) -> None:
        raise OSError("no")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="no"):
        bundle.write_atomic(tmp_path / "f", b"x")
    assert list(tmp_path.iterdir()) == []


def test_write_atomic_fsyncs_unless_told_the_file_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync

    def counted(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counted)
    bundle.write_atomic(tmp_path / "kept", b"a")
    assert len(synced) == 1
    bundle.write_atomic(tmp_path / "hostname", b"b\n", 0o644, durable=False)  # /etc files: made anew each start
    assert len(synced) == 1
    assert (tmp_path / "hostname").read_bytes() == b"b\n" and (tmp_path / "hostname").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostname", "kept"]


def test_kept_criu_logs_of_two_sandboxes_do_not_collide(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text("criu says\n")
    kept_dir = tmp_path / "kept"
    # Two runc containers of one instance: the same first 12 characters.
    a = container_id("host_instance_1", "aaaaaaaaaaaa", "g1")
    b = container_id("host_instance_1", "bbbbbbbbbbbb", "g1")
    assert a[:12] == b[:12]
    ka, kb = keep_log(log, kept_dir, a, "dump"), keep_log(log, kept_dir, b, "dump")
    assert ka is not None and kb is not None and ka != kb
    assert a in ka.name and b in kb.name
    assert len(list(kept_dir.iterdir())) == 2
    # An odd or overlong id still makes one sane name in the log dir.
    odd = keep_log(log, kept_dir, "../x/" + "y" * 400, "restore")
    assert odd is not None and odd.parent == kept_dir and len(odd.name) < 200 and "/" not in odd.name
    assert keep_log(tmp_path / "absent.log", kept_dir, a, "dump") is None


# --- archive imports ------------------------------------------------------------------------------


def test_concurrent_imports_are_divided_among_the_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch, archive={"max_concurrent_imports": 4})
    edge = st.service.archives
    assert edge.process_max_imports == 4  # one process: the whole limit, as before
    st.sandboxes.place = ShardPlace(0, ("a", "b"))
    assert edge.process_max_imports == 2
    st.sandboxes.place = ShardPlace(1, tuple("abcdefgh"))
    assert edge.process_max_imports == 1  # never below one
    st.sandboxes.place = ShardPlace(0, ("a", "b", "c"))
    with edge._one_import(ALICE), pytest.raises(QuotaExceeded) as err, edge._one_import(ALICE):
        pass
    assert err.value.attrs["limit"] == 1
    with edge._one_import(ALICE):  # the slot was given back
        pass
