"""The process-dump backend interfaces: dump a sandbox's process tree, store the images.

Restoring goes through the sandbox backend (``SandboxBackend.start`` with a
checkpoint), because the container engine must own the restored container;
:class:`ProcessImages` puts the images that start reads in place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from crabd.backends.fsdelta import Outline, ReadBlob
from crabd.models import ImageSource


@dataclass(frozen=True)
class DumpResult:
    images_dir: Path
    seconds: float
    #: Processes in the dump (pids inside the sandbox).
    pids: tuple[int, ...]


class ProcessDumper(Protocol):
    def dump(self, container_id: str, images_dir: Path, work_dir: Path) -> DumpResult:
        """Dump every process of the container into ``images_dir``, leaving them running.

        A container frozen by the caller stays frozen.  Raises CriuError
        (with the log's path and an excerpt), and IncompleteDump when a
        process of the container is missing from the images.
        """
        ...

    def version(self) -> str: ...


@dataclass
class StoredImage:
    manifest: str
    children: dict[str, set[str]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    new_bytes: int = 0
    image_bytes: int = 0
    pages: int = 0
    pages_new: int = 0


#: Where a restore's process images came from: a hot dump directory, or the blob store.


@dataclass(frozen=True)
class WrittenImage:
    """What ``ProcessImages.write`` put into a restore's image dir."""

    nbytes: int
    source: ImageSource


#: Linux capability numbers by name (include/uapi/linux/capability.h), to turn names into masks.
CAPABILITY_BITS = {
    name: bit
    for bit, name in enumerate(
        [
            "CHOWN",
            "DAC_OVERRIDE",
            "DAC_READ_SEARCH",
            "FOWNER",
            "FSETID",
            "KILL",
            "SETGID",
            "SETUID",
            "SETPCAP",
            "LINUX_IMMUTABLE",
            "NET_BIND_SERVICE",
            "NET_BROADCAST",
            "NET_ADMIN",
            "NET_RAW",
            "IPC_LOCK",
            "IPC_OWNER",
            "SYS_MODULE",
            "SYS_RAWIO",
            "SYS_CHROOT",
            "SYS_PTRACE",
            "SYS_PACCT",
            "SYS_ADMIN",
            "SYS_BOOT",
            "SYS_NICE",
            "SYS_RESOURCE",
            "SYS_TIME",
            "SYS_TTY_CONFIG",
            "MKNOD",
            "LEASE",
            "AUDIT_WRITE",
            "AUDIT_CONTROL",
            "SETFCAP",
            "MAC_OVERRIDE",
            "MAC_ADMIN",
            "SYSLOG",
            "WAKE_ALARM",
            "BLOCK_SUSPEND",
            "AUDIT_READ",
            "PERFMON",
            "BPF",
            "CHECKPOINT_RESTORE",
        ]
    )
}

#: Namespace kinds, as CRIU's task ids name them (``<kind>_ns_id``).
NAMESPACE_KINDS = ("pid", "net", "ipc", "uts", "mnt", "user", "cgroup", "time")


def capability_mask(names: Iterable[str]) -> int:
    """The bit mask of capability names (``CHOWN`` or ``CAP_CHOWN``); an unknown name is a bug here."""
    mask = 0
    for name in names:
        mask |= 1 << CAPABILITY_BITS[name.upper().removeprefix("CAP_")]
    return mask


@dataclass(frozen=True)
class IdMap:
    """One line of a user namespace's uid or gid map: ``count`` ids from ``inside`` map to ``outside`` on."""

    inside: int
    outside: int
    count: int


#: The CRIU external-mount key of a masked directory in a dump (runc/masks.py): the restore maps it to
#: an empty read-only tmpfs instead of CRIU saving and re-extracting the mask's (empty) contents.
MASKED_DIR_KEY = "crab-masked-dir"


@dataclass(frozen=True)
class Posture:
    """What a sandbox's processes may hold, as its backend created it; every restored image is checked against it.

    The backend derives it from the same source it creates the container
    from (runc: the bundle's config.json; Docker: the create call's
    settings), never from a second list.
    """

    #: The bounding set: no capability set of any restored thread may hold more.
    capabilities: int
    #: no_new_privs set on every thread.
    no_new_privs: bool = True
    #: A seccomp filter (mode 2) on every thread.
    seccomp_filter: bool = True
    #: Syscalls the sandbox's filter refuses (names): a restored thread's filter chain must refuse them too.
    refused_syscalls: frozenset[str] = frozenset()
    #: The namespace kinds the sandbox has of its own (NAMESPACE_KINDS), the rest being the host's.
    namespaces: frozenset[str] = frozenset()
    #: Where host paths are bind-mounted in (the runtime's external mounts, by destination).
    binds: frozenset[str] = frozenset()
    #: External mounts allowed at any mount point (runc binds /dev/null over masked files).
    mask_binds: frozenset[str] = frozenset()
    #: Mount points where an external mount keyed :data:`MASKED_DIR_KEY` is allowed, read-only (the masked
    #: directories, which a restore covers with an empty read-only tmpfs of crab's: runc/masks.py).
    mask_dirs: frozenset[str] = frozenset()
    #: Mount points where an external mount keyed by a ``tmpfs_key.TmpfsCopy`` is allowed (where the spec mounts
    #: a tmpfs, or runc's cgroup tmpfs): a restore puts a fresh tmpfs of the sandbox's root there.
    tmpfs_points: frozenset[str] = frozenset()
    #: Mount points that must be read-only when present.
    readonly: frozenset[str] = frozenset()
    #: The user namespace's maps, when ``"user"`` is in ``namespaces``.
    uid_map: tuple[IdMap, ...] = ()
    gid_map: tuple[IdMap, ...] = ()


class ProcessImages(Protocol):
    """Process images in the blob store: de-duplicated by page, written back for a restore."""

    def store(self, images_dir: Path, previous: str | None) -> StoredImage:
        """Store the dump in ``images_dir``; ``previous`` (a manifest) holds the likeliest duplicate pages."""
        ...

    def outline(self, manifest: str, read: ReadBlob) -> Outline:
        """Parse the image ``manifest`` through ``read``: the blobs it names and the bytes ``write``
        would put on disk (StoreError or UnsafeEntry if malformed)."""
        ...

    def write(self, manifest: str, target: Path, sandbox_id: str | None = None) -> WrittenImage:
        """Put the images of ``manifest`` into the empty dir ``target``; say how many bytes, and from where.

        ``sandbox_id``: the sandbox being filled (a kept copy it came from stays kept for it a while).

        The files may be hard links to a kept dump (``keep``): never write
        into one in place; replace it (write a new file, rename it over).
        """
        ...

    def keep(self, manifest: str, images_dir: Path, sandbox_id: str) -> None:
        """Hand over ``images_dir``, a dump just stored as ``manifest``, of sandbox ``sandbox_id``.

        The implementation may keep it as its hot copy for later restores,
        or delete it; either way the caller must not use ``images_dir`` again.
        """
        ...

    def close_external_connections(self, images_dir: Path) -> dict[str, int]:
        """Rewrite the images so restored processes find their outside connections closed; counts by outcome."""
        ...

    def check_posture(self, images_dir: Path, posture: Posture, checkpoint: str) -> None:
        """Refuse (PostureViolation, CriuImageInvalid) images whose processes would hold more than ``posture``.

        Run on every restore and fork, before CRIU reads ``images_dir``.
        """
        ...
