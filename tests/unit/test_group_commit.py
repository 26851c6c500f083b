"""Group-committed transactions (crabd/store/db.py): the turn log without an fsync per row."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from crabd.store.db import Database


def _child(path: Path, durable: bool) -> str:
    return textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from crabd.store.db import Database
        d = Database(Path({str(path)!r}), group_commit_s=60)  # no flush before the kill
        with d.tx(durable={durable}) as c:
            c.execute("INSERT INTO meta(key, value) VALUES('probe', 'kept')")
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )


@pytest.mark.parametrize("durable", [False, True])
def test_a_commit_survives_kill_9_either_way(tmp_path: Path, durable: bool) -> None:
    path = tmp_path / "registry.db"
    Database(path).close()
    done = subprocess.run([sys.executable, "-c", _child(path, durable)], timeout=60, env={**os.environ})
    assert done.returncode == -signal.SIGKILL
    with Database(path) as d:
        assert d.conn.execute("SELECT value FROM meta WHERE key='probe'").fetchone() == ("kept",)


def test_grouped_commits_share_one_fsync_soon_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[float] = []
    real = os.fsync

    def counting(fd: int) -> None:
        synced.append(time.monotonic())
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    with Database(tmp_path / "registry.db", group_commit_s=0.05) as d:
        synced.clear()
        t0 = time.monotonic()
        for i in range(20):
            with d.tx(durable=False) as c:
                c.execute("INSERT INTO meta(key, value) VALUES(?, 'x')", (f"k{i}",))
        assert d.conn.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL for those
        deadline = time.monotonic() + 5
        while not synced and time.monotonic() < deadline:
            time.sleep(0.01)
        assert synced and synced[0] - t0 < 2  # within the bound (generous on a loaded host)
        time.sleep(0.2)
        assert len(synced) <= 3  # 20 commits, a handful of fsyncs
        with d.tx() as c:  # a durable one goes back to FULL
            c.execute("INSERT INTO meta(key, value) VALUES('durable', 'x')")
        assert d.conn.execute("PRAGMA synchronous").fetchone() == (2,)


def test_close_flushes_and_stops_the_thread(tmp_path: Path) -> None:
    d = Database(tmp_path / "registry.db", group_commit_s=30)
    with d.tx(durable=False) as c:
        c.execute("INSERT INTO meta(key, value) VALUES('k', 'v')")
    thread = d._flusher._thread
    assert thread is not None and thread.is_alive()
    t0 = time.monotonic()
    d.close()
    assert time.monotonic() - t0 < 5 and not thread.is_alive()


def _flushers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "crab-wal-flush"]


def test_the_flusher_starts_with_the_first_group_commit(tmp_path: Path) -> None:
    before = set(_flushers())
    with Database(tmp_path / "registry.db", group_commit_s=0.01) as d:
        with d.tx() as c:  # durable commits (the migrations, this one) need no flusher
            c.execute("INSERT INTO meta(key, value) VALUES('durable', 'x')")
        assert d._flusher._thread is None and set(_flushers()) == before
        with d.tx(durable=False) as c:
            c.execute("INSERT INTO meta(key, value) VALUES('grouped', 'x')")
        thread = d._flusher._thread
        assert thread is not None and thread.is_alive() and set(_flushers()) - before == {thread}
    assert not thread.is_alive()


def test_concurrent_first_group_commits_start_one_flusher(tmp_path: Path) -> None:
    before = set(_flushers())
    with Database(tmp_path / "registry.db", group_commit_s=0.01) as d:
        gate = threading.Barrier(8)

        def commit(i: int) -> None:
            gate.wait()
            with d.tx(durable=False) as c:
                c.execute("INSERT INTO meta(key, value) VALUES(?, 'x')", (f"k{i}",))

        workers = [threading.Thread(target=commit, args=(i,)) for i in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=30)
        assert set(_flushers()) - before == {d._flusher._thread}


def test_a_database_that_never_group_commits_closes_without_a_flusher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        synced.append(fd)
        real(fd)

    d = Database(tmp_path / "registry.db", group_commit_s=30)
    monkeypatch.setattr(os, "fsync", counting)
    d.close()
    assert d._flusher._thread is None
    assert synced  # close() still syncs the WAL: whatever is pending is flushed either way
    d._flusher.due()  # a late commit's request after close() starts nothing
    assert d._flusher._thread is None
