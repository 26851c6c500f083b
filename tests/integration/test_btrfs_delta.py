"""The btrfs snapshot FsDelta on the real pool: the cut is a snapshot, the blobs match it, restores are inode-exact.

Works on the host's pool directly (no container): a "sandbox" here is a
subvolume ``sandboxes/<prefix><id>`` with ``upper/`` and ``work/``, as the
runc backend makes them.  Everything a test makes carries its own prefix and
is deleted afterwards.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.backends.btrfs import Pool, SubvolKind, SubvolRef
from crabd.backends.btrfs.delta import SnapshotDelta
from crabd.backends.fsdelta import TICK_NS, Kind, Tree
from crabd.backends.overlay.backend import OverlayDelta
from crabd.config import CrabConfig
from crabd.errors import SnapshotError
from crabd.host.backend_check import pool_facts
from crabd.store.fsblobs import FileBlobStore
from tests.conftest import have_root, require

pytestmark = pytest.mark.root


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[Pool, SnapshotDelta, str]]:
    require(have_root(), "needs root")
    cfg = CrabConfig().btrfs
    require(pool_facts(cfg).problem is None, f"needs the btrfs pool at {cfg.mount_point} (run `make setup`)")
    prefix = "t" + secrets.token_hex(4) + "-"
    with Pool.from_config(cfg) as pool:
        fs = SnapshotDelta(pool, OverlayDelta(FileBlobStore(tmp_path / "blobs")), prefix=prefix)
        try:
            yield pool, fs, prefix
        finally:
            pool.cleanup_orphans({}, prefix=prefix)
            assert not [n for k in SubvolKind for n in pool.list(k) if n.startswith(prefix)]


def _sandbox(pool: Pool, prefix: str, name: str) -> Path:
    return pool.create_subvolume(SubvolRef.sandbox(prefix + name), dirs=("upper", "work")) / "upper"


def _checkpoint(fs: SnapshotDelta, upper: Path, base: Tree | None, ckpt: str) -> Tree:
    capture, stored = fs.store(fs.capture(fs.prepare(upper, base, 0, checkpoint_id=ckpt)))
    assert fs.load(stored.index_blob) == capture.tree or len(fs.load(stored.index_blob)) == len(capture.tree)
    return capture.tree


def _inodes(root: Path) -> dict[str, tuple[int, int, int, int]]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath, n)
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_ino, st.st_nlink, st.st_mtime_ns, st.st_mode)
    return out


def test_the_cut_is_a_snapshot_and_the_blobs_are_its_files(env: tuple[Pool, SnapshotDelta, str]) -> None:
    pool, fs, prefix = env
    upper = _sandbox(pool, prefix, "a")
    (upper / "work").mkdir()
    (upper / "work" / "notes").write_text("v1")
    os.link(upper / "work" / "notes", upper / "work" / "alias")
    os.symlink("/etc/shadow", upper / "work" / "link")
    (upper / ".crab").mkdir()  # runc's mount point for crab-init: never checkpointed
    (upper / ".crab" / "init").write_text("")
    prepared = fs.prepare(upper, None, 0, checkpoint_id="ck-1")
    cut = fs.capture(prepared)
    # The sandbox writes on after the cut: the checkpoint holds the cut's state.
    (upper / "work" / "notes").write_text("v2 after the cut")
    (upper / "work" / "late").write_text("late")
    capture, stored = fs.store(cut)
    by_path = {e.path: e for e in fs.load(stored.index_blob)}
    assert set(by_path) == {b"work", b"work/notes", b"work/alias", b"work/link"}
    assert by_path[b"work/link"].kind is Kind.LNK and by_path[b"work/link"].target == b"/etc/shadow"
    # One of the two names carries the content, the other links to it.
    assert sum(x.length for e in (by_path[b"work/notes"], by_path[b"work/alias"]) for x in e.extents) == 2
    assert capture.stats["frozen_scan_s"] == 0.0 and capture.stats["snapshot_s"] < 1.0
    assert pool.is_readonly(SubvolRef.snapshot(prefix + "ck-1"))


def test_the_next_checkpoint_reads_only_what_changed(env: tuple[Pool, SnapshotDelta, str]) -> None:
    pool, fs, prefix = env
    upper = _sandbox(pool, prefix, "a")
    for i in range(50):
        (upper / f"f{i}").write_text(f"content {i}")
    first = _checkpoint(fs, upper, None, "ck-1")
    # What a checkpoint records as racy_ns: its entries vouch for content whose ctime is older.
    time.sleep(3 * TICK_NS / 1e9)
    racy_ns = time.time_ns() - TICK_NS
    (upper / "f7").write_text("changed")
    (upper / "f8").unlink()
    capture, _ = fs.store(fs.capture(fs.prepare(upper, first, racy_ns, checkpoint_id="ck-2")))
    assert [e.path for e in capture.changed] == [b"f7"] and capture.deleted == [b"f8"] and not capture.added
    assert capture.stats["files_read"] == 1


def test_a_restore_is_inode_exact(env: tuple[Pool, SnapshotDelta, str]) -> None:
    pool, fs, prefix = env
    upper = _sandbox(pool, prefix, "a")
    (upper / "db.sqlite").write_bytes(b"x" * 10000)
    os.link(upper / "db.sqlite", upper / "hard")
    with open(upper / "sparse", "wb") as f:
        f.truncate(1 << 30)
        f.seek(1 << 20)
        f.write(b"data")
    os.setxattr(upper / "db.sqlite", "user.tag", b"kept")
    _checkpoint(fs, upper, None, "ck-1")
    expected = _inodes(upper)
    (upper / "db.sqlite").write_bytes(b"changed later")

    restored = _sandbox(pool, prefix, "b")
    assert fs.restore_snapshot("ck-1", restored)
    assert _inodes(restored) == expected
    assert (restored / "db.sqlite").read_bytes() == b"x" * 10000
    assert os.getxattr(restored / "db.sqlite", "user.tag") == b"kept"
    assert (restored / "sparse").stat().st_blocks < 1024  # still sparse
    (restored / "new").write_text("writable")  # a writable snapshot of the read-only one
    assert not pool.is_readonly(SubvolRef.sandbox(prefix + "b"))
    assert not fs.restore_snapshot("ck-none", _sandbox(pool, prefix, "c"))


def test_snapshots_follow_the_catalog(env: tuple[Pool, SnapshotDelta, str]) -> None:
    pool, fs, prefix = env
    upper = _sandbox(pool, prefix, "a")
    for ck in ("ck-1", "ck-2", "ck-3"):
        _checkpoint(fs, upper, None, ck)
    other = SubvolRef.snapshot("t" + secrets.token_hex(4) + "-ck-9")  # another crabd instance's
    pool.snapshot(SubvolRef.sandbox(prefix + "a"), other)
    try:
        assert sorted(fs.retain({"ck-2"})) == [f"snapshots/{prefix}ck-1", f"snapshots/{prefix}ck-3"]
        assert pool.exists(other)
        fs.drop("ck-2")
        assert not [n for n in pool.list(SubvolKind.SNAPSHOT) if n.startswith(prefix)]
        fs.drop("ck-2")  # already gone: nothing to do
    finally:
        pool.delete(other)


@pytest.mark.parametrize("where", ["outside", "work", "symlink"])
def test_only_a_sandbox_upper_dir_of_the_pool_is_accepted(
    env: tuple[Pool, SnapshotDelta, str], tmp_path: Path, where: str
) -> None:
    pool, fs, prefix = env
    upper = _sandbox(pool, prefix, "a")
    bad = {
        "outside": tmp_path / "sandboxes" / (prefix + "a") / "upper",
        "work": upper.parent / "work",
        "symlink": tmp_path / "upper",
    }[where]
    if where == "symlink":
        bad.symlink_to(upper)
    with pytest.raises(SnapshotError):
        fs.prepare(bad, None, 0, checkpoint_id="ck-1")
    with pytest.raises(SnapshotError):
        fs.restore_snapshot("ck-1", bad)
