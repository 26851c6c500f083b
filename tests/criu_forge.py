"""Synthetic CRIU images for tests: a tiny protobuf encoder and a normal sandbox's dump, to alter.

Field numbers as in ``crabd/backends/criu/posture.py``'s docstring.  The
images describe two tasks (pids 1 and 9) of a sandbox with
:data:`NORMAL_POSTURE`; :func:`write_images` takes overrides for the parts a
test wants forged.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from crabd.backends.criu import pbimage
from crabd.backends.criu.posture import IDS_MAGIC
from crabd.backends.criu.seccomp_bpf import AUDIT_ARCH_I386 as I386
from crabd.backends.criu.seccomp_bpf import AUDIT_ARCH_X86_64 as X86_64
from crabd.backends.criu.seccomp_bpf import SYSCALLS
from crabd.backends.procdump import Posture, capability_mask

SANDBOX_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "SETGID", "SETUID", "NET_BIND_SERVICE")
REFUSED = frozenset({"unshare", "setns", "mount", "open_by_handle_at", "bpf"})
NORMAL_POSTURE = Posture(
    capabilities=capability_mask(SANDBOX_CAPS),
    refused_syscalls=REFUSED,
    namespaces=frozenset({"pid", "net", "ipc", "uts", "mnt"}),
    binds=frozenset({"/.crab/init", "/etc/hostname"}),
    mask_binds=frozenset({"/dev/null"}),
    readonly=frozenset({"/sys", "/proc/sys", "/.crab/init"}),
)
#: CRIU's own namespace ids at dump time (inventory root_ids) and the sandbox's.
HOST_IDS = {"pid": 1, "net": 2, "ipc": 3, "uts": 4, "mnt": 6, "user": 7, "cgroup": 8, "time": 5}
SANDBOX_IDS = {"pid": 9, "net": 10, "ipc": 11, "uts": 12, "mnt": 13, "user": 7, "cgroup": 8, "time": 5}
_NS = {"pid": 5, "net": 6, "ipc": 7, "uts": 8, "mnt": 9, "user": 10, "cgroup": 11, "time": 12}


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field(num: int, value: int | bytes | str) -> bytes:
    """One field: an int as a varint, bytes/str as length-delimited."""
    if isinstance(value, int):
        return varint(num << 3) + varint(value)
    raw = value.encode() if isinstance(value, str) else value
    return varint(num << 3 | 2) + varint(len(raw)) + raw


def msg(*fields: tuple[int, Any]) -> bytes:
    """A message from (number, value) pairs; a list value repeats the field."""
    out = b""
    for num, value in fields:
        for v in value if isinstance(value, list) else [value]:
            out += field(num, v)
    return out


def image(magic: int, *records: bytes, common: bool = True) -> bytes:
    head = struct.pack("<II", pbimage.IMG_COMMON_MAGIC, magic) if common else struct.pack("<I", magic)
    return head + b"".join(struct.pack("<I", len(r)) + r for r in records)


def words(mask: int) -> list[int]:
    return [mask & 0xFFFFFFFF, mask >> 32]


def ids(kinds: dict[str, int]) -> bytes:
    return msg((1, 2), (2, 2), (3, 2), (4, 2), *[(_NS[k], v) for k, v in kinds.items()])


def creds(caps: int, *, nnp: int = 1, sets: dict[int, int] | None = None) -> bytes:
    capsets = {9: 0, 10: caps, 11: caps, 12: caps, 19: 0} | (sets or {})
    return msg(*[(n, 0) for n in range(1, 9)], *[(n, words(v)) for n, v in capsets.items()], (13, 0), (18, nnp))


def core(creds_msg: bytes | None, *, seccomp: int | None = 2, index: int | None = 0, tc_extra: bytes = b"") -> bytes:
    thread: list[tuple[int, Any]] = [(1, 0), (2, 0)]
    if creds_msg is not None:
        thread.append((10, creds_msg))
    if seccomp is not None:
        thread.append((11, seccomp))
    if index is not None:
        thread.append((12, index))
    tc = msg((1, 1), (2, 0), (3, 0), (4, 0), (5, 0), (6, "sh")) + tc_extra
    return msg((1, 1), (3, tc), (5, msg(*thread)))


def mount(
    mnt: int, parent: int, point: str, fstype: int, *, flags: int = 0, root: str = "/", key: str = "", dev: int = 0
) -> bytes:
    """A MntEntry; ``dev`` (the device) defaults to one of its own (1000 + its id)."""
    fields: list[tuple[int, Any]] = [(1, fstype), (2, mnt), (3, dev or 1000 + mnt), (4, parent), (5, flags)]
    fields += [(6, root), (7, point)]
    fields += [(8, "none"), (9, "")]
    if key:
        fields.append((18, key))
    return msg(*fields)


NORMAL_MOUNTS = [
    mount(145, 81, "/", 17),
    mount(147, 145, "/proc", 1),
    mount(151, 145, "/sys", 2, flags=1),
    mount(109, 147, "/proc/sys", 1, flags=1, root="/sys", dev=1147),
    mount(112, 147, "/proc/keys", 5, root="/null", key="/dev/null"),
    mount(192, 145, "/.crab/init", 0, flags=1, root="/host/crab-init", key="/.crab/init"),
    mount(196, 145, "/etc/hostname", 0, root="/var/lib/docker/x/hostname", key="/etc/hostname"),
    mount(176, 151, "/sys/fs/cgroup/memory", 12, flags=1),
]


TASK_1 = msg((1, 1), (2, 0), (3, 1), (4, 1), (5, [1]))
TASK_9 = msg((1, 9), (2, 1), (3, 1), (4, 1), (5, [9]))


def bpf(*insns: tuple[int, int, int, int]) -> bytes:
    return b"".join(struct.pack("<HBBI", *i) for i in insns)


ALLOW, ERRNO_EPERM = 0x7FFF0000, 0x00050001


def deny_filter(names: frozenset[str] = REFUSED, archs: tuple[int, ...] = (X86_64, I386)) -> bytes:
    """A filter like libseccomp's: per architecture, load the syscall number, one JEQ per refused call; else allow."""
    prog: list[tuple[int, int, int, int]] = []
    for arch in archs:
        body = [(0x20, 0, 0, 0)]
        for name in sorted(names):
            body += [(0x15, 0, 1, SYSCALLS[arch][name]), (0x06, 0, 0, ERRNO_EPERM)]
        # Load the arch; if it is not this one, jump past this arch's block.
        prog += [(0x20, 0, 0, 4), (0x15, 0, len(body), arch), *body]
    return bpf(*prog, (0x06, 0, 0, ALLOW))


ALLOW_ALL = bpf((0x06, 0, 0, ALLOW))


def filters(*programs: tuple[bytes, int | None]) -> bytes:
    """seccomp.img with these (program, prev) filters."""
    return image(
        pbimage.SECCOMP_MAGIC,
        msg((1, [msg((1, p), *([(2, prev)] if prev is not None else [])) for p, prev in programs])),
    )


def write_images(d: Path, **over: Any) -> Path:
    """A normal two-task dump of a NORMAL_POSTURE sandbox in ``d``; ``over`` replaces a file's bytes by name."""
    caps = NORMAL_POSTURE.capabilities
    files = {
        "inventory.img": image(pbimage.INVENTORY_MAGIC, msg((1, 2), (3, ids(HOST_IDS))), common=False),
        "pstree.img": image(pbimage.PSTREE_MAGIC, TASK_1, TASK_9),
        "ids-1.img": image(IDS_MAGIC, ids(SANDBOX_IDS)),
        "ids-9.img": image(IDS_MAGIC, ids(SANDBOX_IDS)),
        "core-1.img": image(pbimage.CORE_MAGIC, core(creds(caps), index=0)),
        "core-9.img": image(pbimage.CORE_MAGIC, core(creds(caps), index=1)),
        "seccomp.img": filters((deny_filter(), None), (deny_filter(), None)),
        "mountpoints-13.img": image(pbimage.MNTS_MAGIC, *NORMAL_MOUNTS),
    }
    d.mkdir(parents=True, exist_ok=True)
    for name, data in (files | over).items():
        if data is not None:
            (d / name).write_bytes(data)
    return d
