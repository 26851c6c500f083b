"""Group-committed transactions (crabd/store/db.py): the turn log without an fsync per row."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
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
    t0 = time.monotonic()
    d.close()
    assert time.monotonic() - t0 < 5 and not d._flusher._thread.is_alive()
