"""Per-uid quotas against a real crabd ([quota] in crabd.toml; docs/security.md, "Quotas")."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.errors import InvalidRequest, QuotaExceeded
from crabd.sdk import AsyncClient, Client, EmbeddedDaemon, QuotaUse
from tests.conftest import CRABCTL, have_docker, have_root, require
from tests.integration.conftest import USER_IN_GROUP, remove_daemon_containers, run_as

STORE_LIMIT = 2 << 20
CONFIG = f"""
[quota]
max_sandboxes = 2
max_concurrent_forks = 2
max_store_bytes = {STORE_LIMIT}
max_session_state_bytes = 65536
turns_kept = 3
"""


@pytest.fixture(scope="module")
def qdaemon() -> Iterator[EmbeddedDaemon]:
    require(have_root(), "needs root")
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    base = Path(tempfile.mkdtemp(prefix="crab-q", dir="/tmp"))
    os.chmod(base, 0o711)  # the other uid reaches the socket (itself 0660 root:crab)
    (base / "crabd.toml").write_text(CONFIG)
    d = EmbeddedDaemon(state_dir=base, extra_args=["--config", str(base / "crabd.toml")])
    d.start()
    try:
        yield d
    finally:
        d.close()
        remove_daemon_containers(d)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root(qdaemon: EmbeddedDaemon) -> Iterator[Client]:
    with Client(qdaemon.socket) as c:
        yield c
        for sb in c.list():
            sb.remove(force=True)


def _blob_files(d: EmbeddedDaemon) -> set[str]:
    return {p.name for p in (d.state_dir / "blobs" / "sha256").rglob("*") if p.is_file()}


def _as_user(d: EmbeddedDaemon, users: dict[str, tuple[int, int]], body: str) -> dict[str, list[object]]:
    uid, gid = users[USER_IN_GROUP]
    return run_as(uid, gid, [grp.getgrnam("crab").gr_gid], d.socket, body)  # type: ignore[return-value]


def test_user_past_the_sandbox_quota_is_refused_and_nothing_is_created(
    qdaemon: EmbeddedDaemon, root: Client, users: dict[str, tuple[int, int]]
) -> None:
    res = _as_user(
        qdaemon,
        users,
        """
        a = c.create("busybox", name="q-a")
        c.create("busybox", name="q-b")
        attempt("third", lambda: c.create("busybox", name="q-c").id)
        attempt("fork", lambda: [s.id for s in c.fork(a.checkpoints()[0], 1)])
        attempt("names", lambda: sorted(s.name for s in c.list()))
        attempt("use", lambda: [c.quota().sandboxes, c.quota().max_sandboxes, c.quota().limited])
        attempt("root_use", lambda: c.quota(0).uid)
        """,
    )
    for key in ("third", "fork"):
        kind, message = res[key]
        assert kind == "QuotaExceeded", res[key]
        assert "limit of 2" in str(message)
    assert res["names"] == ["ok", ["q-a", "q-b"]]
    assert res["use"] == ["ok", [2, 2, True]]
    assert res["root_use"][0] == "PermissionDenied"
    # Nothing was made: no sandbox, no fork, and root (exempt) still creates freely.
    assert sorted(s.name for s in root.list()) == ["q-a", "q-b"]
    root.create("busybox", name="q-root")
    assert root.quota().limited is False
    assert root.quota(users[USER_IN_GROUP][0]).sandboxes == 2
    # `crabctl quota`: the same numbers, for humans and as JSON.
    env = dict(os.environ, CRAB_SOCKET=str(qdaemon.socket))
    uid = str(users[USER_IN_GROUP][0])
    done = subprocess.run([CRABCTL, "quota", "--uid", uid, "--json"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["sandboxes"] == 2 and got["max_sandboxes"] == 2 and got["limited"] is True
    done = subprocess.run([CRABCTL, "quota"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "exempt" in done.stdout and "sandboxes" in done.stdout, done.stderr


def test_checkpoint_past_the_store_quota_is_refused_and_releases_its_blobs(
    qdaemon: EmbeddedDaemon, root: Client, users: dict[str, tuple[int, int]]
) -> None:
    sb = None
    res = _as_user(qdaemon, users, 'sb = c.create("busybox", name="q-store")\nattempt("id", lambda: sb.id)')
    sb = root.get(str(res["id"][1]))
    before = [c.id for c in sb.checkpoints()]
    assert len(before) == 1  # the creation baseline, well under the limit
    # 3 MiB that do not compress: past the 2 MiB quota once stored.
    sb.run(["sh", "-c", "head -c 3145728 /dev/urandom > /big"])
    blobs = _blob_files(qdaemon)
    res = _as_user(qdaemon, users, f'attempt("ck", lambda: c.get({sb.id!r}).checkpoint().id)')
    kind, message = res["ck"]
    assert kind == "QuotaExceeded", res["ck"]
    assert f"({STORE_LIMIT} bytes)" in str(message)
    # Existing checkpoints untouched, the refusal recorded, and what it stored given back.
    assert [c.id for c in sb.checkpoints()] == before
    assert any("max_store_bytes" in f.error or "limit" in f.error for f in root.checkpoint_failures(sb.id))
    assert _blob_files(qdaemon) == blobs
    # Under the quota again, checkpoints go on.
    sb.run(["rm", "/big"])
    res = _as_user(qdaemon, users, f'attempt("ck", lambda: c.get({sb.id!r}).checkpoint().id)')
    assert res["ck"][0] == "ok"
    use = root.quota(users[USER_IN_GROUP][0])
    assert 0 < use.store_bytes < STORE_LIMIT and use.checkpoints == 2


def test_huge_session_state_refused_and_old_turns_pruned(root: Client) -> None:
    sb = root.create("bookworm", name="q-session")
    sb.begin_turn()
    sb.session.run("BIG=$(head -c 100000 /dev/zero | tr '\\0' a)")
    with pytest.raises(QuotaExceeded) as info:
        sb.end_turn()
    assert info.value.limit == 65536 and "65536" in str(info.value)
    assert sb.turns(limit=1)[0].open  # refused: the turn is still open, nothing stored
    sb.session.run("unset BIG")
    sb.end_turn(wait=True)
    for i in range(4):
        sb.begin_turn()
        sb.session.run(f"echo {i} > /root/f{i}")
        sb.end_turn(wait=True)
    turns = sb.turns()
    assert [t.number for t in turns] == [3, 4, 5]  # turns_kept = 3
    assert len(sb.checkpoints()) >= 5  # checkpoints are not pruned with their turns
    with pytest.raises(InvalidRequest, match="no turn 1"):
        sb.restore(turn=1)
    sb.restore(turn=4)  # turn 1 ended with BIG refused then unset; turns 2-5 wrote f0-f3
    assert sb.run(["ls", "/root"]).text.split() == ["f0", "f1", "f2"]


def test_orphaned_blobs_are_reclaimed_at_start(qdaemon: EmbeddedDaemon, root: Client) -> None:
    # What a checkpoint that crashed before publication leaves: a blob file nothing references.
    orphan = qdaemon.state_dir / "blobs" / "sha256" / "ab" / ("ab" + "0" * 62)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"not referenced by anything")
    live = _blob_files(qdaemon) - {orphan.name}
    qdaemon.close()
    qdaemon.start()
    qdaemon.wait_settled()  # the start-up gc runs once crabd serves (daemon/app.py)
    assert not orphan.exists()
    assert _blob_files(qdaemon) >= live  # nothing live went
    assert re.search(r"orphaned blobs reclaimed", qdaemon.log_file.read_text())

    async def use() -> QuotaUse:
        async with AsyncClient(qdaemon.socket) as ac:
            return await ac.quota(0)

    got = asyncio.run(use())  # the async SDK's call too
    assert got.uid == 0 and got.limited is False and got.max_sandboxes == 2
