"""Filesystem capture and materialize on real directories (no Docker, no root needed).

The tree under test plays the part of a container's upper dir; what the
hostile-sandbox rules require is checked on the real filesystem.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from crabd.backends.fsdelta import TICK_NS, Entry, FsCapture, Kind, ScanLimits, StoredTree
from crabd.backends.overlay.backend import OverlayDelta
from crabd.backends.overlay.index import PageCache, paginate
from crabd.backends.overlay.materialize import materialize
from crabd.errors import CorruptBlob, StoreError, TooManyEntries, UnsafeEntry
from crabd.store.fsblobs import FileBlobStore
from tests.fstree import bound_unix_socket, diff, snapshot


@dataclass
class Env:
    root: Path
    upper: Path
    blobs: FileBlobStore
    fs: OverlayDelta

    def capture(self, base: list[Entry] | None = None, racy_ns: int = 0) -> tuple[FsCapture, StoredTree]:
        cut = self.fs.capture(self.fs.prepare(self.upper, base, racy_ns))
        return self.fs.store(cut)

    def restore_into(self, tree: list[Entry], name: str = "out") -> Path:
        target = self.root / name
        target.mkdir()
        self.fs.materialize(tree, target)
        return target


def _tmpfs_or(tmp_path: Path) -> Path:
    """/dev/shm when it is a tmpfs we can write (fast for many files), else tmp_path."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = shm / f"crab-test-{os.getpid()}-{time.monotonic_ns()}"
        d.mkdir()
        return d
    return tmp_path


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    upper = tmp_path / "upper"
    upper.mkdir()
    blobs = FileBlobStore(tmp_path / "blobs")
    yield Env(tmp_path, upper, blobs, OverlayDelta(blobs, cache=PageCache(100_000)))


def _populate(upper: Path) -> None:
    (upper / "work").mkdir()
    (upper / "work" / "a.txt").write_text("hello\n")
    (upper / "work" / "empty").write_bytes(b"")
    (upper / "work" / "exec.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(upper / "work" / "exec.sh", 0o755)
    os.chmod(upper / "work" / "a.txt", 0o640)
    os.symlink("/etc/shadow", upper / "work" / "shadow-link")
    os.symlink("../nowhere/../../..", upper / "work" / "dangling")
    os.mkfifo(upper / "work" / "fifo")
    bound_unix_socket(upper / "work" / "sock")
    os.link(upper / "work" / "a.txt", upper / "work" / "z-hardlink")
    os.link(upper / "work" / "a.txt", upper / "work" / "0-hardlink")
    (upper / b"weird\nname \xff\xfe.txt".decode("utf-8", "surrogateescape")).write_bytes(b"\x00\x01bin")
    (upper / ("x" * 255)).write_text("long name")
    deep = upper / "deep"
    for i in range(60):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    (deep / "leaf").write_text("deep")
    os.setxattr(upper / "work" / "a.txt", "user.crab.test", b"value\x00with nul")
    (upper / "big").write_bytes(os.urandom(5 << 20) + b"tail")
    os.utime(upper / "work" / "a.txt", ns=(1_000_000_000, 1_500_000_000_123))


def test_capture_and_materialize_round_trip_exactly(env: Env) -> None:
    _populate(env.upper)
    capture, stored = env.capture()
    assert capture.stats["entries"] == len(capture.tree) > 60
    assert not capture.changed and not capture.deleted and len(capture.added) == len(capture.tree)
    target = env.restore_into(env.fs.load(stored.index_blob))
    assert diff(snapshot(env.upper), snapshot(target)) == []
    # Hardlinks stay hardlinks, grouped under the smallest name.
    st = [os.lstat(target / "work" / n) for n in ("0-hardlink", "a.txt", "z-hardlink")]
    assert len({s.st_ino for s in st}) == 1 and st[0].st_nlink == 3


def test_symlinks_are_recorded_never_followed(env: Env, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_bytes(b"host secret " + os.urandom(16))
    os.symlink(secret, env.upper / "link-to-host")
    (env.upper / "dir").mkdir()
    os.symlink(tmp_path, env.upper / "dir" / "link-to-host-dir")
    capture, stored = env.capture()
    by_path = {e.path: e for e in capture.tree}
    assert by_path[b"link-to-host"].kind is Kind.LNK
    assert by_path[b"link-to-host"].target == os.fsencode(secret)
    assert not by_path[b"link-to-host"].extents
    # Nothing under the linked host dir was walked, and the secret is in no blob.
    assert all(not p.startswith(b"dir/link-to-host-dir/") for p in by_path)
    contents = [env.blobs.read_bytes(h, limit=64 << 20) for h in env.blobs.iter_all()]
    assert not any(secret.read_bytes() in c for c in contents)
    target = env.restore_into(env.fs.load(stored.index_blob))
    assert os.readlink(target / "link-to-host") == str(secret)


def test_fifos_and_sockets_are_never_opened(env: Env) -> None:
    fifo = env.upper / "fifo"
    os.mkfifo(fifo)
    bound_unix_socket(env.upper / "sock")
    opened = threading.Event()

    def writer() -> None:
        # Blocks until somebody opens the fifo for reading.
        fd = os.open(fifo, os.O_WRONLY)
        opened.set()
        os.close(fd)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    time.sleep(0.05)
    capture, _ = env.capture()
    kinds = {e.path: e.kind for e in capture.tree}
    assert kinds == {b"fifo": Kind.FIFO, b"sock": Kind.SOCK}
    assert not opened.is_set(), "the capture opened the fifo"
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # release the writer
    t.join(5)
    os.close(fd)


def test_sparse_terabyte_file_costs_its_extents(env: Env) -> None:
    path = env.upper / "sparse"
    with open(path, "wb") as f:
        f.truncate(1 << 40)
        f.seek(1 << 39)
        f.write(b"middle")
        f.seek((1 << 40) - 4)
        f.write(b"end!")
    capture, stored = env.capture()
    assert capture.new_bytes + stored.new_bytes < 64 << 10
    assert capture.stats["bytes_read"] < 1 << 20
    target = env.restore_into(env.fs.load(stored.index_blob))
    out = target / "sparse"
    st = os.stat(out)
    assert st.st_size == 1 << 40 and st.st_blocks * 512 < 1 << 20
    with open(out, "rb") as f:
        f.seek(1 << 39)
        assert f.read(6) == b"middle"
        f.seek((1 << 40) - 4)
        assert f.read() == b"end!"


def test_fragmented_files_are_bounded(env: Env) -> None:
    fine = env.upper / "fine"
    with open(fine, "wb") as f:  # one byte every 16 KiB: small holes are read as zeros
        for i in range(64):
            f.seek(i * (16 << 10))
            f.write(b"x")
    capture, _ = env.capture()
    [entry] = [e for e in capture.tree if e.path == b"fine"]
    assert len(entry.extents) == 1
    coarse = env.upper / "coarse"
    with open(coarse, "wb") as f:  # a data block every MiB, 300 times
        for i in range(300):
            f.seek(i << 20)
            f.write(b"y")
    small = OverlayDelta(env.blobs, limits=ScanLimits(max_entries=200))
    with pytest.raises(TooManyEntries, match="extents"):
        small.capture(small.prepare(env.upper, None, 0))


@pytest.mark.slow
def test_two_hundred_thousand_files_in_one_dir(tmp_path: Path) -> None:
    base = _tmpfs_or(tmp_path)
    try:
        upper = base / "upper"
        (upper / "many").mkdir(parents=True)
        names = [f"f{i}\n\udcff" if i % 1000 == 0 else f"f{i}" for i in range(200_000)]
        for n in names:
            os.close(os.open(upper / "many" / n, os.O_CREAT | os.O_WRONLY, 0o644))
        blobs = FileBlobStore(base / "blobs")
        fs = OverlayDelta(blobs, limits=ScanLimits(max_entries=300_000), cache=PageCache(500_000))
        capture, stored = fs.store(fs.capture(fs.prepare(upper, None, 0)))
        assert len(capture.tree) == 200_001
        target = base / "out"
        target.mkdir()
        fs.materialize(fs.load(stored.index_blob), target)
        assert sorted(os.listdir(os.fsencode(target / "many"))) == sorted(os.fsencode(n) for n in names)
    finally:
        if base != tmp_path:
            import shutil

            shutil.rmtree(base, ignore_errors=True)


def test_unchanged_recheckpoint_stores_nothing_new(env: Env) -> None:
    _populate(env.upper)
    first, stored = env.capture()
    time.sleep(2 * TICK_NS / 1e9)
    racy = time.time_ns() - TICK_NS
    again, stored2 = env.capture(first.tree, racy)
    assert again.new_bytes == 0 and stored2.new_bytes == 0
    assert stored2.index_blob == stored.index_blob
    assert not again.added and not again.changed and not again.deleted and stored2.delta_blob == ""
    # Only the one hardlinked inode is read again (hardlinks always are).
    assert again.stats["files_read"] <= 2


def test_delta_lists_added_changed_deleted_and_whiteouts(env: Env) -> None:
    _populate(env.upper)
    first, _ = env.capture()
    time.sleep(2 * TICK_NS / 1e9)
    (env.upper / "work" / "a.txt").write_text("changed\n")
    (env.upper / "work" / "new.txt").write_text("new\n")
    os.unlink(env.upper / "work" / "empty")
    capture, stored = env.capture(first.tree, time.time_ns() - TICK_NS)
    assert {e.path for e in capture.added} == {b"work/new.txt"}
    assert b"work/a.txt" in {e.path for e in capture.changed}
    assert capture.deleted == [b"work/empty"]
    changes = {c.path: c.change for c in env.fs.changes(stored.delta_blob, 100)[0]}
    assert changes[b"work/new.txt"] == "added" and changes[b"work/empty"] == "deleted"


def test_change_between_the_two_passes_is_caught(env: Env) -> None:
    f = env.upper / "f"
    f.write_text("one")
    prepared = env.fs.prepare(env.upper, None, 0)
    f.write_text("two")  # after the unfrozen pass read "one"
    (env.upper / "late").write_text("late")
    _, stored = env.fs.store(env.fs.capture(prepared))
    target = env.restore_into(env.fs.load(stored.index_blob))
    assert (target / "f").read_text() == "two"
    assert (target / "late").read_text() == "late"


def test_racy_entries_are_reread(env: Env) -> None:
    """A write in the same clock tick as the last stat can leave every stat field unchanged;
    entries whose ctime is not safely below the previous checkpoint's threshold are re-read."""
    f = env.upper / "f"
    f.write_text("aaaa")
    first, _ = env.capture()
    old = {e.path: e for e in first.tree}[b"f"]
    f.write_text("bbbb")
    st = os.lstat(f)
    # Forge what a racy write looks like: the previous index holds the new
    # stat fields with the old content.
    forged = Entry(**{k: getattr(old, k) for k in old.__slots__})
    forged.mtime_ns, forged.ctime_ns, forged.ino, forged.size = st.st_mtime_ns, st.st_ctime_ns, st.st_ino, 4
    trusted, _ = env.capture([forged], racy_ns=st.st_ctime_ns + 1)
    assert {e.path: e for e in trusted.tree}[b"f"].extents == old.extents  # trusted: reused (stale)
    _, stored = env.capture([forged], racy_ns=st.st_ctime_ns)
    target = env.restore_into(env.fs.load(stored.index_blob))
    assert (target / "f").read_text() == "bbbb"


def test_limits_fail_clearly(env: Env) -> None:
    for i in range(20):
        (env.upper / f"f{i}").write_text("x")
    small = OverlayDelta(env.blobs, limits=ScanLimits(max_entries=10))
    with pytest.raises(TooManyEntries):
        small.capture(small.prepare(env.upper, None, 0))
    deep = env.upper / "deep"
    for _ in range(30):
        deep = deep / "d"
    deep.mkdir(parents=True)
    shallow = OverlayDelta(env.blobs, limits=ScanLimits(max_depth=10))
    with pytest.raises(TooManyEntries, match="deeper"):
        shallow.capture(shallow.prepare(env.upper, None, 0))


def _entry(path: bytes, kind: Kind, **kw: object) -> Entry:
    e = Entry(path, kind, 0o644, os.getuid(), os.getgid(), 0, 0, 0, 0, 0, 1)
    for k, v in kw.items():
        setattr(e, k, v)
    return e


@pytest.mark.parametrize(
    "entries",
    [
        [_entry(b"../escape", Kind.REG)],
        [_entry(b"/abs", Kind.REG)],
        [_entry(b"a/./b", Kind.REG)],
        [_entry(b"link", Kind.LNK, target=b"/tmp"), _entry(b"link/x", Kind.REG)],
        [_entry(b"f", Kind.REG, link_to=b"../../etc/passwd")],
        [_entry(b"a", Kind.REG, link_to=b"b"), _entry(b"b", Kind.DIR)],
    ],
    ids=["dotdot", "absolute", "dot", "through-symlink", "hardlink-out", "hardlink-to-dir"],
)
def test_materialize_refuses_entries_that_escape(env: Env, tmp_path: Path, entries: list[Entry]) -> None:
    target = tmp_path / "target"
    target.mkdir()
    before = set(os.listdir(tmp_path)) | set(os.listdir("/tmp"))

    def canary() -> tuple[int, int, int] | None:
        # "link/x" through a link to /tmp would land on /tmp/x.  It may exist
        # already (a checkout cloned there): then it must be left untouched.
        try:
            st = os.lstat("/tmp/x")
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_ctime_ns

    canary_before = canary()
    with pytest.raises(UnsafeEntry):
        materialize(entries, env.blobs, target)
    assert set(os.listdir(tmp_path)) | set(os.listdir("/tmp")) <= before | {"target"}
    assert canary() == canary_before


def test_corrupt_content_is_detected_on_materialize(env: Env) -> None:
    (env.upper / "f").write_bytes(b"precious data " * 100)
    capture, stored = env.capture()
    blob = next(x.blob for e in capture.tree for x in e.extents)
    path = env.blobs.path(blob)
    other = env.blobs.put_bytes(b"something else entirely")
    os.replace(env.blobs.path(other.hex), path)  # valid zstd, wrong content
    target = env.root / "out"
    target.mkdir()
    with pytest.raises(CorruptBlob) as info:
        env.fs.materialize(env.fs.load(stored.index_blob), target)
    assert info.value.blob == blob


def test_one_change_rewrites_one_page(env: Env) -> None:
    entries = [_entry(f"f{i:06}".encode(), Kind.REG) for i in range(5000)]
    pages = paginate(entries)
    assert len(pages) > 5
    changed = list(entries)
    changed[2500] = _entry(b"f002500", Kind.REG, mode=0o600)
    after = paginate(changed)
    differing = sum(1 for a, b in zip(pages, after, strict=True) if a != b)
    assert len(after) == len(pages) and differing == 1


def test_materialize_into_an_upper_dir_where_docker_made_the_workdir(env: Env, tmp_path: Path) -> None:
    # Docker creates a missing WorkingDir (/app/src) in a new container's upper dir before it runs.
    _populate(env.upper)
    (env.upper / "app" / "src").mkdir(parents=True)
    (env.upper / "app" / "src" / "main.py").write_text("print(1)\n")
    _, stored = env.capture()
    target = tmp_path / "new-upper"
    (target / "app" / "src").mkdir(parents=True)
    (target / "empty-made-by-docker").mkdir()
    env.fs.materialize(env.fs.load(stored.index_blob), target)
    assert diff(snapshot(env.upper), snapshot(target)) == []
    # Anything but empty directories is still refused: a restore never merges into old content.
    other = tmp_path / "used-upper"
    (other / "app").mkdir(parents=True)
    (other / "app" / "stale.txt").write_text("old\n")
    with pytest.raises(StoreError, match="non-empty"):
        env.fs.materialize(env.fs.load(stored.index_blob), other)
    assert (other / "app" / "stale.txt").read_text() == "old\n"
