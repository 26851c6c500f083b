"""The btrfs pool on the real host: snapshots are inode-exact, read-only, crash-safe, and fail clearly when full.

Most tests use the host's pool (``[btrfs]``, made by ``make setup``) and
delete what they make; the tests that fill a pool or clean up orphans (which
deletes every crab subvolume it is not told to keep) use a small private pool
on a loop file, unmounted and deleted afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from crabd.backends.btrfs import POOL_FULL_HINT, Pool, SubvolKind, SubvolRef
from crabd.backends.runc import rootfs
from crabd.errors import HostError, SnapshotError, StoreFull
from tests.conftest import REPO, have_root, require

pytestmark = pytest.mark.root


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=120)


@pytest.fixture
def ids(pool: Pool) -> Iterator[Callable[[], str]]:
    """Fresh ids; every subvolume of theirs is deleted after the test (others' subvolumes are never touched)."""
    made: list[str] = []

    def new() -> str:
        made.append("t" + secrets.token_hex(6))
        return made[-1]

    yield new
    for i in made:
        for kind in SubvolKind:
            pool.delete(SubvolRef(kind, i))


@contextlib.contextmanager
def loop_pool(where: Path, size: str, **kw: Any) -> Iterator[Pool]:
    """A private btrfs pool on a loop file under ``where``; unmounted, detached and deleted after."""
    image, mnt = where / "pool.img", where / "mnt"
    mnt.mkdir()
    sh("truncate", "-s", size, str(image))
    # Mixed block groups: a small file system fills up by data, not by a metadata chunk first.
    sh("mkfs.btrfs", "-q", "--mixed", str(image))
    sh("mount", "-o", "loop", str(image), str(mnt))
    try:
        with Pool(mnt, **kw) as p:
            yield p
    finally:
        sh("umount", str(mnt))
        # `mount -o loop` sets autoclear: unmounting detached the loop device.
        left = subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True, timeout=30).stdout
        image.unlink()
        assert left.strip() == "", f"loop device left attached: {left}"


@pytest.fixture
def small_pool(crab_tmp: Path) -> Iterator[Pool]:
    require(have_root(), "needs root")
    with loop_pool(crab_tmp, "128M", min_free_bytes=16 << 20) as p:
        yield p


# --- a tree with every kind of file a sandbox may hold -------------------------------

# A v2 file capability (cap_net_bind_service permitted + effective), as setcap writes it.
CAP = (0x02000001).to_bytes(4, "little") + (1 << 10).to_bytes(4, "little") + bytes(12)
TIMES = (1_600_000_000_123_456_789, 1_500_000_000_987_654_321)  # atime, mtime in ns


def build_tree(root: Path) -> None:
    (root / "dir").mkdir()
    (root / "dir" / "file").write_text("hello")
    os.link(root / "dir" / "file", root / "hardlink")
    with open(root / "sparse", "wb") as f:
        f.write(b"head")
        f.seek(64 << 20)
        f.write(b"tail")
    os.setxattr(root / "dir" / "file", "user.crab", b"user value")
    os.setxattr(root / "dir" / "file", "trusted.crab", b"trusted value")
    (root / "bin").write_bytes(b"\x7fELF")
    os.chown(root / "bin", 1234, 5678)
    os.chmod(root / "bin", 0o4755)
    os.setxattr(root / "bin", "security.capability", CAP)  # last: a chown drops file capabilities
    os.chmod(root / "dir", 0o1777)
    os.symlink("dir/file", root / "link")
    os.mkfifo(root / "fifo", 0o640)
    os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    for name in ("dir/file", "sparse", "bin", "fifo", "null"):
        os.utime(root / name, ns=TIMES, follow_symlinks=False)
    os.utime(root / "link", ns=TIMES, follow_symlinks=False)


def data_map(path: Path) -> list[tuple[int, int]]:
    """The file's data extents, by SEEK_DATA / SEEK_HOLE (holes are what lies between)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        out, pos, end = [], 0, os.fstat(fd).st_size
        while pos < end:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break
                raise
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, pos))
        return out
    finally:
        os.close(fd)


def entries(root: Path, rel: str = "") -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under ``root`` with its lstat, taken before the entry is read in any way.

    Not ``os.walk``: its ``is_dir()`` follows symlinks, which moves a symlink's atime.
    """
    for name in sorted(os.listdir(root / rel)):
        path = f"{rel}/{name}" if rel else name
        st = os.lstat(root / path)
        yield path, st
        if stat.S_ISDIR(st.st_mode):
            yield from entries(root, path)


def describe(root: Path) -> dict[str, dict[str, Any]]:
    """Everything a restore must keep, per entry, without reading any file (atime stays put)."""
    out: dict[str, dict[str, Any]] = {}
    for rel, st in list(entries(root)):
        p = root / rel
        entry: dict[str, Any] = {
            k: getattr(st, k)
            for k in ("st_ino", "st_mode", "st_uid", "st_gid", "st_nlink", "st_size", "st_blocks", "st_rdev")
        }
        entry.update(atime=st.st_atime_ns, mtime=st.st_mtime_ns, ctime=st.st_ctime_ns)
        if stat.S_ISLNK(st.st_mode):
            entry["target"] = os.readlink(p)
        else:
            entry["xattrs"] = {x: os.getxattr(p, x, follow_symlinks=False) for x in sorted(os.listxattr(p))}
        if stat.S_ISREG(st.st_mode):
            entry["data"] = data_map(p)
        out[rel] = entry
    return out


def test_snapshots_keep_inodes_links_holes_xattrs_modes_and_times(pool: Pool, ids: Callable[[], str]) -> None:
    sb, ck, back = SubvolRef.sandbox(ids()), SubvolRef.snapshot(ids()), SubvolRef.sandbox(ids())
    upper = pool.create_subvolume(sb, dirs=("upper", "work")) / "upper"
    build_tree(upper)
    # Snapshots first: describing a tree reads its directories and symlinks, which moves their atimes
    # (describe() stats each entry before reading it, so its first look sees the untouched values).
    pool.snapshot(sb, ck, readonly=True)
    pool.snapshot(ck, back, readonly=False)
    before = describe(upper)
    assert before["hardlink"]["st_ino"] == before["dir/file"]["st_ino"] and before["hardlink"]["st_nlink"] == 2
    assert len(before["sparse"]["data"]) == 2 and before["sparse"]["st_blocks"] * 512 < 1 << 20
    assert before["bin"]["xattrs"]["security.capability"] == CAP and before["bin"]["st_mode"] & stat.S_ISUID

    assert describe(pool.path(ck) / "upper") == before
    assert describe(pool.path(back) / "upper") == before
    assert (pool.path(back) / "upper" / "hardlink").read_text() == "hello"
    assert (pool.path(back) / "upper" / "sparse").read_bytes()[-4:] == b"tail"
    assert not pool.is_readonly(back) and pool.is_readonly(ck)


def test_read_only_snapshot_refuses_writes_and_can_be_deleted(pool: Pool, ids: Callable[[], str]) -> None:
    sb, ck = SubvolRef.sandbox(ids()), SubvolRef.snapshot(ids())
    (pool.create_subvolume(sb, dirs=("upper",)) / "upper" / "f").write_text("v1")
    snap = pool.snapshot(sb, ck)
    for attempt in (
        lambda: (snap / "upper" / "f").write_text("v2"),
        lambda: (snap / "upper" / "new").mkdir(),
        lambda: os.unlink(snap / "upper" / "f"),
    ):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS
    (pool.path(sb) / "upper" / "f").write_text("v2")  # the sandbox itself stays writable
    assert (snap / "upper" / "f").read_text() == "v1"
    assert ck.id in pool.list(SubvolKind.SNAPSHOT) and sb.id in pool.list(SubvolKind.SANDBOX)
    assert pool.delete(ck) is True
    assert not pool.exists(ck) and ck.id not in pool.list(SubvolKind.SNAPSHOT)
    assert pool.delete(ck) is False


def test_names_are_never_reused_and_no_half_made_one_stays(pool: Pool, ids: Callable[[], str]) -> None:
    sb, ck = SubvolRef.sandbox(ids()), SubvolRef.snapshot(ids())
    pool.create_subvolume(sb)
    with pytest.raises(SnapshotError) as info:
        pool.create_subvolume(sb)
    assert info.value.op == "publish" and info.value.subvolume == sb.relpath
    pool.snapshot(sb, ck)
    with pytest.raises(SnapshotError):
        pool.snapshot(sb, ck)
    with pytest.raises(SnapshotError) as missing:
        pool.snapshot(SubvolRef.sandbox(ids()), SubvolRef.snapshot(ids()))
    assert missing.value.op == "open"
    for kind in SubvolKind:
        assert not [n for n in os.listdir(pool.mount_point / kind.value) if n.startswith(f"tmp-{sb.id}")]
        assert not [n for n in os.listdir(pool.mount_point / kind.value) if n.startswith(f"tmp-{ck.id}")]


def test_generation_and_changed_since(pool: Pool, ids: Callable[[], str]) -> None:
    sb = SubvolRef.sandbox(ids())
    upper = pool.create_subvolume(sb, dirs=("upper",)) / "upper"
    (upper / "old").write_text("old")
    os.sync()
    gen = pool.generation(sb)
    (upper / "new").write_text("new")
    os.sync()
    changes = pool.changed_since(sb, gen)
    assert changes.paths == {"upper/new"}
    assert changes.generation > gen and pool.generation(sb) > gen


def test_pool_refuses_a_directory_that_is_not_btrfs(crab_tmp: Path) -> None:
    require(have_root(), "needs root")
    with pytest.raises(HostError, match="not a mounted btrfs"):
        Pool(crab_tmp)
    with pytest.raises(HostError, match="cannot be opened"):
        Pool(crab_tmp / "missing")


def test_orphan_cleanup_removes_half_made_and_unreferenced(small_pool: Pool) -> None:
    live_sb, dead_sb = SubvolRef.sandbox("live"), SubvolRef.sandbox("dead")
    live_ck, dead_ck = SubvolRef.snapshot("ck-live"), SubvolRef.snapshot("ck-dead")
    for sb in (live_sb, dead_sb):
        small_pool.create_subvolume(sb, dirs=("upper",))
    small_pool.snapshot(live_sb, live_ck)
    small_pool.snapshot(dead_sb, dead_ck)
    # What a kill -9 inside create or snapshot leaves: a subvolume under its tmp- name.
    sh("btrfs", "subvolume", "create", str(small_pool.mount_point / "sandboxes" / "tmp-x-0badf00d"))
    sh(
        "btrfs",
        "subvolume",
        "snapshot",
        "-r",
        str(small_pool.path(live_sb)),
        str(small_pool.mount_point / "snapshots" / "tmp-ck-y-00c0ffee"),
    )
    sh("btrfs", "subvolume", "create", str(small_pool.mount_point / "sandboxes" / "tmp-.odd"))
    # Not crab's, left alone: a plain directory, and a subvolume whose name is no id.
    (small_pool.mount_point / "sandboxes" / "not-a-subvolume").mkdir()
    sh("btrfs", "subvolume", "create", str(small_pool.mount_point / "sandboxes" / "someone.else"))

    removed = small_pool.cleanup_orphans({SubvolKind.SANDBOX: {"live"}, SubvolKind.SNAPSHOT: {"ck-live"}})
    assert sorted(removed) == [
        "sandboxes/dead",
        "sandboxes/tmp-.odd",
        "sandboxes/tmp-x-0badf00d",
        "snapshots/ck-dead",
        "snapshots/tmp-ck-y-00c0ffee",
    ]
    assert small_pool.list(SubvolKind.SANDBOX) == ["live"] and small_pool.list(SubvolKind.SNAPSHOT) == ["ck-live"]
    assert sorted(os.listdir(small_pool.mount_point / "sandboxes")) == ["live", "not-a-subvolume", "someone.else"]
    assert small_pool.cleanup_orphans({SubvolKind.SANDBOX: {"live"}, SubvolKind.SNAPSHOT: {"ck-live"}}) == []


def fill(path: Path) -> None:
    """Write to ``path`` until the file system refuses (btrfs reserves space at write time)."""
    chunk = os.urandom(4 << 20)
    with pytest.raises(OSError) as info, open(path, "wb") as f:
        while True:
            f.write(chunk)
    assert info.value.errno == errno.ENOSPC


def test_a_full_pool_gives_store_full_and_other_subvolumes_keep_working(small_pool: Pool) -> None:
    hog, other = SubvolRef.sandbox("hog"), SubvolRef.sandbox("other")
    small_pool.create_subvolume(hog, dirs=("upper",))
    (small_pool.create_subvolume(other, dirs=("upper",)) / "upper" / "keep").write_text("still here")
    fill(small_pool.path(hog) / "upper" / "big")

    with pytest.raises(StoreFull) as info:
        small_pool.snapshot(hog, SubvolRef.snapshot("ck-hog"))
    assert info.value.hint == POOL_FULL_HINT and info.value.path == str(small_pool.mount_point)
    assert not small_pool.exists(SubvolRef.snapshot("ck-hog"))
    assert (small_pool.path(other) / "upper" / "keep").read_text() == "still here"

    # Freeing the hog's space (and committing, so statfs sees it) lets the other sandbox checkpoint again.
    os.unlink(small_pool.path(hog) / "upper" / "big")
    sh("btrfs", "filesystem", "sync", str(small_pool.mount_point))
    small_pool.snapshot(other, SubvolRef.snapshot("ck-other"))
    assert (small_pool.path(SubvolRef.snapshot("ck-other")) / "upper" / "keep").read_text() == "still here"


#: Paths in the overlay whose st_ino must not change across a checkpoint and restore.
KEEP_INO = ("etc/issue", "etc/conf", "etc/conf.link", "data/app.db", "new.txt")


def image_lower(lower: Path) -> None:
    """A tiny env image: a file never written, one that will be, and a SQLite database, on the root ext4."""
    (lower / "etc").mkdir(parents=True)
    (lower / "etc" / "issue").write_text("never written\n")
    (lower / "etc" / "conf").write_text("from the image")
    (lower / "data").mkdir()
    with contextlib.closing(sqlite3.connect(lower / "data" / "app.db")) as db:
        db.execute("CREATE TABLE t (x TEXT)")
        db.execute("INSERT INTO t VALUES ('from the image')")
        db.commit()


def test_overlay_keeps_st_ino_of_copied_up_files_across_snapshot_restore(
    pool: Pool, ids: Callable[[], str], crab_tmp: Path
) -> None:
    """crab's overlay options (``xino=on``): a file copied up from the image keeps its st_ino after a restore.

    A restore mounts a writable snapshot of the checkpoint as a new overlay.
    With ``xino=off`` and this host's root ext4 (NULL UUID), a copied-up file
    showed its lower inode until the overlay that copied it up was unmounted,
    its upper inode on every later mount: SQLite's cached st_ino went stale
    and the restored connection's next write failed SQLITE_READONLY_DBMOVED.
    """
    lower = crab_tmp / "lower"  # on the root ext4, like an env image's rootfs
    image_lower(lower)
    sb, ck, back = SubvolRef.sandbox(ids()), SubvolRef.snapshot(ids()), SubvolRef.sandbox(ids())
    sub = pool.create_subvolume(sb, dirs=("upper", "work"))
    target = crab_tmp / "merged"
    live = rootfs.Overlay((lower,), sub / "upper", sub / "work", target)
    rootfs.mount(live)
    db = None
    try:
        opts = next(ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if f" {target} " in ln)
        assert ",xino=on" in opts.split(" - ")[1], f"the kernel turned xino off: {opts}"
        (target / "new.txt").write_text("made in the sandbox")
        with open(target / "etc" / "conf", "a") as f:  # copy-up from the image
            f.write(" + changed")
        os.link(target / "etc" / "conf", target / "etc" / "conf.link")
        db = sqlite3.connect(target / "data" / "app.db", isolation_level=None)  # opened read-write: a copy-up
        db.execute("INSERT INTO t VALUES ('before the checkpoint')")
        before = {n: os.stat(target / n) for n in KEEP_INO}
        assert before["new.txt"].st_ino == os.stat(sub / "upper" / "new.txt").st_ino
        assert before["etc/conf.link"].st_ino == before["etc/conf"].st_ino
        assert len({s.st_dev for s in before.values()}) == 1, "xino: one st_dev for every layer"
        assert {e.name: e.inode() for e in os.scandir(target / "etc")} == {
            n.removeprefix("etc/"): before[n].st_ino for n in KEEP_INO if n.startswith("etc/")
        }, "xino: readdir's d_ino is st_ino"

        pool.snapshot(sb, ck)
        # The restore: the sandbox's overlay goes (lazily: the open connection holds it) and a writable
        # snapshot of the checkpoint is mounted at the same path, as CRIU would find it.
        assert rootfs.umount(target)
        restored = pool.snapshot(ck, back, readonly=False)
        rootfs.mount(rootfs.Overlay((lower,), restored / "upper", restored / "work", target))
        after = {n: os.stat(target / n) for n in KEEP_INO}
        assert {n: s.st_ino for n, s in after.items()} == {n: s.st_ino for n, s in before.items()}
        assert len({s.st_dev for s in after.values()}) == 1
        assert (target / "etc" / "conf").read_text() == "from the image + changed"
        # SQLite compares stat(path).st_ino with what it cached at open before each write transaction.
        db.execute("INSERT INTO t VALUES ('after the restore, old connection')")
        db.close()
        db = None
        with contextlib.closing(sqlite3.connect(target / "data" / "app.db", isolation_level=None)) as fresh:
            fresh.execute("INSERT INTO t VALUES ('after the restore')")
            rows = [r[0] for r in fresh.execute("SELECT x FROM t")]
        assert rows == ["from the image", "before the checkpoint", "after the restore"]
    finally:
        if db is not None:
            db.close()
        rootfs.umount(target)
    assert not rootfs.is_mounted(target)


CHURN = """
import sys
from crabd.backends.btrfs import Pool, SubvolRef
with Pool(sys.argv[1]) as pool:
    print("ready", flush=True)
    i = 0
    while True:
        sb = SubvolRef.sandbox(f"s{i}")
        pool.create_subvolume(sb, dirs=("upper", "work"))
        pool.snapshot(sb, SubvolRef.snapshot(f"ck-{i}"))
        pool.snapshot(SubvolRef.snapshot(f"ck-{i}"), SubvolRef.sandbox(f"r{i}"), readonly=False)
        i += 1
"""


def test_kill_9_while_snapshotting_leaves_nothing_after_cleanup(small_pool: Pool) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHURN, str(small_pool.mount_point)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        time.sleep(0.3)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert small_pool.list(SubvolKind.SANDBOX), "the child made nothing before it was killed"
    small_pool.cleanup_orphans({})
    for kind in SubvolKind:
        assert os.listdir(small_pool.mount_point / kind.value) == []


def test_pool_never_follows_a_symlinked_kind_directory(small_pool: Pool, crab_tmp: Path) -> None:
    elsewhere = crab_tmp / "elsewhere"
    elsewhere.mkdir()
    mnt = small_pool.mount_point
    os.rmdir(mnt / "snapshots")
    os.symlink(elsewhere, mnt / "snapshots")
    try:
        with pytest.raises(HostError, match="cannot open its directories"):
            Pool(mnt)
    finally:
        os.unlink(mnt / "snapshots")
    assert os.listdir(elsewhere) == []


def run_setup_pool_step(image: Path, mount: Path) -> str:
    """Run only ``ensure_btrfs_pool`` of scripts/setup-host.sh (its definitions, none of its steps); its log."""
    script = REPO / "scripts" / "setup-host.sh"
    body = f"set -euo pipefail; source <(sed '/^ensure_apt_packages$/,$d' {script}); ensure_btrfs_pool"
    env = {**os.environ, "CRAB_BTRFS_IMAGE": str(image), "CRAB_BTRFS_MOUNT": str(mount), "CRAB_BTRFS_SIZE": "200M"}
    done = subprocess.run(["bash", "-c", body], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_setup_makes_and_mounts_the_pool_once(crab_tmp: Path) -> None:
    require(have_root(), "needs root")
    image, mount = crab_tmp / "img" / "btrfs.img", crab_tmp / "pool"
    try:
        first = run_setup_pool_step(image, mount)
        assert f"made {image} (200M, sparse)" in first and "mounted now" in first and "free of" in first
        assert os.stat(image).st_blocks * 512 < 200 << 20  # sparse
        second = run_setup_pool_step(image, mount)
        assert "made" not in second and "(mounted)" in second
        with Pool(mount) as p:
            assert p.usage().total_bytes > 100 << 20
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=60)
        left = subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True, timeout=30).stdout
        image.unlink(missing_ok=True)
        assert left.strip() == ""
