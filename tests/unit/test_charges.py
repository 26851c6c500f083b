"""Per-uid charges (crabd/store/charges.py): what a tenant's checkpoints and live sandboxes hold.

The first test is issue 33's quota bypass (delete a charged checkpoint, keep
the data alive through the sandbox's head, check it in again for free),
scaled down; it fails on the code before charges (which charged
``stats.new_bytes`` per checkpoint).
"""

from __future__ import annotations

import os
import random
import sqlite3
import time
from pathlib import Path

import pytest

from crabd.api.convert import checkpoint_to_pb
from crabd.errors import QuotaExceeded
from crabd.models import CheckpointKind, CheckpointRecord, SandboxRecord, SandboxSpec, SandboxState
from crabd.sdk.models import CheckpointInfo
from crabd.store import accounting, charges
from crabd.store.catalog import Catalog
from crabd.store.db import Database
from crabd.store.fsblobs import FileBlobStore
from crabd.store.registry import Registry
from tests.fakes import ALICE, BOB, Stack, build_stack, run, spec

KIB = 1 << 10


def _write_random(st: Stack, sandbox_id: str, files: int, size: int, tag: str) -> None:
    """Random files of ``size`` bytes stored (hex text: the fake backend reads text; it compresses 2:1)."""
    for i in range(files):
        st.write(sandbox_id, f"{tag}-{i}.txt", os.urandom(size).hex())


def test_delete_and_rewrite_cannot_hold_data_for_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 33, scaled down ~2000x: 300 KiB held by a sandbox's head after its checkpoint was deleted.
    st = build_stack(tmp_path, monkeypatch, quota={"max_store_bytes": 512 * KIB})

    async def body() -> None:
        a = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        _write_random(st, a.id, 6, 50 * KIB, "a")
        c1 = await st.checkpointer.take(st.sandboxes.row(a.id) or a, kind=CheckpointKind.FS)
        held = accounting.store_bytes_used(st.db, ALICE.uid)
        assert held >= 280 * KIB
        assert c1.stats["charged_bytes"] >= 280 * KIB
        # What `crabctl checkpoint inspect` shows (every field of the SDK's CheckpointInfo).
        assert CheckpointInfo.from_pb(checkpoint_to_pb(c1)).charged_bytes == c1.stats["charged_bytes"]

        # Delete it: the head keeps its index (and every file) alive, so the charge stays.
        await st.service.delete_checkpoint(ALICE, c1.id)
        assert st.catalog.find(c1.id) is None
        assert accounting.store_bytes_used(st.db, ALICE.uid) >= 280 * KIB

        # Check the same files in again: charged for what is new to the uid only, never twice.
        c2 = await st.checkpointer.take(st.sandboxes.row(a.id) or a, kind=CheckpointKind.FS)
        assert c2.stats["charged_bytes"] < 16 * KIB
        assert 280 * KIB <= accounting.store_bytes_used(st.db, ALICE.uid) < held + 16 * KIB

        # A second sandbox's 300 KiB would pass 512 KiB: refused before publication, nothing stored for it.
        b = await st.service.create(ALICE, spec("b", checkpoints="fs"))
        _write_random(st, b.id, 6, 50 * KIB, "b")
        before = len(st.catalog.list_checkpoints(b.id))
        with pytest.raises(QuotaExceeded) as caught:
            await st.checkpointer.take(st.sandboxes.row(b.id) or b, kind=CheckpointKind.FS)
        assert caught.value.quota == "max_store_bytes" and caught.value.requested >= 280 * KIB
        assert "crabctl rm" in (caught.value.hint or "")
        assert len(st.catalog.list_checkpoints(b.id)) == before

        # Removing the sandbox that holds the data gives its charge back; then b's checkpoint fits.
        await st.service.remove(ALICE, a.id, force=True)
        assert accounting.store_bytes_used(st.db, ALICE.uid) < 64 * KIB
        await st.checkpointer.take(st.sandboxes.row(b.id) or b, kind=CheckpointKind.FS)

    run(body())


def test_a_fork_is_charged_to_its_owner_and_shared_blobs_to_each_uid_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        a = await st.service.create(ALICE, spec("a", checkpoints="fs"))
        _write_random(st, a.id, 4, 50 * KIB, "a")
        c1 = await st.checkpointer.take(st.sandboxes.row(a.id) or a, kind=CheckpointKind.FS)
        c2 = await st.checkpointer.take(st.sandboxes.row(a.id) or a, kind=CheckpointKind.FS)  # same files: shared
        alice = accounting.store_bytes_used(st.db, ALICE.uid)
        assert 200 * KIB <= alice < 240 * KIB  # once, however many checkpoints share the files
        assert c2.stats["charged_bytes"] < 8 * KIB
        # A fork's head (its stat index) is charged to its owner; bob holds nothing of it.
        _, forks = await st.service.fork(ALICE, c1.id, "", 1, "f")
        assert forks[0].owner_uid == ALICE.uid
        assert accounting.store_bytes_used(st.db, BOB.uid) == 0
        bob = await st.service.create(BOB, spec("b", checkpoints="fs"))
        _write_random(st, bob.id, 1, 10 * KIB, "b")
        await st.checkpointer.take(st.sandboxes.row(bob.id) or bob, kind=CheckpointKind.FS)
        assert 10 * KIB <= accounting.store_bytes_used(st.db, BOB.uid) < 30 * KIB
        # Deleting every checkpoint of alice's first sandbox: its head and the fork's still hold the files.
        for c in st.catalog.list_checkpoints(a.id):
            await st.service.delete_checkpoint(ALICE, c.id)
        assert accounting.store_bytes_used(st.db, ALICE.uid) >= 200 * KIB
        _assert_exact(st.db)

    run(body())


# --- the incremental counts equal a recomputation from scratch ----------------------------------


def _snapshot(conn: sqlite3.Connection) -> tuple[set[tuple[int, str, int]], set[tuple[int, int, int]]]:
    refs = {(int(u), str(b), int(n)) for u, b, n in conn.execute("SELECT uid, blob, refcount FROM uid_refs")}
    usage = {(int(u), int(b), int(n)) for u, b, n in conn.execute("SELECT uid, bytes, blobs FROM uid_usage")}
    return refs, {u for u in usage if u[1] or u[2]}


class _Rollback(Exception):
    pass


def _assert_exact(db: Database) -> None:
    """The maintained tables equal what ``charges.backfill`` rebuilds from refs and edges."""
    with db.lock:
        have = _snapshot(db.conn)
        try:
            with db.tx() as conn:
                charges.backfill(conn)
                want = _snapshot(conn)
                raise _Rollback
        except _Rollback:
            pass
    assert have == want


def _rec(cid: str, sandbox: str, uid: int, index: str, parent: str | None) -> CheckpointRecord:
    return CheckpointRecord(
        id=cid,
        sandbox_id=sandbox,
        sandbox_name=sandbox,
        owner_uid=uid,
        parent_id=parent,
        branch=0,
        turn=0,
        kind=CheckpointKind.FS,
        created_at=time.time(),
        label="",
        image="img",
        spec_json="{}",
        index_blob=index,
        delta_blob="",
    )


def test_charges_stay_exact_through_random_publish_delete_head_moves_and_backfill(tmp_path: Path) -> None:
    rnd = random.Random(33)
    db = Database(tmp_path / "r.db")
    catalog, blobs, reg = Catalog(db), FileBlobStore(tmp_path / "blobs"), Registry(db)
    uids = {"s1": 1000, "s2": 1000, "s3": 1001}
    for sid, uid in uids.items():
        reg.insert_sandbox(
            SandboxRecord(sid, sid, uid, SandboxSpec(env="busybox", name=sid), "img", "", SandboxState.RUNNING, 0.0)
        )
    contents = [blobs.put_bytes(os.urandom(rnd.randint(1, 3000))).hex for _ in range(12)]
    kids: dict[str, set[str]] = {}

    def tree(tag: int) -> str:
        pages = []
        for p in range(2):
            page = blobs.put_bytes(f"page {tag} {p}".encode()).hex
            kids[page] = set(rnd.sample(contents, 3))
            pages.append(page)
        root = blobs.put_bytes(f"root {tag}".encode()).hex
        kids[root] = set(pages) | ({rnd.choice(contents)} if tag % 2 else set())
        return root

    def sizes(b: str) -> tuple[int, int]:
        return 0, blobs.stored_size(b)

    def child_of(b: str) -> set[str]:
        return kids.get(b, set())

    made: list[str] = []
    for step in range(120):
        op = rnd.random()
        sid = rnd.choice(sorted(uids))
        live = catalog.ids()
        if op < 0.45 or not live:
            head = catalog.head(sid)
            parent = head.checkpoint.id if head and head.checkpoint else None
            cid = f"ck-{step}"
            root = tree(step) if rnd.random() < 0.7 or not made else rnd.choice(made)
            # Another uid's checkpoint may name the same blobs: adopt (no head moves) or publish.
            rec = _rec(cid, sid, uids[sid], root, parent)
            catalog.adopt(rec, child_of, sizes) if rnd.random() < 0.2 else catalog.publish(rec, child_of, sizes)
            made.append(root)
        elif op < 0.75:
            catalog.delete(rnd.choice(sorted(live)))
        elif op < 0.9:
            # A restore or fork: the head moves onto any checkpoint, with a fresh stat index or none.
            target = catalog.get(rnd.choice(sorted(live)))
            stat = tree(1000 + step) if rnd.random() < 0.5 else None
            if stat is not None:
                blobs_live = catalog.becoming_live({stat}, child_of)
                assert stat in blobs_live
            catalog.set_head(sid, target.id, stat, 0, child_of, sizes)
        else:
            catalog.drop_head(sid)
        _assert_exact(db)
    used = {u: accounting.store_bytes_used(db, u) for u in (1000, 1001)}
    assert used[1000] > 0
    # A database from before charges: references without a uid, no tables filled, no marker.
    with db.tx() as conn:
        conn.execute("UPDATE refs SET uid=NULL")
        conn.execute("DELETE FROM uid_refs")
        conn.execute("DELETE FROM uid_usage")
        conn.execute("DELETE FROM meta WHERE key=?", (charges.BACKFILLED_KEY,))
    db.close()
    with Database(tmp_path / "r.db") as again:
        assert {u: accounting.store_bytes_used(again, u) for u in (1000, 1001)} == used
        _assert_exact(again)


def test_would_add_is_what_publication_then_charges(tmp_path: Path) -> None:
    with Database(tmp_path / "r.db") as db:
        catalog, blobs = Catalog(db), FileBlobStore(tmp_path / "blobs")
        a, b, c = (blobs.put_bytes(os.urandom(n)).hex for n in (1000, 2000, 4000))
        r1 = blobs.put_bytes(b"root one").hex
        r2 = blobs.put_bytes(b"root two").hex
        tree = {r1: {a, b}, r2: {b, c}}

        def sizes(x: str) -> tuple[int, int]:
            return 0, blobs.stored_size(x)

        first = accounting.would_add(db, 7, [r1], lambda x: tree.get(x, set()), blobs.stored_size)
        catalog.publish(_rec("ck-1", "s", 7, r1, None), lambda x: tree.get(x, set()), sizes)
        assert accounting.store_bytes_used(db, 7) == first
        second = accounting.would_add(db, 7, [r2], lambda x: tree.get(x, set()), blobs.stored_size)
        assert second == blobs.stored_size(r2) + blobs.stored_size(c)  # b is held already
        catalog.publish(_rec("ck-2", "s", 7, r2, "ck-1"), lambda x: tree.get(x, set()), sizes)
        assert accounting.store_bytes_used(db, 7) == first + second
        # Another uid referencing the same live blobs is charged for all of them.
        assert accounting.would_add(db, 8, [r1], lambda x: set(), lambda x: 0) == first


def test_disk_limit_requests_default_lower_never_higher() -> None:
    from crabd.config import LimitsConfig
    from crabd.errors import InvalidRequest
    from crabd.service.limits import RequestLimits

    limits = RequestLimits(LimitsConfig(), disk_default=1 << 30)
    assert limits.disk(0) == 1 << 30
    assert limits.disk(64 << 20) == 64 << 20
    for bad in (-1, 1 << 20, (1 << 30) + 1):
        with pytest.raises(InvalidRequest):
            limits.disk(bad)
    assert RequestLimits(LimitsConfig()).disk(0) == 0  # no default: no limit, and any size may be asked
    assert RequestLimits(LimitsConfig()).disk(1 << 40) == 1 << 40
    # Across the wire both ways.
    from crabd.api import convert
    from crabd.sdk._requests import CreateOptions

    req = CreateOptions("busybox", disk="64m").request()
    assert convert.spec_from_pb(req).disk_bytes == 64 << 20
