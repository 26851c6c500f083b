"""Per-uid quota accounting (crabd/service/quota.py, crabd/store/accounting.py), turn pruning, the blob journal."""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.queues
import os
import threading
import time
from pathlib import Path

import pytest

from crabd.api import errors as wire
from crabd.config import QuotaConfig, load_config
from crabd.coordinator.turns import check_session_state
from crabd.errors import ConfigError, QuotaExceeded
from crabd.models import CommandRecord, SandboxRecord, SandboxSpec, SandboxState
from crabd.service.quota import Quotas
from crabd.store import accounting, charges, reservations
from crabd.store.db import Database
from crabd.store.fsblobs import FileBlobStore
from crabd.store.registry import SESSION_STATES_KEPT, Registry


def _hold(d: Database, uid: int, nbytes: int) -> None:
    """Charge ``uid`` ``nbytes`` more, as blobs its checkpoints reference would (store/charges.py)."""
    with d.tx() as conn:
        charges._bump_usage(conn, uid, nbytes, 1)


def test_store_bytes_charged_per_uid_from_one_row(tmp_path: Path) -> None:
    # The measure changed with issue 33: no longer the sum of checkpoints' new_bytes (a deleted
    # checkpoint's blobs kept alive by a head were then charged to nobody) but what the uid's
    # checkpoints and heads reference (tests/unit/test_charges.py).  The check reads one row.
    with Database(tmp_path / "r.db") as d:
        _hold(d, 1000, 300)
        _hold(d, 1000, 200)
        _hold(d, 1001, 7)
        assert accounting.store_bytes_used(d, 1000) == 500
        assert accounting.store_bytes_used(d, 1001) == 7
        assert accounting.store_bytes_used(d, 4242) == 0
        assert accounting.store_blobs_held(d, 1000) == 2
        with d.lock:
            plan = d.conn.execute("EXPLAIN QUERY PLAN SELECT bytes, blobs FROM uid_usage WHERE uid=?", (1000,))
            assert "PRIMARY KEY" in str(plan.fetchall()) or "INTEGER PRIMARY KEY" in str(plan)


def test_store_quota_refuses_at_and_past_the_limit_and_exempts_root(tmp_path: Path) -> None:
    with Database(tmp_path / "r.db") as d:
        q = Quotas(QuotaConfig(max_store_bytes=1000), d)
        _hold(d, 1000, 600)
        q.check_store(1000, 0)  # under: may start
        q.check_store(1000, 400)  # exactly at the limit after: allowed
        with pytest.raises(QuotaExceeded) as info:
            q.check_store(1000, 401)
        e = info.value
        assert (e.quota, e.limit, e.used, e.requested, e.uid) == ("max_store_bytes", 1000, 600, 401, 1000)
        assert "1000 bytes" in e.message
        _hold(d, 1000, 400)
        with pytest.raises(QuotaExceeded):
            q.check_store(1000, 0)  # at the limit: not even started
        _hold(d, 0, 10**12)
        q.check_store(0, 10**12)  # root exempt by default
        strict = Quotas(QuotaConfig(max_store_bytes=1000, exempt_root=False), d)
        with pytest.raises(QuotaExceeded):
            strict.check_store(0, 0)


def _own_sandbox(d: Database, uid: int, sid: str) -> None:
    spec = SandboxSpec(env="base")
    Registry(d).insert_sandbox(SandboxRecord(sid, sid, uid, spec, "img", "", SandboxState.RUNNING, 0.0))


def test_sandbox_reservations_count_requests_in_flight(tmp_path: Path) -> None:
    with Database(tmp_path / "r.db") as d:
        _own_sandbox(d, 1000, "sb1")
        q = Quotas(QuotaConfig(max_sandboxes=4, max_concurrent_forks=2), d)
        with q.new_sandboxes(1000, 2, fork=True):
            # A concurrent request sees the reservation: 1 owned + 2 being made.
            with pytest.raises(QuotaExceeded) as info, q.new_sandboxes(1000, 2):
                pass
            assert info.value.quota == "max_sandboxes" and info.value.used == 3 and "limit of 4" in info.value.message
            with pytest.raises(QuotaExceeded) as forks, q.new_sandboxes(1000, 1, fork=True):
                pass
            assert forks.value.quota == "max_concurrent_forks" and forks.value.limit == 2
            assert q.use(1000).sandboxes == 3 and q.use(1000).forks_in_flight == 2
            with q.new_sandboxes(1000, 1):  # exactly the limit
                pass
            with q.new_sandboxes(2000, 4):  # other uids are counted apart
                pass
        # Released on exit, error or not.
        with pytest.raises(RuntimeError), q.new_sandboxes(1000, 3):
            raise RuntimeError("boom")
        with q.new_sandboxes(1000, 3):
            pass
        assert reservations.current(d, 1000) == reservations.UidSandboxes(owned=1, making=0, forking=0)
        with q.new_sandboxes(0, 100, fork=True):  # root exempt
            pass


def test_a_sandbox_being_made_counts_once(tmp_path: Path) -> None:
    # Its reservation and its row (``creating``) are one sandbox: counting both refused the second of
    # two concurrent creates under a limit of 2 (seen with [daemon] workers, true of one process too).
    with Database(tmp_path / "r.db") as d:
        q = Quotas(QuotaConfig(max_sandboxes=2), d)
        with q.new_sandboxes(1000, 1):
            spec = SandboxSpec(env="base")
            Registry(d).insert_sandbox(SandboxRecord("sb1", "sb1", 1000, spec, "img", "", SandboxState.CREATING, 0.0))
            assert q.use(1000).sandboxes == 1
            # The second is admitted; a third is one too many.
            with q.new_sandboxes(1000, 1), pytest.raises(QuotaExceeded), q.new_sandboxes(1000, 1):
                pass
        Registry(d).update_sandbox("sb1", state=SandboxState.RUNNING)
        assert q.use(1000).sandboxes == 1


def _reserve_in_another_process(path: str, tried: threading.Barrier, out: multiprocessing.queues.Queue[str]) -> None:
    """One of several crabd processes' requests: hold a reservation until every one has tried, or be refused."""
    with Database(Path(path)) as d:
        q = Quotas(QuotaConfig(max_sandboxes=3), d, shard=os.getpid())
        try:
            with q.new_sandboxes(1000, 1):
                out.put("admitted")
                tried.wait(60)
        except QuotaExceeded:
            out.put("refused")
            tried.wait(60)


def test_sandbox_reservations_hold_across_processes(tmp_path: Path) -> None:
    # [daemon] workers > 1: creates of one uid may run in different processes at once.  With the
    # old in-memory counter each process would admit all; the shared table admits 3 of 8 in all
    # (no reservation is released before all 8 have asked).
    path = tmp_path / "r.db"
    Database(path).close()
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.queues.Queue[str] = ctx.Queue()
    tried = ctx.Barrier(8)
    procs = [ctx.Process(target=_reserve_in_another_process, args=(str(path), tried, out)) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    got = sorted(out.get(timeout=5) for _ in procs)
    assert got.count("admitted") == 3 and got.count("refused") == 5
    assert all(p.exitcode == 0 for p in procs)


def test_a_dead_process_reservations_are_dropped(tmp_path: Path) -> None:
    with Database(tmp_path / "r.db") as d:
        q = Quotas(QuotaConfig(max_sandboxes=2), d, shard=3)
        held = q.new_sandboxes(1000, 2)
        held.__enter__()  # the process dies holding it: never released
        with pytest.raises(QuotaExceeded), Quotas(QuotaConfig(max_sandboxes=2), d, shard=0).new_sandboxes(1000, 1):
            pass
        assert reservations.drop_shard(d, 2) == 0  # another process's rows stay
        assert reservations.drop_shard(d, 3) == 1  # what its successor drops before serving
        with Quotas(QuotaConfig(max_sandboxes=2), d).new_sandboxes(1000, 2):
            pass
        held.__exit__(None, None, None)  # a release of a dropped row changes nothing
        assert reservations.current(d, 1000).making == 0


def test_quota_exceeded_crosses_the_wire_as_itself() -> None:
    err = QuotaExceeded("past it", uid=5, quota="max_sandboxes", limit=2, used=2, requested=1)
    code, _, md = wire.encode(err)
    assert code.name == "RESOURCE_EXHAUSTED"

    class Fake(Exception):
        def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
            return md

    back = wire.decode(Fake())  # type: ignore[arg-type]
    assert isinstance(back, QuotaExceeded) and back.limit == 2 and back.quota == "max_sandboxes"


def test_quota_config_section(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[quota]\nmax_sandboxes = 3\nturns_kept = 10\n")
    got = load_config(cfg).quota
    assert got.max_sandboxes == 3 and got.turns_kept == 10 and got.exempt_root
    cfg.write_text("[quota]\nmax_sandbox = 3\n")
    with pytest.raises(ConfigError):
        load_config(cfg)
    cfg.write_text("[quota]\nmax_session_state_bytes = 134217728\n")  # above what a turn may ever store
    with pytest.raises(ConfigError):
        load_config(cfg)


def test_session_state_above_the_limit_is_refused() -> None:
    check_session_state(None, 10, uid=1, sandbox="sb")
    check_session_state("x" * 10, 10, uid=1, sandbox="sb")
    with pytest.raises(QuotaExceeded) as info:
        check_session_state("é" * 6, 10, uid=1, sandbox="sb")  # 12 bytes in UTF-8
    assert info.value.requested == 12 and "limit of 10 bytes" in info.value.message


def _sandbox(reg: Registry, sid: str) -> None:
    spec = SandboxSpec(env="busybox", name=sid)
    reg.insert_sandbox(SandboxRecord(sid, sid, 0, spec, "img", "", SandboxState.RUNNING, time.time()))


def test_old_turns_are_pruned_with_their_commands(tmp_path: Path) -> None:
    with Database(tmp_path / "r.db") as d:
        reg = Registry(d)
        _sandbox(reg, "a")
        _sandbox(reg, "b")
        for _ in range(SESSION_STATES_KEPT + 10):
            t = reg.open_turn("a", time.time(), implicit=False)
            reg.add_command("a", t.number, CommandRecord(1, "exec", "true", 0, False, time.time(), 0.1, 0, 0))
            reg.close_turn("a", t.number, time.time(), '{"big": "state"}')
            reg.prune_turns("a", SESSION_STATES_KEPT + 5)
        reg.open_turn("b", time.time(), implicit=False)
        reg.prune_turns("b", 1)
        turns = reg.list_turns("a")
        top = SESSION_STATES_KEPT + 10
        assert [t.number for t in turns] == list(range(6, top + 1))
        assert all(len(t.commands) == 1 for t in turns)
        with d.lock:
            cmds = d.conn.execute("SELECT COUNT(*) FROM commands WHERE sandbox_id='a'").fetchone()[0]
        assert cmds == SESSION_STATES_KEPT + 5
        # Only the newest turns keep a session state; the latest is what fallbacks use.
        assert [t.number for t in turns if t.session_state_json] == list(range(top - SESSION_STATES_KEPT + 1, top + 1))
        assert reg.latest_session_state("a") == '{"big": "state"}'
        # Numbers go on from the highest kept; another sandbox is untouched.
        assert reg.open_turn("a", time.time(), implicit=False).number == top + 1
        assert [t.number for t in reg.list_turns("b")] == [1]


def test_journal_records_blobs_written_in_worker_threads(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path / "blobs")
    existing = store.put_bytes(b"already there").hex

    async def attempt() -> set[str]:
        with accounting.journal() as written:
            await asyncio.to_thread(store.put_bytes, b"new one")
            await asyncio.to_thread(store.put_pieces, [b"new ", b"two"])
            await asyncio.to_thread(store.put_bytes, b"already there")  # adopted: not ours to release
        return written

    written = asyncio.run(attempt())
    assert existing not in written and len(written) == 2
    store.put_bytes(b"outside any journal")  # no journal open: recorded nowhere
    assert len(written) == 2
