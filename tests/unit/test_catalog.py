"""The checkpoint catalog: atomic publication, DAG reference counts, deletion, gc and verify."""

from __future__ import annotations

import random
import sqlite3
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.errors import CheckpointNotFound
from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store.catalog import Catalog
from crabd.store.db import Database
from crabd.store.fsblobs import FileBlobStore
from crabd.store.maintenance import collect_garbage, verify


class Boom(Exception):
    pass


@pytest.fixture
def cat(tmp_path: Path) -> Iterator[tuple[Database, Catalog, FileBlobStore]]:
    with Database(tmp_path / "registry.db") as db:
        yield db, Catalog(db), FileBlobStore(tmp_path / "blobs")


def _ckpt(cid: str, sandbox: str, index: str, parent: str | None = None, delta: str = "") -> CheckpointRecord:
    return CheckpointRecord(
        id=cid,
        sandbox_id=sandbox,
        sandbox_name=sandbox,
        owner_uid=0,
        parent_id=parent,
        branch=0,
        turn=0,
        kind=CheckpointKind.FS,
        created_at=0.0,
        label="",
        image="img",
        spec_json="{}",
        index_blob=index,
        delta_blob=delta,
    )


class Tree:
    """A tiny stand-in for an index: a root blob naming page blobs naming content blobs."""

    def __init__(self, blobs: FileBlobStore, files: list[bytes], tag: str) -> None:
        self.children: dict[str, set[str]] = {}
        contents = [blobs.put_bytes(f).hex for f in files]
        pages = []
        for i in range(0, len(contents), 3):
            page = blobs.put_bytes(("page:" + ",".join(contents[i : i + 3])).encode()).hex
            self.children[page] = set(contents[i : i + 3])
            pages.append(page)
        self.root = blobs.put_bytes(f"root:{tag}:{','.join(pages)}".encode()).hex
        self.children[self.root] = set(pages)

    def kids(self, b: str) -> set[str]:
        return self.children.get(b, set())


def _sizes(_b: str) -> tuple[int, int]:
    return (1, 1)


def _expected_refcounts(db: Database) -> Counter[str]:
    """Recompute every refcount from scratch: owners' references plus live parents' edges."""
    conn = db.conn
    counts: Counter[str] = Counter(str(r[0]) for r in conn.execute("SELECT blob FROM refs"))
    live = set(counts)
    frontier = set(live)
    edges = [(str(p), str(c)) for p, c in conn.execute("SELECT parent, child FROM blob_edges")]
    while frontier:
        nxt = set()
        for p, c in edges:
            if p in frontier:
                counts[c] += 1
                if c not in live:
                    live.add(c)
                    nxt.add(c)
        frontier = nxt
    return counts


def _actual_refcounts(db: Database) -> Counter[str]:
    return Counter({str(b): int(n) for b, n in db.conn.execute("SELECT blob, refcount FROM blob_refs")})


def test_publish_takes_references_through_the_dag(cat: tuple[Database, Catalog, FileBlobStore]) -> None:
    db, catalog, blobs = cat
    t1 = Tree(blobs, [b"a", b"b", b"c", b"d"], "1")
    catalog.publish(_ckpt("ck-1", "sb", t1.root), t1.kids, _sizes)
    t2 = Tree(blobs, [b"a", b"b", b"c", b"e"], "2")  # shares one page and three contents
    catalog.publish(_ckpt("ck-2", "sb", t2.root, "ck-1"), t2.kids, _sizes)
    assert _actual_refcounts(db) == _expected_refcounts(db)
    head = catalog.head("sb")
    assert head is not None and head.checkpoint is not None and head.checkpoint.id == "ck-2"
    catalog.delete("ck-1")
    assert _actual_refcounts(db) == _expected_refcounts(db)
    live = catalog.live_blobs()
    assert blobs.put_bytes(b"d").hex not in live and blobs.put_bytes(b"a").hex in live
    assert catalog.get("ck-2").parent_id is None  # re-parented to ck-1's parent


def test_head_ids_name_the_checkpoint_each_head_stands_on_while_it_exists(
    cat: tuple[Database, Catalog, FileBlobStore],
) -> None:
    _, catalog, blobs = cat
    t = Tree(blobs, [b"a"], "1")
    catalog.publish(_ckpt("ck-a1", "A", t.root), t.kids, _sizes)
    catalog.publish(_ckpt("ck-a2", "A", t.root, "ck-a1"), t.kids, _sizes)
    catalog.publish(_ckpt("ck-b1", "B", t.root), t.kids, _sizes)
    assert catalog.head_ids() == {"A": "ck-a2", "B": "ck-b1"}
    assert (catalog.head_id("A"), catalog.head_id("B"), catalog.head_id("C")) == ("ck-a2", "ck-b1", None)
    catalog.delete("ck-b1")  # B's head now stands on no checkpoint (it had no parent)
    head = catalog.head("B")
    assert head is None or head.checkpoint is None
    assert catalog.head_ids() == {"A": "ck-a2"} and catalog.head_id("B") is None
    for sb in ("A", "B", "C"):  # the same answer as the head itself gives
        h = catalog.head(sb)
        assert catalog.head_id(sb) == (h.checkpoint.id if h and h.checkpoint else None)


def test_a_failed_publish_leaves_no_trace(cat: tuple[Database, Catalog, FileBlobStore]) -> None:
    db, catalog, blobs = cat
    t1 = Tree(blobs, [b"x", b"y"], "1")
    catalog.publish(_ckpt("ck-1", "sb", t1.root), t1.kids, _sizes)
    before = (_actual_refcounts(db), catalog.head("sb"), [c.id for c in catalog.list_checkpoints()])
    t2 = Tree(blobs, [b"x", b"z"], "2")

    def crash() -> None:
        raise Boom

    with pytest.raises(Boom):
        catalog.publish(_ckpt("ck-2", "sb", t2.root, "ck-1"), t2.kids, _sizes, hook=crash)
    assert (_actual_refcounts(db), catalog.head("sb"), [c.id for c in catalog.list_checkpoints()]) == before
    assert catalog.find("ck-2") is None
    # gc removes what the failed checkpoint wrote and nothing else.
    report = collect_garbage(catalog, blobs)
    assert report.blobs_removed >= 2
    assert verify(catalog, blobs).ok


def test_random_operations_keep_refcounts_exact(cat: tuple[Database, Catalog, FileBlobStore]) -> None:
    db, catalog, blobs = cat
    rng = random.Random(7)
    files = [f"content {i}".encode() for i in range(30)]
    ids: list[str] = []
    for step in range(60):
        op = rng.random()
        if op < 0.6 or not ids:
            t = Tree(blobs, rng.sample(files, rng.randint(1, 10)), str(step))
            sb = rng.choice(["s1", "s2", "s3"])
            head = catalog.head(sb)
            parent = head.checkpoint.id if head and head.checkpoint else None
            cid = f"ck-{step}"
            catalog.publish(_ckpt(cid, sb, t.root, parent), t.kids, _sizes)
            ids.append(cid)
        elif op < 0.8:
            cid = ids.pop(rng.randrange(len(ids)))
            catalog.delete(cid)
        else:
            t = Tree(blobs, rng.sample(files, 3), f"stat{step}")
            catalog.set_head(rng.choice(["s1", "s2"]), rng.choice(ids), t.root, 0, t.kids, _sizes)
        assert _actual_refcounts(db) == _expected_refcounts(db), f"step {step}"
    # Everything a remaining checkpoint or head needs is live and intact.
    collect_garbage(catalog, blobs)
    assert verify(catalog, blobs).ok
    for cid in list(ids):
        catalog.delete(cid)
    for sb in ("s1", "s2", "s3"):
        catalog.drop_head(sb)
    assert catalog.live_blobs() == {}
    assert db.conn.execute("SELECT count(*) FROM blob_edges").fetchone()[0] == 0


def test_verify_names_corrupt_blobs_and_their_checkpoints(cat: tuple[Database, Catalog, FileBlobStore]) -> None:
    _, catalog, blobs = cat
    t1 = Tree(blobs, [b"shared", b"one"], "1")
    catalog.publish(_ckpt("ck-1", "sb", t1.root), t1.kids, _sizes)
    t2 = Tree(blobs, [b"shared", b"two"], "2")
    catalog.publish(_ckpt("ck-2", "sb2", t2.root), t2.kids, _sizes)
    shared = blobs.put_bytes(b"shared").hex
    blobs.path(shared).write_bytes(b"not zstd at all")
    report = verify(catalog, blobs)
    assert not report.ok
    [problem] = report.problems
    assert problem.blob == shared and problem.checkpoints == ["ck-1", "ck-2"]


def test_prunable_keeps_what_others_stand_on(cat: tuple[Database, Catalog, FileBlobStore]) -> None:
    _, catalog, blobs = cat
    t = Tree(blobs, [b"a"], "1")
    catalog.publish(_ckpt("ck-a1", "A", t.root), t.kids, _sizes)
    catalog.publish(_ckpt("ck-a2", "A", t.root, "ck-a1"), t.kids, _sizes)
    catalog.publish(_ckpt("ck-b1", "B", t.root, "ck-a1"), t.kids, _sizes)  # B forked from ck-a1
    catalog.drop_head("A")
    assert sorted(catalog.prunable(live_sandboxes={"B"})) == ["ck-a2"]
    # B's head still stands on ck-b1, whose parent ck-a1 must stay too.
    assert sorted(catalog.prunable(live_sandboxes=set())) == ["ck-a2"]
    catalog.drop_head("B")
    assert sorted(catalog.prunable(live_sandboxes=set())) == ["ck-a1", "ck-a2", "ck-b1"]


def test_unknown_checkpoint(cat: tuple[Database, Catalog, FileBlobStore]) -> None:
    _, catalog, _ = cat
    with pytest.raises(CheckpointNotFound):
        catalog.delete("ck-nope")
    with pytest.raises(CheckpointNotFound):
        catalog.get("ck-nope")


def test_schema_v1_database_is_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "registry.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES('schema_version', '1');"
        "CREATE TABLE sandboxes(id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, owner_uid INTEGER NOT NULL,"
        " spec_json TEXT NOT NULL, image TEXT NOT NULL, container_id TEXT NOT NULL DEFAULT '',"
        " state TEXT NOT NULL, created_at REAL NOT NULL, exit_code INTEGER,"
        " oom_killed INTEGER NOT NULL DEFAULT 0, dead_reason TEXT NOT NULL DEFAULT '');"
        "INSERT INTO sandboxes(id, name, owner_uid, spec_json, image, state, created_at)"
        " VALUES('s1', 'old', 0, '{\"env\": \"busybox\"}', 'img', 'running', 1.0);"
    )
    conn.commit()
    conn.close()
    with Database(path) as db:
        from crabd.store.registry import Registry

        rec = Registry(db).get_sandbox("old")
        assert rec is not None and rec.origin == "" and rec.branch == 0 and rec.spec.checkpoints == "auto"
        assert db.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "8"
