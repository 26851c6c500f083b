"""Bad requests, corruption, a full disk, other users and kill -9 around checkpoints (issue 4)."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crabd.sdk import (
    CheckpointNotFound,
    Client,
    CorruptBlob,
    EmbeddedDaemon,
    InvalidRequest,
    PermissionDenied,
    Sandbox,
    StoreFull,
)
from crabd.util import cgroups
from crabd.util.cgroups import is_docker_id
from tests.conftest import CRABCTL
from tests.integration.conftest import USER_IN_GROUP, drop_snapshot, remove_instance_containers, run_as, start_kept


def _blob_file(daemon: EmbeddedDaemon, content: bytes) -> Path:
    h = hashlib.sha256(content).hexdigest()
    return daemon.state_dir / "blobs" / "sha256" / h[:2] / h


def _private_daemon(tag: str) -> Iterator[EmbeddedDaemon]:
    base = Path(f"/tmp/crab-{tag}-{os.getpid()}")
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o700)
    d = EmbeddedDaemon(state_dir=base, ephemeral=True)
    try:
        yield d
    finally:
        d.close()
        _remove_leftovers(base / "state")
        shutil.rmtree(base, ignore_errors=True)


def _remove_leftovers(state_dir: Path) -> None:
    remove_instance_containers(state_dir)


def test_restore_to_another_sandbox_lineage_is_refused(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    a = make_sandbox("busybox")
    with a.turn():
        a.run(["sh", "-c", "echo a > /who"])
    [b] = a.fork(1)
    try:
        with b.turn():
            b.run(["sh", "-c", "echo b > /who"])
        b_ck = b.checkpoints()[-1]
        cid = a.refresh().container_id
        with pytest.raises(InvalidRequest, match="not in the history"):
            a.restore(b_ck)
        assert a.refresh().container_id == cid and a.run(["cat", "/who"]).stdout == b"a\n"
        # The fork may go back to what it was forked from.
        b.restore(a.checkpoints()[-1])
        assert b.run(["cat", "/who"]).stdout == b"a\n"
    finally:
        b.remove()


def test_unknown_checkpoint_and_turn(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    with pytest.raises(CheckpointNotFound):
        sb.restore("ck-000000000000")
    with pytest.raises(CheckpointNotFound):
        client.checkpoint("ck-000000000000")
    with pytest.raises(InvalidRequest, match="has no turn 42"):
        sb.restore(turn=42)
    with pytest.raises(InvalidRequest):
        sb.restore()
    assert sb.run(["true"]).exit_code == 0


def test_corrupt_checkpoint_is_refused_and_named(daemon: EmbeddedDaemon, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    payload = b"precious " + os.urandom(64)
    with sb.turn():
        sb.run(["sh", "-c", "cat > /data"], stdin=payload)
    ck = sb.checkpoints()[-1]
    with sb.turn():
        sb.run(["sh", "-c", "echo later > /data"])
    blob = _blob_file(daemon, payload)
    assert blob.exists()
    good = blob.read_bytes()
    blob.write_bytes(good[:-3] + bytes(b ^ 0xFF for b in good[-3:]))
    try:
        if not is_docker_id(sb.info.container_id):
            # runc+btrfs: the checkpoint's own read-only snapshot holds its files, so a restore
            # never reads the damaged blob and is exact; without the snapshot it must refuse.
            assert sb.restore(ck).files_from == "snapshot"
            assert sb.run(["cat", "/data"]).stdout == payload
            with sb.turn():
                sb.run(["sh", "-c", "echo later > /data"])
            drop_snapshot(daemon.state_dir, ck.id)
        cid = sb.refresh().container_id
        with pytest.raises(CorruptBlob) as info:
            sb.restore(ck)
        assert info.value.blob == blob.name
        assert sb.refresh().container_id == cid and sb.info.state == "running"
        assert sb.run(["cat", "/data"]).stdout == b"later\n"
        env = {**os.environ, "CRAB_SOCKET": str(daemon.socket)}
        done = subprocess.run([CRABCTL, "verify", "--json"], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 1, done.stderr
        report = json.loads(done.stdout)
        [problem] = report["problems"]
        assert problem["blob"] == blob.name and ck.id in problem["checkpoints"]
    finally:
        blob.write_bytes(good)
    sb.restore(ck)
    assert sb.run(["cat", "/data"]).stdout == payload


@pytest.fixture
def small_disk_daemon() -> Iterator[EmbeddedDaemon]:
    for d in _private_daemon("full"):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "crabtest", str(d.base)], check=True)
        try:
            yield d
        finally:
            d.close()
            _remove_leftovers(d.state_dir)
            subprocess.run(["umount", "-l", str(d.base)], capture_output=True)


def test_full_disk_mid_checkpoint(small_disk_daemon: EmbeddedDaemon) -> None:
    d = small_disk_daemon
    d.start()
    with Client(d.socket) as c, c.create("busybox", checkpoints="none") as sb:
        sb.run(["sh", "-c", "echo one > /one"])
        first = sb.checkpoint()
        # Leave a few MiB, then ask to store 16 MiB of incompressible data.
        filler = d.base / "filler"
        free = shutil.disk_usage(d.base).free
        with open(filler, "wb") as f:
            f.truncate(0)
            f.write(b"\0" * max(free - (3 << 20), 0))
        sb.run(["sh", "-c", "head -c 16777216 /dev/urandom > /big"])
        with pytest.raises(StoreFull) as info:
            sb.checkpoint()
        assert "crabctl gc" in info.value.hint
        # The sandbox keeps running, and nothing was published.
        assert sb.run(["cat", "/one"]).stdout == b"one\n"
        assert [k.id for k in sb.checkpoints()] == [first.id]
        filler.unlink()
        assert c.verify().ok
        c.gc()
        second = sb.checkpoint()
        assert second.parent_id == first.id
        sb.restore(first)
        assert sb.run(["ls", "/"]).stdout.count(b"big") == 0


def test_other_users_cannot_use_my_checkpoints(
    daemon: EmbeddedDaemon, client: Client, users: dict[str, tuple[int, int]], make_sandbox: Callable[..., Sandbox]
) -> None:
    os.chmod(daemon.base, 0o711)
    mine = make_sandbox("busybox")
    with mine.turn():
        mine.run(["sh", "-c", "echo mine > /m"])
    ck = mine.checkpoints()[-1]
    uid, gid = users[USER_IN_GROUP]
    res = run_as(
        uid,
        gid,
        [grp.getgrnam("crab").gr_gid],
        daemon.socket,
        f"""
        attempt("list", lambda: [k.id for k in c.checkpoints()])
        attempt("inspect", lambda: c.checkpoint({ck.id!r}).checkpoint.id)
        attempt("fork", lambda: [s.id for s in c.fork({ck.id!r}, 1)])
        attempt("delete", lambda: c.delete_checkpoint({ck.id!r}))
        attempt("tree", lambda: len(c.tree(checkpoint={ck.id!r}).checkpoints))
        attempt("gc", lambda: c.gc().blobs_removed)
        own = c.create("busybox", name="user-ck")
        attempt("own_ck", lambda: own.checkpoint().sandbox_id == own.id)
        attempt("restore_mine_into_own", lambda: own.restore({ck.id!r}).head)
        attempt("verify", lambda: c.verify().ok)
        own.remove()
        """,
    )
    assert res["list"] == ["ok", []]
    for key in ("inspect", "fork", "delete", "tree", "gc", "restore_mine_into_own"):
        assert res[key][0] == PermissionDenied.__name__, (key, res[key])  # type: ignore[index]
    assert res["own_ck"] == ["ok", True] and res["verify"] == ["ok", True]
    assert client.checkpoint(ck.id).checkpoint.id == ck.id


def test_kill_9_mid_checkpoint_leaves_nothing_half_written() -> None:
    base = Path(f"/tmp/crab-kill9-{os.getpid()}")
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o700)
    rng = random.Random(4)
    daemon = EmbeddedDaemon(state_dir=base, ephemeral=False)
    try:
        daemon.start()
        with Client(daemon.socket) as c:
            sb = c.create("busybox", name="k9", checkpoints="none")
            sb.run(["sh", "-c", "mkdir /w && for i in $(seq 300); do head -c 2000 /dev/urandom > /w/f$i; done"])
            good = sb.checkpoint()
        killed = 0
        freezer_dir = cgroups.v1_dir(sb.info.container_id, "freezer")
        assert freezer_dir is not None
        freezer = freezer_dir / "freezer.state"
        for round_ in range(8):
            with Client(daemon.socket) as c:
                c.get("k9").run(["sh", "-c", "for i in $(seq 50); do head -c 3000 /dev/urandom > /w/g$i; done"])
            if round_ == 0 and freezer.exists():
                freezer.write_text("FROZEN")  # as if crabd died between freeze and thaw
            env = {**os.environ, "CRAB_SOCKET": str(daemon.socket)}
            proc = subprocess.Popen(
                [CRABCTL, "checkpoint", "create", "k9"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            time.sleep(rng.uniform(0.3, 0.9))  # client start-up, then somewhere inside the checkpoint
            assert daemon.proc is not None
            os.kill(daemon.proc.pid, signal.SIGKILL)
            daemon.proc.wait(30)
            proc.wait(30)
            killed += 1
            daemon = EmbeddedDaemon(state_dir=base, ephemeral=False)
            daemon.start()
            with Client(daemon.socket) as c:
                # Whatever is visible is complete and verified.
                report = c.verify()
                assert report.ok, report.problems
                sb = c.get("k9")
                assert sb.info.state == "running"
                if freezer.exists():
                    assert freezer.read_text().strip() == "THAWED"
                assert sb.run(["true"], timeout=20).exit_code == 0
                cks = sb.checkpoints()
                assert good.id in {k.id for k in cks}
        with Client(daemon.socket) as c:
            sb = c.get("k9")
            for k in sb.checkpoints()[-2:]:
                sb.restore(k)
                assert sb.run(["sh", "-c", "ls /w | wc -l"]).exit_code == 0
            c.gc()
            assert c.verify().ok
        assert killed == 8
    finally:
        daemon.close()
        _remove_leftovers(base / "state")
        shutil.rmtree(base, ignore_errors=True)


def test_gc_removes_only_unreferenced_blobs(daemon: EmbeddedDaemon, client: Client) -> None:
    sb = client.create("busybox")
    try:
        with sb.turn():
            sb.run(["sh", "-c", "echo keep > /keep"])
        junk = _blob_file(daemon, b"junk nobody references")
        junk.parent.mkdir(parents=True, exist_ok=True)
        junk.write_bytes(b"whatever")
        (daemon.state_dir / "blobs" / "tmp" / "half-written").write_bytes(b"x" * 100)
        report = client.gc()
        assert report.blobs_removed >= 1 and not junk.exists()
        assert not (daemon.state_dir / "blobs" / "tmp" / "half-written").exists()
        assert client.verify().ok
        sb.restore(sb.checkpoints()[-1])
        assert sb.run(["cat", "/keep"]).stdout == b"keep\n"
    finally:
        sb.remove()


def test_a_reported_turn_end_survives_kill_9(kept_state: Path) -> None:
    # The turn log is group-committed (store/db.py): no fsync of its own, yet every row a call has
    # returned for is in the WAL (the kernel's) and survives crabd's kill -9 right after.
    d = start_kept(kept_state)
    try:
        with Client(d.socket) as c:
            sb = c.create("busybox", checkpoints="auto")
            ended = []
            for i in range(5):
                sb.begin_turn()
                sb.run(["sh", "-c", f"echo {i} > /root/t{i}"])
                ended.append(sb.end_turn(wait=True))
            sb.begin_turn()
            sb.run(["true"])
            last = sb.end_turn()  # its decision and checkpoint may still be on their way
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(30)
    finally:
        d.close()
    d = start_kept(kept_state)
    try:
        with Client(d.socket) as c:
            turns = {t.number: t for t in c.get(sb.id).turns()}
            for t in ended:
                got = turns[t.number]
                assert got.ended_at is not None and len(got.commands) == 1, got
                assert got.checkpoint_state == t.checkpoint_state and got.checkpoint_id == t.checkpoint_id
            got = turns[last.number]
            assert got.ended_at is not None and [x.command for x in got.commands] == ["true"]
            assert got.checkpoint_state in ("done", "skipped", "lost"), got
    finally:
        d.close()
