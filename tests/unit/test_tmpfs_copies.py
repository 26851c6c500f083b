"""A dump's tmpfs copies (crabd/backends/runc/tmpfs_copies.py): what qualifies, the keys, what a restore mounts.

The mounting itself needs root and a container: tests/integration/test_runc_daemon.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crabd.backends.criu import pbimage
from crabd.backends.runc import bundle, tmpfs_copies
from crabd.backends.runc.dumps import plan
from crabd.backends.tmpfs_key import MAX_ENTRIES, CopyEntry, TmpfsCopy
from crabd.errors import ContainerRuntimeError
from tests.criu_forge import image, mount
from tests.unit.test_runc_dumps import state

OWNER = (os.getuid(), os.getgid())


def D(name: str) -> CopyEntry:
    return CopyEntry("dir", name)


def F(name: str) -> CopyEntry:
    return CopyEntry("file", name)


def L(name: str, target: str, mtime: int = 7) -> CopyEntry:
    return CopyEntry("link", name, target, mtime)


MTIME = 1_577_934_245_123_456_789  # 2020-01-02 03:04:05.123456789


@pytest.mark.parametrize(
    "copy",
    [
        TmpfsCopy("/dev/shm", 0o1777, MTIME),
        TmpfsCopy("/sys/fs/cgroup", 0o555, 0, (D("blkio"), D("cpu,cpuacct"), D("systemd"))),
        TmpfsCopy("/dev", 0o755, MTIME, (L("fd", "/proc/self/fd"), F("null"), L("ptmx", "pts/ptmx"), D("pts"))),
    ],
)
def test_a_key_says_all_of_the_copy(copy: TmpfsCopy) -> None:
    assert TmpfsCopy.is_key(copy.key) and TmpfsCopy.parse(copy.key) == copy


@pytest.mark.parametrize(
    "key",
    [
        "crab-tmpfs:/dev/shm:1777:1",  # a field short
        "crab-tmpfs:/dev/shm:1777:1::",  # a field too many
        "crab-tmpfs:/dev/shm:9:1:",  # not octal
        "crab-tmpfs:/dev/shm:17777:1:",  # beyond the permission bits
        "crab-tmpfs:/dev/shm:1777:-1:",
        "crab-tmpfs:/dev/shm:1777:99999999999999999999:",  # beyond 64 bits
        "crab-tmpfs:dev/shm:1777:1:",  # not absolute
        "crab-tmpfs:/dev/../etc:1777:1:",
        "crab-tmpfs:/dev/shm]:1777:1:",  # CRIU's key would end there
        "crab-tmpfs:/sys/fs/cgroup:555:1:d=cpu/../..",  # a path, not a name
        "crab-tmpfs:/sys/fs/cgroup:555:1:d=cpu+d=blkio",  # not sorted
        "crab-tmpfs:/sys/fs/cgroup:555:1:d=cpu+d=cpu",
        "crab-tmpfs:/sys/fs/cgroup:555:1:d=cpu+f=cpu",  # one name twice
        "crab-tmpfs:/sys/fs/cgroup:555:1:d=..",
        "crab-tmpfs:/sys/fs/cgroup:555:1:cpu",  # no kind
        "crab-tmpfs:/sys/fs/cgroup:555:1:x=cpu",  # no such kind
        "crab-tmpfs:/sys/fs/cgroup:555:1:d=cpu=/x=1",  # a directory with a target
        "crab-tmpfs:/dev:755:1:l=fd=/proc/self/fd",  # a link without its mtime
        "crab-tmpfs:/dev:755:1:l=fd==1",  # nor a target
        "crab-tmpfs:/dev:755:1:l=fd=/a b=1",  # a target a key cannot carry
        "crab-tmpfs:/sys/fs/cgroup:555:1:" + "+".join(f"d=d{i:02}" for i in range(MAX_ENTRIES + 1)),
    ],
)
def test_a_malformed_key_is_an_error(key: str) -> None:
    assert TmpfsCopy.is_key(key)
    with pytest.raises(ValueError):
        TmpfsCopy.parse(key)


def test_other_keys_are_not_copies() -> None:
    assert not TmpfsCopy.is_key("crab-masked-dir") and not TmpfsCopy.is_key("/dev/null")
    assert not TmpfsCopy.is_key(None) and not TmpfsCopy.is_key("crab-tmpfs.1777.1.")


# --- the dump's look -------------------------------------------------------------------------------------


def mountinfo(root: Path, *lines: tuple[int, int, str, str, str]) -> str:
    """Lines of a mountinfo: (id, parent, root, point, fstype), each on ``root``'s device."""
    dev = os.stat(root).st_dev
    return "".join(
        f"{i} {parent} {os.major(dev)}:{os.minor(dev)} {r} {point} rw,nosuid - {fstype} x rw\n"
        for i, parent, r, point, fstype in lines
    )


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A container root with an empty /dev/shm, which this test directory's inode stands in for a tmpfs root."""
    (tmp_path / "root" / "dev" / "shm").mkdir(parents=True)
    shm = tmp_path / "root" / "dev" / "shm"
    os.utime(shm, ns=(MTIME, MTIME))
    os.chmod(shm, 0o1777)
    monkeypatch.setattr(tmpfs_copies, "_TMPFS_ROOT_INO", os.stat(shm).st_ino)
    return tmp_path / "root"


SHM = (89, 87, "/", "/dev/shm", "tmpfs")


def survey(root: Path, *lines: tuple[int, int, str, str, str], owner: tuple[int, int] = OWNER) -> dict[str, Any]:
    return tmpfs_copies.survey(root, mountinfo(root, *lines), ["/dev/shm", "/sys/fs/cgroup"], owner)


def test_an_empty_tmpfs_is_a_copy_of_its_root(root: Path) -> None:
    assert survey(root, SHM) == {"/dev/shm": TmpfsCopy("/dev/shm", 0o1777, MTIME)}


@pytest.mark.parametrize("what", ["file", "dir", "fifo", "link a key cannot carry"])
def test_anything_of_the_sandboxs_in_it_leaves_it_to_criu(root: Path, what: str) -> None:
    entry = root / "dev" / "shm" / "x"
    makers: dict[str, Callable[[], object]] = {
        "file": entry.touch,
        "dir": entry.mkdir,
        "fifo": lambda: os.mkfifo(entry),
        "link a key cannot carry": lambda: entry.symlink_to("/a b"),
    }
    makers[what]()
    assert survey(root, SHM) == {}


def test_a_link_of_another_owner_than_the_sandboxs_root_is_left_to_criu(root: Path) -> None:
    (root / "dev" / "shm" / "x").symlink_to("/etc")
    fd = os.open(root / "dev" / "shm", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(fd) as it:
            [entry] = list(it)
        assert tmpfs_copies._entry(fd, entry, False, OWNER) == L("x", "/etc", os.lstat(root / "dev/shm/x").st_mtime_ns)
        assert tmpfs_copies._entry(fd, entry, False, (OWNER[0] + 1, OWNER[1])) is None
        assert tmpfs_copies._entry(fd, entry, True, OWNER) is None  # a link where a mount's point should be
    finally:
        os.close(fd)


def test_a_link_of_the_sandboxs_root_is_carried_with_its_target_and_mtime(root: Path) -> None:
    link = root / "dev" / "shm" / "x"
    link.symlink_to("/etc")  # never followed: the key holds the target, the restore makes the link
    os.utime(link, ns=(5, 5), follow_symlinks=False)
    os.utime(root / "dev" / "shm", ns=(MTIME, MTIME))
    assert survey(root, SHM) == {"/dev/shm": TmpfsCopy("/dev/shm", 0o1777, MTIME, (L("x", "/etc", 5),))}


def test_runcs_dev_is_a_copy_of_its_links_and_what_its_mounts_cover(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = root / "dev"
    (dev / "pts").mkdir()
    (dev / "null").touch()
    (dev / "ptmx").symlink_to("pts/ptmx")
    (dev / "stdin").symlink_to("/proc/self/fd/0")
    for p in (dev / "ptmx", dev / "stdin"):
        os.utime(p, ns=(9, 9), follow_symlinks=False)
    os.utime(dev, ns=(MTIME, MTIME))
    os.chmod(dev, 0o755)
    lines = [
        (87, 85, "/", "/dev", "tmpfs"),
        (88, 87, "/", "/dev/pts", "devpts"),
        (89, 87, "/", "/dev/shm", "tmpfs"),
        (104, 87, "/null", "/dev/null", "devtmpfs"),
    ]
    monkeypatch.setattr(tmpfs_copies, "_TMPFS_ROOT_INO", os.stat(dev).st_ino)
    got = tmpfs_copies.survey(root, mountinfo(root, *lines), ["/dev"], OWNER)
    entries = (F("null"), L("ptmx", "pts/ptmx", 9), D("pts"), D("shm"), L("stdin", "/proc/self/fd/0", 9))
    assert got == {"/dev": TmpfsCopy("/dev", 0o755, MTIME, entries)}
    (dev / "zero").touch()  # a file no mount covers: a device node in a sandbox without a user namespace, say
    assert tmpfs_copies.survey(root, mountinfo(root, *lines), ["/dev"], OWNER) == {}


def test_only_a_tmpfs_mounted_whole_and_alone_is_copied(root: Path) -> None:
    assert survey(root, (89, 87, "/", "/dev/shm", "ext4")) == {}
    assert survey(root, (89, 87, "/sub", "/dev/shm", "tmpfs")) == {}  # a bind of a part of one
    assert survey(root, SHM, (90, 87, "/", "/dev/shm", "tmpfs")) == {}  # mounted over: not what the sandbox sees
    assert survey(root) == {}  # not mounted at all


def test_a_root_owned_by_another_than_the_sandboxs_root_is_left_to_criu(root: Path) -> None:
    assert survey(root, SHM, owner=(OWNER[0] + 1, OWNER[1])) == {}
    assert survey(root, SHM, owner=(OWNER[0], OWNER[1] + 1)) == {}


def test_a_directory_not_the_mounts_root_is_left_to_criu(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tmpfs_copies, "_TMPFS_ROOT_INO", 1)  # the real rule: a tmpfs's root is inode 1
    assert survey(root, SHM) == {}
    other = mountinfo(root, SHM).replace(f"{os.major(os.stat(root).st_dev)}:", "4095:")  # another device
    assert tmpfs_copies.survey(root, other, ["/dev/shm"], OWNER) == {}


def test_no_link_is_followed_to_reach_the_mount_point(root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (root / "dev" / "shm").rename(elsewhere)  # same inode, now reached through a link
    (root / "dev" / "shm").symlink_to(elsewhere)
    assert survey(root, SHM) == {}
    (root / "dev" / "shm").unlink()
    (root / "dev").rename(tmp_path / "dev2")
    (root / "dev").symlink_to(tmp_path / "dev2")  # a link above it
    assert survey(root, SHM) == {}


def cgroup_root(root: Path, names: list[str]) -> list[tuple[int, int, str, str, str]]:
    cg = root / "sys" / "fs" / "cgroup"
    cg.mkdir(parents=True)
    for name in names:
        (cg / name).mkdir()
    os.chmod(cg, 0o555)
    os.utime(cg, ns=(MTIME, MTIME))
    return [(92, 91, "/", "/sys/fs/cgroup", "tmpfs")] + [
        (100 + i, 92, "/", f"/sys/fs/cgroup/{n}", "cgroup") for i, n in enumerate(names)
    ]


def test_runcs_cgroup_tmpfs_is_a_copy_of_its_covered_directories(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = cgroup_root(root, ["pids", "cpu,cpuacct", "memory"])
    monkeypatch.setattr(tmpfs_copies, "_TMPFS_ROOT_INO", os.stat(root / "sys/fs/cgroup").st_ino)
    got = tmpfs_copies.survey(root, mountinfo(root, *lines), ["/sys/fs/cgroup"], OWNER)
    want = TmpfsCopy("/sys/fs/cgroup", 0o555, MTIME, (D("cpu,cpuacct"), D("memory"), D("pids")))
    assert got == {"/sys/fs/cgroup": want}


@pytest.mark.parametrize("extra", ["uncovered-dir", "file", "link"])
def test_a_cgroup_tmpfs_with_more_than_runcs_is_left_to_criu(
    root: Path, monkeypatch: pytest.MonkeyPatch, extra: str
) -> None:
    lines = cgroup_root(root, ["pids", "memory"])
    cg = root / "sys" / "fs" / "cgroup"
    os.chmod(cg, 0o755)
    if extra == "uncovered-dir":
        (cg / "mine").mkdir()
    elif extra == "file":
        (cg / "mine").touch()
    else:
        (cg / "pids").rmdir()
        (cg / "pids").symlink_to("memory")  # a link where a covered directory was
    monkeypatch.setattr(tmpfs_copies, "_TMPFS_ROOT_INO", os.stat(cg).st_ino)
    assert tmpfs_copies.survey(root, mountinfo(root, *lines), ["/sys/fs/cgroup"], OWNER) == {}


def test_the_plan_names_each_copy_to_criu(root: Path) -> None:
    info = mountinfo(root, SHM)
    cfg = state()["config"]
    cfg["mounts"].append({"device": "tmpfs", "source": "shm", "destination": "/dev/shm"})
    cfg["uid_mappings"] = cfg["gid_mappings"] = [{"container_id": 0, "host_id": OWNER[0], "size": 65536}]
    if OWNER[0] != OWNER[1]:
        cfg["gid_mappings"] = [{"container_id": 0, "host_id": OWNER[1], "size": 65536}]
    st = state()
    st["config"] = cfg
    p = plan(st, root_of_init=root, mountinfo=info)
    assert f"mnt[/dev/shm]:{TmpfsCopy('/dev/shm', 0o1777, MTIME).key}" in p.externals
    # A tmpfs the spec does not mount there (mountinfo says so, the state does not) is not looked at.
    assert not any("crab-tmpfs" in e for e in plan(state(), root_of_init=root, mountinfo=info).externals)


def test_the_root_owner_is_read_from_runcs_maps() -> None:
    assert tmpfs_copies.root_owner({}) == (0, 0)
    maps = {
        "uid_mappings": [{"container_id": 1, "host_id": 5, "size": 1}, {"container_id": 0, "host_id": 100, "size": 1}],
        "gid_mappings": [{"container_id": 0, "host_id": 200, "size": 1}],
    }
    assert tmpfs_copies.root_owner(maps) == (100, 200)


# --- the restore's side ----------------------------------------------------------------------------------

CGROUP = TmpfsCopy("/sys/fs/cgroup", 0o555, MTIME, (D("cpu"), D("pids")))
SHM_COPY = TmpfsCopy("/dev/shm", 0o1777, MTIME)


def images(d: Path, *entries: bytes) -> Path:
    d.mkdir()
    (d / "mountpoints-13.img").write_bytes(image(pbimage.MNTS_MAGIC, mount(145, 81, "/", 17), *entries))
    return d


def test_a_restore_wants_the_copies_its_images_name(tmp_path: Path) -> None:
    d = images(
        tmp_path / "i",
        mount(89, 145, "/dev/shm", 5, flags=0xE, key=SHM_COPY.key),
        mount(92, 145, "/sys/fs/cgroup", 5, key=CGROUP.key),
        mount(93, 145, "/etc", 5, key=TmpfsCopy("/tmp", 0o1777, 1).key),  # not its own point: not wanted
        mount(94, 145, "/run", 5, key="crab-tmpfs:/run:x:1:"),  # malformed: the posture check refuses it
        mount(95, 145, "/proc/acpi", 5, flags=1, key="crab-masked-dir"),
    )
    got = tmpfs_copies.wanted(d)
    assert got == [
        tmpfs_copies.Wanted("/dev/shm", SHM_COPY, 0xE),
        tmpfs_copies.Wanted("/sys/fs/cgroup", CGROUP, 0),
    ]
    assert tmpfs_copies.wanted(tmp_path / "absent") == []


def test_each_copy_is_mounted_as_runc_mounted_its_point() -> None:
    spec = bundle.ContainerSpec(id="c1", netns=Path("/run/netns/x"), init_binary=Path("/opt/crab-init"))
    mounts = bundle.config(spec, Path("/b/c1"), {"/etc/hostname": Path("/dev/null")}, etc_writable=True)["mounts"]
    assert tmpfs_copies.source_and_data("/dev/shm", mounts) == ("shm", "mode=1777,size=65536k")
    assert tmpfs_copies.source_and_data("/sys/fs/cgroup", mounts) == ("tmpfs", "mode=755")
    with pytest.raises(ContainerRuntimeError, match="does not mount"):
        tmpfs_copies.source_and_data("/tmp", mounts)


def test_criu_is_told_one_source_per_key(tmp_path: Path) -> None:
    want = [tmpfs_copies.Wanted("/dev/shm", SHM_COPY, 0), tmpfs_copies.Wanted("/sys/fs/cgroup", CGROUP, 0)]
    assert tmpfs_copies.conf_lines(tmp_path, want).decode().splitlines() == [
        f"external mnt[{SHM_COPY.key}]:{tmp_path}/tmpfs-0",
        f"external mnt[{CGROUP.key}]:{tmp_path}/tmpfs-1",
    ]
    assert tmpfs_copies.conf_lines(tmp_path, []) == b""


def test_the_clones_of_one_fork_read_the_mount_table_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = images(tmp_path / "i", mount(89, 145, "/dev/shm", 5, key=SHM_COPY.key))
    reads: list[list[str]] = []
    real = tmpfs_copies._read_wanted

    def counted(dirfd: int, names: list[str]) -> list[tmpfs_copies.Wanted]:
        reads.append(names)
        return real(dirfd, names)

    monkeypatch.setattr(tmpfs_copies, "_read_wanted", counted)
    first = tmpfs_copies.wanted(d)
    assert [tmpfs_copies.wanted(d) for _ in range(7)] == [first] * 7 and len(reads) == 1
    # Other images (another checkpoint's, written where these were): read again.
    (d / "mountpoints-13.img").write_bytes(image(pbimage.MNTS_MAGIC, mount(145, 81, "/", 17)))
    assert tmpfs_copies.wanted(d) == [] and len(reads) == 2
