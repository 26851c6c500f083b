"""The remote tier between two real crabds ("hosts" a and b) sharing one bucket of a real S3 server process.

Each crabd has its own state dir, socket, store and sandbox network, so host b
can only get host a's checkpoints through the bucket; the tests prove it by
stopping host a (its state dir removed) before host b forks.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import zstandard

from crabd.errors import AlreadyExists, CheckpointNotFound, CorruptBlob, StoreError
from crabd.sdk import Client, EmbeddedDaemon
from tests.integration.conftest import daemon_with_config
from tests.polling import wait_for
from tests.s3server import S3Server
from tests.trust_keys import trust_each_other

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    saved = dict(os.environ)
    with S3Server(bucket="crab-remote") as server:
        # The crabds inherit the test's environment: credentials come only from it (never a flag).
        os.environ.update(server.env)
        try:
            yield server
        finally:
            os.environ.clear()
            os.environ.update(saved)


def _toml(s3: S3Server, host: str, net: str, prefix: str, **remote: Any) -> str:
    extra = {"host_id": host, "retry_initial_s": 0.2, "retry_max_s": 1.0, **remote}
    return f'[network]\nname = "{net}"\n\n' + s3.config_toml(prefix, **extra)


#: The hosts running now: they trust each other's keys (as a cluster's key material makes them).
_ALIVE: list[EmbeddedDaemon] = []


@contextlib.contextmanager
def host(s3: S3Server, name: str, net: str, prefix: str, **remote: Any) -> Iterator[tuple[EmbeddedDaemon, Client]]:
    with daemon_with_config(_toml(s3, name, net, prefix, **remote), net) as d, Client(d.socket) as c:
        _ALIVE.append(d)
        trust_each_other(_ALIVE)
        try:
            yield d, c
        finally:
            _ALIVE.remove(d)


def engine_remote(c: Client) -> dict[str, Any]:
    return dict(c.engine_status().stats["remote"])


def test_a_checkpoint_taken_on_host_a_is_forked_on_host_b_from_the_bucket_alone(s3: S3Server) -> None:
    prefix = "fork/"
    with host(s3, "host-a", "crabra", prefix) as (_da, a):
        status = a.status()
        assert status.host_id == "host-a" and "crab-remote" in status.remote_store
        sb = a.create("bookworm", name="origin")
        sb.session.run("mkdir -p /work && cd /work && printf 'from a\\n' > note.txt && export MARK=a1")
        ck = sb.checkpoint("on a", kind="fs")
        # Every published checkpoint is uploaded in the background; the turn-0 baseline too.
        wait_for("host a's checkpoints to become remote", lambda: all(k.remote for k in sb.checkpoints()))
        listed = {k.id: k for k in a.checkpoints(sb.id)}
        assert listed[ck.id].remote and listed[ck.id].host == ""
    # Host a is gone, its state dir with it: only the bucket holds the checkpoint now.
    with host(s3, "host-b", "crabrb", prefix) as (_db, b):
        assert ck.id not in {k.id for k in b.checkpoints()}
        b.sync_store()
        only = {k.id: k for k in b.checkpoints(include_remote=True)}
        assert only[ck.id].remote_only and only[ck.id].host == "host-a"
        (child,) = b.fork(ck.id)
        assert child.run("cat /work/note.txt").stdout == b"from a\n"
        assert child.session.run("pwd; echo $MARK").stdout == b"/work\na1\n"
        fetched = engine_remote(b)
        assert fetched["fetched"] == 1 and fetched["fetched_bytes"] > 0
        local = {k.id: k for k in b.checkpoints()}
        assert local[ck.id].remote and local[ck.id].host == "host-a" and not local[ck.id].remote_only
        # A second fork of the same checkpoint reads nothing more from the bucket.
        b.fork(ck.id)
        assert engine_remote(b)["fetched"] == 1


def test_uploads_wait_out_a_store_outage_and_local_checkpoints_keep_working(s3: S3Server) -> None:
    prefix = "outage/"
    s3.stop()
    try:
        with host(s3, "host-c", "crabrc", prefix) as (_d, c):
            sb = c.create("bookworm", name="through-outage")
            sb.run("sh -c 'echo 1 > /tmp/x'")
            ck = sb.checkpoint("during the outage", kind="fs")
            wait_for("an upload failure", lambda: engine_remote(c)["upload_failures"] >= 1)
            counters = engine_remote(c)
            assert counters["failing_since"] is not None and counters["last_error"]
            assert not any(k.remote for k in sb.checkpoints())
            assert "crab_remote_failing 1" in c.engine_status().prometheus
            # Local work is untouched: restore and fork still work.
            sb.run("sh -c 'echo 2 > /tmp/x'")
            sb.restore(ck.id)
            assert sb.run("cat /tmp/x").stdout == b"1\n"
            s3.start()
            wait_for("the backlog to drain", lambda: all(k.remote for k in sb.checkpoints()), timeout=60)
            assert engine_remote(c)["failing_since"] is None
    finally:
        if not s3.running:
            s3.start()


def _tamper(s3: S3Server, prefix: str, ckpt_id: str, how: str) -> str:
    """Damage one blob object of ``ckpt_id`` behind crab's back; return its key."""
    cli = s3.client()
    raw = cli.get_object(Bucket=s3.bucket, Key=f"{prefix}checkpoints/{ckpt_id}.json.zst")["Body"].read()
    manifest = json.loads(zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 28))
    blob = manifest["checkpoint"]["index_blob"]
    key = f"{prefix}blobs/{blob[:2]}/{blob}"
    if how == "corrupt":
        size = manifest["blobs"][blob]
        cli.put_object(Bucket=s3.bucket, Key=key, Body=zstandard.ZstdCompressor().compress(b"\0" * size))
    else:
        cli.delete_object(Bucket=s3.bucket, Key=key)
    return key


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_a_damaged_remote_checkpoint_is_refused_and_nothing_is_imported(s3: S3Server, how: str) -> None:
    prefix = f"damaged-{how}/"
    with host(s3, "host-d", "crabrd", prefix) as (_da, a):
        sb = a.create("bookworm", name=f"to-damage-{how}")
        sb.run("sh -c 'echo precious > /tmp/p'")
        ck = sb.checkpoint("to damage", kind="fs")
        pushed = a.push(ck.id)
        assert pushed.checkpoint.remote and pushed.blobs >= 2
    _tamper(s3, prefix, ck.id, how)
    with host(s3, "host-e", "crabre", prefix) as (_db, b):
        expected: type[StoreError] = CorruptBlob if how == "corrupt" else StoreError
        with pytest.raises(expected, match=ck.id):
            b.fork(ck.id)
        assert ck.id not in {k.id for k in b.checkpoints()}
        assert b.list() == []


def test_a_sandbox_moves_to_host_b_keeping_its_id_name_turns_and_processes(s3: S3Server) -> None:
    """ImportSandbox, the step under migration and host-loss recovery: b brings in a's sandbox from the bucket."""
    prefix = "move/"
    with host(s3, "host-d", "crabrd", prefix) as (_da, a), host(s3, "host-e", "crabre", prefix) as (_db, b):
        sb = a.create("bookworm", name="mover")
        with sb.turn():
            sb.session.run("mkdir -p /work && cd /work && echo moved > f && export MARK=m1")
        with sb.turn():
            # A process whose pid and memory only a process checkpoint brings back.
            sb.session.run("sleep 1000 & echo $! > /work/bg")
        ck = sb.checkpoint("before the move", kind="full")
        assert a.push(ck.id).checkpoint.remote
        pid = sb.run("cat /work/bg").stdout.strip()

        done = b.import_sandbox(ck.id, last_turn=ck.turn + 2)
        moved = b.get(sb.id)
        # The turns before the checkpoint's stayed on host d; the checkpoint's own turn came along.
        arrived = moved.turns()
        assert [(t.number, t.checkpoint_id) for t in arrived] == [(ck.turn, ck.id)]
        assert (done.sandbox.id, done.sandbox.name, moved.name) == (sb.id, "mover", "mover")
        assert done.checkpoint == ck.id and done.lost_turns == [ck.turn + 1, ck.turn + 2]
        assert moved.run("cat /work/f").stdout == b"moved\n"
        assert moved.session.run("pwd; echo $MARK").stdout == b"/work\nm1\n"
        assert moved.run(f"kill -0 {pid.decode()}").exit_code == 0
        # Its lineage goes on: its turns are numbered on from the checkpoint's (the commands
        # above ran in one implicit turn), and its checkpoints are its own.
        with moved.turn() as t:
            moved.run("sh -c 'echo after > /work/g'")
        assert t.number == ck.turn + 2
        after = moved.checkpoint("after the move", kind="fs")
        parents = {k.id: k.parent_id for k in b.checkpoints(sb.id)}
        line, at = [], after.id
        while at in parents:
            line.append(at)
            at = parents[at]
        assert after.sandbox_id == sb.id and line[-1] == ck.id, line
        assert moved.restore(turn=ck.turn).id == sb.id
        assert moved.run("test -e /work/g").exit_code == 1

        # It exists once per host: a second import is refused, and changes nothing.
        with pytest.raises(AlreadyExists):
            b.import_sandbox(ck.id)
        with pytest.raises(CheckpointNotFound):
            b.import_sandbox("ck-" + "0" * 12)
        assert [s.id for s in b.list()] == [sb.id]
