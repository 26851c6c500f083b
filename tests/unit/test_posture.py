"""The posture check refuses forged process images before CRIU sees them (backends/criu/posture.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct
import tracemalloc
from pathlib import Path

import pytest

from crabd.backends.criu import pbimage
from crabd.backends.criu.posture import IDS_MAGIC, check
from crabd.backends.criu.seccomp_bpf import AUDIT_ARCH_X86_64 as X86_64
from crabd.backends.procdump import MASKED_DIR_KEY, IdMap, capability_mask
from crabd.backends.runc import bundle
from crabd.backends.runc.posture import posture_of
from crabd.backends.tmpfs_key import CopyEntry, TmpfsCopy
from crabd.errors import CriuImageInvalid, PostureViolation
from tests.criu_forge import (
    ALLOW,
    ALLOW_ALL,
    ERRNO_EPERM,
    HOST_IDS,
    NORMAL_MOUNTS,
    NORMAL_POSTURE,
    REFUSED,
    SANDBOX_IDS,
    TASK_1,
    bpf,
    core,
    creds,
    deny_filter,
    filters,
    ids,
    image,
    mount,
    msg,
    varint,
    write_images,
)

ALL_CAPS = (1 << 41) - 1
CAPS = NORMAL_POSTURE.capabilities


def refused(d: Path, posture: object = NORMAL_POSTURE) -> PostureViolation:
    with pytest.raises(PostureViolation) as info:
        check(d, posture, "ck-1")  # type: ignore[arg-type]
    err = info.value
    assert err.checkpoint == "ck-1" and err.found and err.expected
    return err


def test_a_normal_image_is_accepted(tmp_path: Path) -> None:
    check(write_images(tmp_path / "i"), NORMAL_POSTURE, "ck-1")


@pytest.mark.parametrize("capset", [9, 10, 11, 12, 19], ids=["inh", "prm", "eff", "bnd", "amb"])
def test_a_capability_beyond_the_bounding_set_is_refused(tmp_path: Path, capset: int) -> None:
    forged = image(pbimage.CORE_MAGIC, core(creds(CAPS, sets={capset: ALL_CAPS}), index=1))
    err = refused(write_images(tmp_path / "i", **{"core-9.img": forged}))
    assert err.pid == 9 and "capability" in err.what and "0x1ffffffffff" in err.found
    assert "0x80004fb" in err.expected  # the sandbox's own set, as /proc/PID/status shows it


def test_one_extra_capability_is_enough_to_refuse(tmp_path: Path) -> None:
    more = CAPS | capability_mask(["DAC_READ_SEARCH"])
    forged = image(pbimage.CORE_MAGIC, core(creds(CAPS, sets={11: more}), index=0))
    err = refused(write_images(tmp_path / "i", **{"core-1.img": forged}))
    assert err.pid == 1 and "DAC_READ_SEARCH" in err.found


def test_cleared_no_new_privs_is_refused(tmp_path: Path) -> None:
    forged = image(pbimage.CORE_MAGIC, core(creds(CAPS, nnp=0), index=1))
    err = refused(write_images(tmp_path / "i", **{"core-9.img": forged}))
    assert err.what == "no_new_privs" and err.found == "cleared"


@pytest.mark.parametrize("mode", [0, 1, None])
def test_seccomp_other_than_the_filter_is_refused(tmp_path: Path, mode: int | None) -> None:
    forged = image(pbimage.CORE_MAGIC, core(creds(CAPS), seccomp=mode, index=1))
    assert refused(write_images(tmp_path / "i", **{"core-9.img": forged})).what == "seccomp mode"


@pytest.mark.parametrize("index", [None, 2, 99])
def test_a_missing_seccomp_filter_is_refused(tmp_path: Path, index: int | None) -> None:
    forged = image(pbimage.CORE_MAGIC, core(creds(CAPS), index=index))
    assert refused(write_images(tmp_path / "i", **{"core-9.img": forged})).what == "seccomp filter"


def test_a_filter_chain_that_loops_is_refused(tmp_path: Path) -> None:
    loop = filters((deny_filter(), 1), (deny_filter(), 0))
    assert refused(write_images(tmp_path / "i", **{"seccomp.img": loop})).what == "seccomp filter"


def test_a_filter_swapped_for_one_that_allows_everything_is_refused(tmp_path: Path) -> None:
    err = refused(write_images(tmp_path / "i", **{"seccomp.img": filters((ALLOW_ALL, None), (deny_filter(), None))}))
    assert err.pid == 1 and err.what == "seccomp filter" and err.found.startswith("one allowing ")


def test_a_filter_refusing_less_than_the_sandboxs_is_refused(tmp_path: Path) -> None:
    weaker = deny_filter(REFUSED - {"unshare"})
    err = refused(write_images(tmp_path / "i", **{"seccomp.img": filters((weaker, None), (weaker, None))}))
    assert err.found == "one allowing unshare (x86_64)"


def test_a_filter_that_forgets_the_i386_entry_is_refused(tmp_path: Path) -> None:
    # int 0x80 reaches the kernel as i386 (IA32 emulation): unshare is 310 there.
    x86_only = deny_filter(archs=(X86_64,))
    err = refused(write_images(tmp_path / "i", **{"seccomp.img": filters((x86_only, None), (x86_only, None))}))
    assert err.found.endswith("(i386)")


def test_filters_a_process_stacked_on_the_sandboxs_are_accepted(tmp_path: Path) -> None:
    # seccomp() is allowed in a sandbox: a program may add filters; the chain still refuses what the base refuses.
    own = bpf((0x20, 0, 0, 4), (0x15, 1, 0, 0xC000003E), (0x06, 0, 0, 0), (0x06, 0, 0, ALLOW))
    stacked = filters((deny_filter(), None), (own, 0), (ALLOW_ALL, 1))
    core9 = image(pbimage.CORE_MAGIC, core(creds(CAPS), index=2))
    check(write_images(tmp_path / "i", **{"seccomp.img": stacked, "core-9.img": core9}), NORMAL_POSTURE, "ck-1")


def test_a_filter_crab_cannot_interpret_does_not_count_as_refusing(tmp_path: Path) -> None:
    odd = bpf((0x20, 0, 0, 0), (0xFF, 0, 0, 0), (0x06, 0, 0, 0))  # an unknown opcode before "kill"
    err = refused(write_images(tmp_path / "i", **{"seccomp.img": filters((odd, None), (odd, None))}))
    assert err.what == "seccomp filter"


def test_old_per_task_seccomp_fields_are_refused(tmp_path: Path) -> None:
    # CRIU copies them over the per-thread mode: a disabled one there would win.
    forged = image(pbimage.CORE_MAGIC, core(creds(CAPS), index=1, tc_extra=msg((11, 0))))
    with pytest.raises(CriuImageInvalid, match="old per-task seccomp"):
        check(write_images(tmp_path / "i", **{"core-9.img": forged}), NORMAL_POSTURE, "ck-1")


def test_missing_thread_credentials_are_refused(tmp_path: Path) -> None:
    # CRIU would then read creds-PID.img, an old format crab does not judge.
    forged = image(pbimage.CORE_MAGIC, core(None, index=1))
    with pytest.raises(CriuImageInvalid, match="credentials"):
        check(write_images(tmp_path / "i", **{"core-9.img": forged}), NORMAL_POSTURE, "ck-1")


def test_a_root_task_in_the_hosts_namespaces_is_refused(tmp_path: Path) -> None:
    host_pid = image(IDS_MAGIC, ids(SANDBOX_IDS | {"pid": HOST_IDS["pid"]}))
    err = refused(write_images(tmp_path / "i", **{"ids-1.img": host_pid, "ids-9.img": host_pid}))
    assert err.what == "set of own namespaces" and "pid" not in err.found.split(",")


def test_the_time_namespace_criu_makes_at_a_restore_is_accepted(tmp_path: Path) -> None:
    """A restored sandbox's next dump: CRIU gave it a time namespace of its own (clock offsets, no privilege)."""
    restored = image(IDS_MAGIC, ids(SANDBOX_IDS | {"time": 99}))
    check(write_images(tmp_path / "i", **{"ids-1.img": restored, "ids-9.img": restored}), NORMAL_POSTURE, "ck-1")
    # Only that one: a user namespace beside it is still refused.
    both = image(IDS_MAGIC, ids(SANDBOX_IDS | {"time": 99, "user": 77}))
    err = refused(write_images(tmp_path / "j", **{"ids-1.img": both, "ids-9.img": both}))
    assert "user" in err.found


def test_an_extra_user_namespace_is_refused(tmp_path: Path) -> None:
    own_user = image(IDS_MAGIC, ids(SANDBOX_IDS | {"user": 77}))
    err = refused(write_images(tmp_path / "i", **{"ids-1.img": own_user, "ids-9.img": own_user}))
    assert "user" in err.found and "user" not in err.expected


def test_a_task_in_a_namespace_of_its_own_is_refused(tmp_path: Path) -> None:
    nested = image(IDS_MAGIC, ids(SANDBOX_IDS | {"net": 40}))
    err = refused(write_images(tmp_path / "i", **{"ids-9.img": nested}))
    assert err.pid == 9 and "net" in err.found


def test_a_user_namespace_map_other_than_the_postures_is_refused(tmp_path: Path) -> None:
    posture = dataclasses.replace(
        NORMAL_POSTURE,
        namespaces=NORMAL_POSTURE.namespaces | {"user"},
        uid_map=(IdMap(0, 100000, 65536),),
        gid_map=(IdMap(0, 100000, 65536),),
    )
    own_user = image(IDS_MAGIC, ids(SANDBOX_IDS | {"user": 77}))

    def userns(first_host: int, count: int = 65536) -> bytes:
        extent = msg((1, 0), (2, first_host), (3, count))
        return image(pbimage.USERNS_MAGIC, msg((1, [extent]), (2, [extent])))

    images = {"ids-1.img": own_user, "ids-9.img": own_user}
    check(write_images(tmp_path / "ok", **images, **{"userns-77.img": userns(100000)}), posture, "ck-1")
    err = refused(write_images(tmp_path / "root", **images, **{"userns-77.img": userns(0)}), posture)
    assert err.what == "user namespace uid map" and err.found == "0 0 65536"
    # Another host range is the image's old container's: the runtime rewrites it to the new one's.
    check(write_images(tmp_path / "moved", **images, **{"userns-77.img": userns(3 << 24)}), posture, "ck-1")
    # Not its shape: more ids inside than the sandbox was given.
    err = refused(write_images(tmp_path / "wide", **images, **{"userns-77.img": userns(3 << 24, 1 << 31)}), posture)
    assert err.what == "user namespace uid map"


@pytest.mark.parametrize(
    "extra",
    [
        mount(300, 145, "/mnt/host", 0, root="/etc", key="/mnt/host"),  # an external bind the spec lacks
        mount(301, 145, "/mnt/host", 16, root="/"),  # a file system CRIU would mount itself
        mount(302, 145, "/mnt/root", 17, root="/"),  # a second overlay
        # crab-init's bind again, elsewhere and writable: the host's binary, writable from inside.
        mount(303, 145, "/mnt/init", 0, root="/host/crab-init", key="/.crab/init"),
        # A "tmpfs" on the root's device: CRIU would bind it from the root, ".." and all.
        mount(304, 145, "/mnt/up", 5, root="/x", dev=1145),
        mount(305, 145, "/mnt/up", 5, root="/../../etc"),  # not a plain path
        mount(306, 145, "/mnt/init2", 5, root="/host/crab-init", dev=1192),  # on a host bind's device
        mount(307, 145, "/mnt/sys", 2),  # a writable sysfs (uevent_helper)
        mount(308, 145, "/mnt/proc", 1, flags=1),  # a second full proc
        mount(309, 147, "/mnt/core", 1, root="/sys/kernel", dev=1147),  # a writable piece of proc
        mount(310, 145, "/mnt/cg", 12),  # a writable cgroup (release_agent)
    ],
    ids=["external", "auto", "overlay", "init-elsewhere", "root-dev", "dotdot", "host-dev", "sysfs", "proc2",
         "proc-rw", "cgroup-rw"],
)  # fmt: skip
def test_a_mount_beyond_the_spec_is_refused(tmp_path: Path, extra: bytes) -> None:
    forged = image(pbimage.MNTS_MAGIC, *NORMAL_MOUNTS, extra)
    err = refused(write_images(tmp_path / "i", **{"mountpoints-13.img": forged}))
    assert err.what.startswith("mount at /mnt/")


MASKED = dataclasses.replace(NORMAL_POSTURE, mask_dirs=frozenset({"/proc/acpi", "/sys/firmware"}))


def test_crabs_masked_directories_are_accepted_read_only_where_the_spec_masks(tmp_path: Path) -> None:
    """A restore maps MASKED_DIR_KEY to crab's empty read-only tmpfs (runc/masks.py): only there, only ro."""
    acpi = mount(310, 147, "/proc/acpi", 5, flags=1, key=MASKED_DIR_KEY)
    firmware = mount(311, 151, "/sys/firmware", 5, flags=1, key=MASKED_DIR_KEY)
    check(
        write_images(
            tmp_path / "ok", **{"mountpoints-13.img": image(pbimage.MNTS_MAGIC, *NORMAL_MOUNTS, acpi, firmware)}
        ),
        MASKED,
        "ck-1",
    )
    # Elsewhere: an empty directory over /etc would hide the sandbox's own files; the spec does not mask it.
    elsewhere = mount(312, 145, "/etc", 5, flags=1, key=MASKED_DIR_KEY)
    err = refused(
        write_images(tmp_path / "a", **{"mountpoints-13.img": image(pbimage.MNTS_MAGIC, *NORMAL_MOUNTS, elsewhere)}),
        MASKED,
    )
    assert err.what == "mount at /etc" and "masked-directory" in err.found
    writable = mount(313, 147, "/proc/acpi", 5, flags=0, key=MASKED_DIR_KEY)
    err = refused(
        write_images(tmp_path / "b", **{"mountpoints-13.img": image(pbimage.MNTS_MAGIC, *NORMAL_MOUNTS, writable)}),
        MASKED,
    )
    assert err.what == "mount at /proc/acpi" and err.found == "a writable masked directory"
    # A posture without masked directories (Docker's) accepts the key nowhere.
    err = refused(
        write_images(tmp_path / "c", **{"mountpoints-13.img": image(pbimage.MNTS_MAGIC, *NORMAL_MOUNTS, acpi)})
    )
    assert err.what == "mount at /proc/acpi"


TMPFS = dataclasses.replace(NORMAL_POSTURE, tmpfs_points=frozenset({"/dev", "/dev/shm", "/sys/fs/cgroup"}))


def test_crabs_tmpfs_copies_are_accepted_only_where_the_spec_has_a_tmpfs_and_at_their_own_point(
    tmp_path: Path,
) -> None:
    """A restore maps a TmpfsCopy key to a fresh tmpfs of the sandbox's root (runc/tmpfs_copies.py)."""
    shm = TmpfsCopy("/dev/shm", 0o1777, 5)
    cgroup = TmpfsCopy("/sys/fs/cgroup", 0o555, 5, (CopyEntry("dir", "memory"),))

    def mounts(*extra: bytes) -> bytes:
        return image(pbimage.MNTS_MAGIC, *NORMAL_MOUNTS, *extra)

    ok = (mount(320, 145, "/dev/shm", 5, flags=0xE, key=shm.key), mount(321, 151, "/sys/fs/cgroup", 5, key=cgroup.key))
    check(write_images(tmp_path / "ok", **{"mountpoints-13.img": mounts(*ok)}), TMPFS, "ck-1")
    # Over /etc: a fresh empty tmpfs would hide the sandbox's own files; the spec has no tmpfs there.
    etc = TmpfsCopy("/etc", 0o755, 5)
    err = refused(
        write_images(tmp_path / "a", **{"mountpoints-13.img": mounts(mount(322, 145, "/etc", 5, key=etc.key))}), TMPFS
    )
    assert err.what == "mount at /etc" and "tmpfs copy" in err.found
    # A key of one point at another: two mounts could share one tmpfs.
    moved = mount(323, 145, "/dev", 5, key=shm.key)
    err = refused(write_images(tmp_path / "b", **{"mountpoints-13.img": mounts(moved)}), TMPFS)
    assert err.what == "mount at /dev" and "for /dev/shm" in err.found
    bad = mount(324, 145, "/dev/shm", 5, key="crab-tmpfs:/dev/shm:1777:5:d=../..")
    err = refused(write_images(tmp_path / "c", **{"mountpoints-13.img": mounts(bad)}), TMPFS)
    assert err.what == "mount at /dev/shm" and "keyed" in err.found
    # A posture without tmpfs points (Docker's) accepts the key nowhere.
    err = refused(write_images(tmp_path / "d", **{"mountpoints-13.img": mounts(ok[0])}))
    assert err.what == "mount at /dev/shm"


def test_a_dropped_read_only_proc_bind_is_refused(tmp_path: Path) -> None:
    # Without its read-only bind, /proc/sys (core_pattern ...) would be writable through /proc.
    mounts = [m for m in NORMAL_MOUNTS if m != NORMAL_MOUNTS[3]]
    err = refused(write_images(tmp_path / "i", **{"mountpoints-13.img": image(pbimage.MNTS_MAGIC, *mounts)}))
    assert err.what == "mount at /proc/sys" and err.found == "absent"


def test_a_read_only_mount_made_writable_is_refused(tmp_path: Path) -> None:
    mounts = [m for m in NORMAL_MOUNTS if m != NORMAL_MOUNTS[3]]
    rw = mount(109, 147, "/proc/sys", 1, flags=0, root="/sys", dev=1147)
    err = refused(write_images(tmp_path / "i", **{"mountpoints-13.img": image(pbimage.MNTS_MAGIC, *mounts, rw)}))
    assert err.what == "mount at /proc/sys" and "writable" in err.found
    # crab-init's bind made writable (the host's binary, from inside): the posture's read-only point.
    mounts = [m for m in NORMAL_MOUNTS if m != NORMAL_MOUNTS[5]]
    rw = mount(192, 145, "/.crab/init", 0, root="/host/crab-init", key="/.crab/init")
    err = refused(write_images(tmp_path / "j", **{"mountpoints-13.img": image(pbimage.MNTS_MAGIC, *mounts, rw)}))
    assert err.what == "mount at /.crab/init" and err.found == "writable"


def test_a_root_mount_of_another_directory_is_refused(tmp_path: Path) -> None:
    mounts = [mount(145, 81, "/", 17, root="/etc"), *NORMAL_MOUNTS[1:]]
    err = refused(write_images(tmp_path / "i", **{"mountpoints-13.img": image(pbimage.MNTS_MAGIC, *mounts)}))
    assert err.what == "root mount"


def test_other_threads_without_a_mode_share_the_leaders_filter(tmp_path: Path) -> None:
    # As CRIU dumps a multithreaded process: the leader has mode and filter, its other threads neither.
    thread = msg((5, msg((1, 0), (2, 0), (10, creds(CAPS)))))
    tree = image(pbimage.PSTREE_MAGIC, TASK_1, msg((1, 9), (2, 1), (3, 1), (4, 1), (5, [9, 10])))
    images = {"pstree.img": tree, "core-10.img": image(pbimage.CORE_MAGIC, thread)}
    check(write_images(tmp_path / "ok", **images), NORMAL_POSTURE, "ck-1")
    # But not the leader, nor a thread whose own credentials overreach.
    bad = msg((5, msg((1, 0), (2, 0), (10, creds(ALL_CAPS)))))
    err = refused(write_images(tmp_path / "caps", **images | {"core-10.img": image(pbimage.CORE_MAGIC, bad)}))
    assert err.pid == 10
    leader = image(pbimage.CORE_MAGIC, core(creds(CAPS), seccomp=None, index=None))
    assert refused(write_images(tmp_path / "leader", **images | {"core-9.img": leader})).what == "seccomp mode"


def test_a_zombie_is_not_judged_by_credentials(tmp_path: Path) -> None:
    dead = msg((1, 1), (3, msg((1, 2), (2, 0), (3, 0), (4, 0), (5, 0), (6, "z"))))
    check(write_images(tmp_path / "i", **{"core-9.img": image(pbimage.CORE_MAGIC, dead)}), NORMAL_POSTURE, "ck-1")
    # A zombie's thread list leaves it out; a live task that does so is refused.
    tree = image(pbimage.PSTREE_MAGIC, TASK_1, msg((1, 9), (2, 1), (3, 1), (4, 1), (5, [0])))
    zombie = {"core-9.img": image(pbimage.CORE_MAGIC, dead), "pstree.img": tree}
    check(write_images(tmp_path / "j", **zombie), NORMAL_POSTURE, "ck-1")
    (tmp_path / "j" / "ids-9.img").unlink()  # as CRIU dumps a zombie: no ids
    check(tmp_path / "j", NORMAL_POSTURE, "ck-1")
    _bad(write_images(tmp_path / "k", **{"pstree.img": tree}))


# --- hostile encodings --------------------------------------------------------------


def _bad(d: Path) -> CriuImageInvalid:
    with pytest.raises(CriuImageInvalid) as info:
        check(d, NORMAL_POSTURE, "ck-1")
    return info.value


@pytest.mark.parametrize(
    "name,data",
    [
        ("core-9.img", b""),
        ("core-9.img", struct.pack("<II", pbimage.IMG_COMMON_MAGIC, pbimage.PSTREE_MAGIC)),  # wrong magic
        ("core-9.img", struct.pack("<III", pbimage.IMG_COMMON_MAGIC, pbimage.CORE_MAGIC, 1 << 30)),  # runs past
        ("core-9.img", image(pbimage.CORE_MAGIC, b"\xff" * 11)),  # a varint of 11 bytes
        ("core-9.img", image(pbimage.CORE_MAGIC, b"\x0b")),  # a group (wire type 3)
        ("core-9.img", image(pbimage.CORE_MAGIC, core(creds(CAPS), index=1) * 2)),  # singular fields twice
        ("core-9.img", image(pbimage.CORE_MAGIC, core(creds(CAPS), index=1), core(creds(CAPS), index=1))),
        ("pstree.img", image(pbimage.PSTREE_MAGIC, TASK_1, b"\x08")),  # truncated varint
        ("pstree.img", image(pbimage.PSTREE_MAGIC)),  # no tasks
        ("pstree.img", image(pbimage.PSTREE_MAGIC, TASK_1, msg((1, 9), (2, 1), (5, [10])))),  # leader not a thread
        ("core-9.img", image(pbimage.CORE_MAGIC, msg((5, msg((1, 0), (2, 0), (10, creds(CAPS))))))),  # no task part
        ("inventory.img", image(pbimage.INVENTORY_MAGIC, msg((1, 2)), common=False)),  # no root ids
        ("ids-9.img", None),  # missing for a live task
        ("ids-1.img", None),  # missing for the root task
    ],
)
def test_malformed_images_are_refused(tmp_path: Path, name: str, data: bytes | None) -> None:
    d = write_images(tmp_path / "i")
    if data is None:
        (d / name).unlink()
    else:
        (d / name).write_bytes(data)
    _bad(d)


def test_a_uint32_above_32_bits_is_refused_not_truncated(tmp_path: Path) -> None:
    # protobuf-c would keep the low 32 bits: 1 << 32 | 1 would read as no_new_privs = 1 there and
    # as a large number here; refusing keeps the two readers from disagreeing.
    forged = image(pbimage.CORE_MAGIC, core(creds(CAPS, nnp=(1 << 32) | 1), index=1))
    _bad(write_images(tmp_path / "i", **{"core-9.img": forged}))


def test_a_link_in_place_of_an_image_is_refused(tmp_path: Path) -> None:
    d = write_images(tmp_path / "i")
    (d / "core-9.img").unlink()
    os.symlink("/etc/passwd", d / "core-9.img")
    _bad(d)


def test_huge_inputs_are_refused_without_big_allocations(tmp_path: Path) -> None:
    d = write_images(tmp_path / "i")
    with open(d / "core-9.img", "wb") as f:  # sparse: 1 GiB on paper
        f.truncate(1 << 30)
    # A pstree whose one record claims 4 GiB, and a task claiming 2**32 threads in a few bytes.
    tracemalloc.start()
    try:
        _bad(d)
        huge_len = struct.pack("<III", pbimage.IMG_COMMON_MAGIC, pbimage.PSTREE_MAGIC, 0xFFFFFFFF)
        (d / "pstree.img").write_bytes(huge_len)
        _bad(d)
        many = msg((1, 1)) + varint(5 << 3 | 2) + varint(0xFFFFFFFF)
        (d / "pstree.img").write_bytes(image(pbimage.PSTREE_MAGIC, many))
        _bad(d)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_many_tiny_fields_are_bounded(tmp_path: Path) -> None:
    d = write_images(tmp_path / "i")
    (d / "pstree.img").write_bytes(image(pbimage.PSTREE_MAGIC, msg((1, 1)) + b"\x30\x00" * (pbimage.MAX_FIELDS + 1)))
    assert "fields" in _bad(d).message


# --- where the posture comes from ---------------------------------------------------------


def test_the_runc_posture_is_read_from_the_bundles_own_config() -> None:
    spec = bundle.ContainerSpec(id="c1", netns=Path("/run/netns/x"), init_binary=Path("/opt/crab-init"))
    cfg = bundle.config(spec, Path("/b/c1"), {"/etc/hostname": Path("/dev/null")}, etc_writable=True)
    p = posture_of(cfg)
    assert p.capabilities == 0x80004FB  # what /proc/PID/status shows in a normal sandbox
    assert p.no_new_privs and p.seccomp_filter
    assert {"unshare", "setns", "mount", "open_by_handle_at", "clone3"} <= p.refused_syscalls
    assert p.namespaces == {"pid", "ipc", "uts", "mnt", "cgroup", "net"}
    assert {"/.crab/init", "/etc/hostname"} <= p.binds and p.mask_binds == {"/dev/null"}
    assert {"/proc/acpi", "/sys/firmware"} <= p.mask_dirs and "/proc" not in p.mask_dirs
    assert {"/sys", "/proc/sys", "/.crab/init"} <= p.readonly and "/etc/hostname" not in p.readonly
    assert p.tmpfs_points == {"/dev", "/dev/shm", "/sys/fs/cgroup"}  # runc's tmpfs mounts, its cgroup tmpfs
    # A user namespace added to the config is expected in the images, with its maps.
    cfg["linux"]["namespaces"].append({"type": "user"})
    cfg["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
    assert posture_of(cfg).namespaces >= {"user"} and posture_of(cfg).uid_map == (IdMap(0, 100000, 65536),)
    # There a process may not mknod: runc binds the device nodes from the host's, each at its own path.
    assert "/dev/urandom" not in p.binds and {"/dev/urandom", "/dev/tty", "/dev/null"} <= posture_of(cfg).binds


def test_random_damage_gives_a_crab_error_or_a_pass_never_a_crash(tmp_path: Path) -> None:
    """Flip, cut and splice bytes of each image: the check either passes or raises one of its two errors."""
    import random

    rng = random.Random(33)
    base = write_images(tmp_path / "base")
    names = sorted(p.name for p in base.iterdir())
    for i in range(400):
        d = write_images(tmp_path / f"m{i}")
        name = rng.choice(names)
        data = bytearray((d / name).read_bytes())
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            how = rng.randrange(3)
            if how == 0:
                data[at] ^= 1 << rng.randrange(8)
            elif how == 1:
                del data[at:]
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 6)))
            if not data:
                break
        (d / name).write_bytes(bytes(data))
        with contextlib.suppress(PostureViolation, CriuImageInvalid):
            check(d, NORMAL_POSTURE, "ck-1")


@pytest.mark.parametrize("offset", [8, 16, 56], ids=["instruction-pointer", "args0", "args5"])
def test_a_filter_that_refuses_only_for_some_arguments_does_not_count_as_refusing(tmp_path: Path, offset: int) -> None:
    """The caller picks the instruction pointer and the arguments: 'refuse when args[0] == 0' lets mount(x, ...) by."""
    # Load the caller-chosen word; refuse if it is 0, else allow: run with zeros, it would look like a refusal.
    tricky = bpf((0x20, 0, 0, offset), (0x15, 0, 1, 0), (0x06, 0, 0, ERRNO_EPERM), (0x06, 0, 0, ALLOW))
    err = refused(write_images(tmp_path / "i", **{"seccomp.img": filters((tricky, None), (tricky, None))}))
    assert err.what == "seccomp filter" and err.found.startswith("one allowing ")


def test_a_filter_testing_arguments_only_of_calls_it_allows_still_refuses_the_others(tmp_path: Path) -> None:
    """As runc's and Docker's do (clone's flags): the refused calls never reach an argument test."""
    nr_clone, clone_newuser = 56, 0x10000000
    # clone with CLONE_NEWUSER refused here; everything else goes on to the usual deny list.
    head = bpf((0x20, 0, 0, 0), (0x15, 0, 3, nr_clone), (0x20, 0, 0, 16), (0x45, 0, 1, clone_newuser))
    one = head + bpf((0x06, 0, 0, ERRNO_EPERM)) + deny_filter()
    check(write_images(tmp_path / "i", **{"seccomp.img": filters((one, None), (one, None))}), NORMAL_POSTURE, "ck-1")
