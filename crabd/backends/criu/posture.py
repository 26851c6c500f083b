"""The posture check: a process image may not restore processes holding more than their sandbox grants.

CRIU restores whatever credentials, seccomp state, namespaces and mounts
its images describe, and it runs as host root.  An image is a file: one
edited by hand (an archive, a bucket object, a forged dump) could bring
back processes with every capability, without no_new_privs or seccomp, in
the host's namespaces or with a host directory mounted in.  So before CRIU
sees a restore's or fork's images (trusted or not), crab reads them itself
(:mod:`.pbimage`) and compares them with the new container's
:class:`~crabd.backends.procdump.Posture`.

Images and fields read (CRIU ``images/*.proto``; magics in pbimage):

* ``inventory.img`` (single magic): ``InventoryEntry{3: root_ids}``, the
  task ids of CRIU itself at dump time: a namespace of the root task whose
  id differs from it is one CRIU creates at restore (criu/pstree.c,
  ``get_clone_mask``);
* ``pstree.img``: ``PstreeEntry{1: pid, 5: threads}``, the first record
  being the root task;
* ``ids-<pid>.img``: ``TaskKobjIdsEntry{5 pid, 6 net, 7 ipc, 8 uts, 9 mnt,
  10 user, 11 cgroup, 12 time}_ns_id``, what CRIU's restore uses for
  namespaces (``core.ids``, when present, must say the same);
* ``core-<tid>.img``: ``CoreEntry{3: tc TaskCoreEntry{1 task_state,
  11/12 old per-task seccomp}, 5: thread_core ThreadCoreEntry{10 creds,
  11 seccomp_mode, 12 seccomp_filter}}``; ``CredsEntry{9 cap_inh, 10 cap_prm,
  11 cap_eff, 12 cap_bnd, 19 cap_amb (32-bit words, low first), 18 no_new_privs}``;
* ``seccomp.img``: ``SeccompEntry{1: filters SeccompFilter{1 filter, 2 prev}}``;
* ``mountpoints-<mnt ns id>.img``: ``MntEntry{1 fstype, 2 mnt_id, 4 parent,
  5 flags, 6 root, 7 mountpoint, 13 ext_mount, 18 ext_key}``;
* ``userns-<id>.img``: ``UsernsEntry{1 uid_map, 2 gid_map: {1 first,
  2 lower_first, 3 count}}``.

What is checked, per thread of every live task:

* each capability set (inheritable, permitted, effective, bounding,
  ambient) within the posture's bounding set;
* no_new_privs set, seccomp in filter mode (a process's other threads
  may carry no mode: they share the leader's filter) with a filter chain that
  exists in ``seccomp.img`` and, run as the kernel would
  (:mod:`.seccomp_bpf`), refuses every syscall the posture's filter refuses;
  old per-task seccomp fields (which override per-thread ones in CRIU) and
  missing per-thread credentials (CRIU then reads an old ``creds`` image)
  are refused;
* namespaces: the root task owns exactly the posture's kinds, and every
  task is in the root task's namespaces (no nested ones: the sandbox's
  seccomp filter refuses unshare/setns/clone with CLONE_NEW*);
* with a user namespace, its uid and gid maps are the posture's;
* mounts (root paths plain, no ``..``): the root mount; the runtime's
  external bind mounts, each at its own destination, which the posture
  names (runc, not the image, names their host source), and its
  ``/dev/null`` over masked files; crab's empty tmpfs over masked
  directories (key ``crab-masked-dir``), read-only, only where the spec
  masks a directory (the restore, not the image, names its source);
  mounts of kernel-made file systems
  (proc, sysfs, tmpfs, devpts, mqueue, cgroup) that share no device with
  the root or a host bind (CRIU would bind those from it), sysfs and cgroup
  read-only, one proc at /proc and its other binds read-only; anything else
  is refused.  The posture's read-only points are read-only, and those
  under /proc that this host has are present.

uids and gids are not checked: the sandbox holds CAP_SETUID/CAP_SETGID
within its own posture, so any id an image could name is one its processes
can take by themselves; what bounds what an id is worth on the host is the
user namespace's map, which is checked.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from crabd.backends.criu import pbimage
from crabd.backends.criu.pbimage import Malformed, Message
from crabd.backends.criu.seccomp_bpf import ARCH_NAMES, SYSCALLS, refuses
from crabd.backends.procdump import CAPABILITY_BITS, MASKED_DIR_KEY, NAMESPACE_KINDS, IdMap, Posture
from crabd.backends.tmpfs_key import TmpfsCopy
from crabd.errors import CriuImageInvalid, PostureViolation

#: TaskKobjIdsEntry field of each namespace kind.
_NS_FIELD = {"pid": 5, "net": 6, "ipc": 7, "uts": 8, "mnt": 9, "user": 10, "cgroup": 11, "time": 12}
assert tuple(_NS_FIELD) == NAMESPACE_KINDS
IDS_MAGIC = 0x54432030
TASK_DEAD = 2
SECCOMP_MODE_FILTER = 2
#: CredsEntry fields of the capability sets.
_CAP_SETS = {"inheritable": 9, "permitted": 10, "effective": 11, "bounding": 12, "ambient": 19}
#: MntEntry fstypes made by the kernel from nothing on the host (mnt.proto's enum).  proc, sysfs
#: and cgroup reach the host's kernel settings: they must be read-only but for /proc itself.
_VIRTUAL_FS = {1: "proc", 2: "sysfs", 5: "tmpfs", 6: "devpts", 12: "cgroup", 14: "mqueue", 23: "cgroup2"}
MS_RDONLY = 1
#: Tasks, threads and seccomp filters one image may hold (a sandbox's pids limit is 4096 by default).
MAX_TASKS = 16384
MAX_FILTERS = 4096


@dataclass
class _Checker:
    dirfd: int
    images_dir: Path
    posture: Posture
    checkpoint: str
    #: Per filter chain: a syscall it lets through that the posture refuses (None: it refuses them all).
    verdicts: dict[tuple[bytes, ...], str | None] = field(default_factory=dict)

    def refuse(self, pid: int, what: str, found: str, expected: str) -> PostureViolation:
        return PostureViolation(
            f"checkpoint {self.checkpoint}: process {pid}'s {what} is {found}, but the sandbox grants {expected}; "
            "nothing was restored",
            checkpoint=self.checkpoint,
            pid=pid,
            what=what,
            found=found,
            expected=expected,
        )

    def one(self, name: str, magic: int, *, common: bool = True) -> Message:
        msgs = pbimage.messages(self.dirfd, name, magic, common=common)
        if len(msgs) != 1:
            raise Malformed(f"{len(msgs)} records where CRIU reads one")
        return msgs[0]

    # --- namespaces -------------------------------------------------------------

    def ids(self, pid: int) -> dict[str, int | None] | None:
        """The task's namespace ids; None without an ids image (a zombie's: CRIU gives it its parent's)."""
        if not _exists(self.dirfd, f"ids-{pid}.img"):
            return None
        try:
            msg = self.one(f"ids-{pid}.img", IDS_MAGIC)
        except Malformed as exc:
            raise _Bad(f"ids-{pid}.img", str(exc)) from exc
        return {kind: msg.uint32(num) for kind, num in _NS_FIELD.items()}

    def check_namespaces(
        self, root_ids: dict[str, int | None], tasks: list[tuple[int, list[int]]]
    ) -> tuple[int | None, set[int]]:
        """The root task's own kinds equal the posture's; every task shares them.

        Returns the mnt ns id, and the tasks without ids (which must be zombies).
        """
        root_pid = tasks[0][0]
        root = self.ids(root_pid)
        if root is None:
            raise _Bad(f"ids-{root_pid}.img", "missing for the root task")
        no_ids = set()
        own = frozenset(k for k in NAMESPACE_KINDS if root[k] != root_ids[k])
        # A container CRIU restored has a time namespace of its own: CRIU makes one at every restore so that
        # the processes' monotonic and boot-time clocks go on from where they were dumped.  It grants nothing
        # (clock offsets only), so a dump of a restored sandbox may carry it.
        if own - RESTORE_MADE != self.posture.namespaces - RESTORE_MADE or not self.posture.namespaces <= own:
            raise self.refuse(
                root_pid, "set of own namespaces", ",".join(sorted(own)) or "none",
                ",".join(sorted(self.posture.namespaces)) or "none",
            )  # fmt: skip
        for pid, _threads in tasks[1:]:
            mine = self.ids(pid)
            if mine is None:
                no_ids.add(pid)
                continue
            differ = sorted(k for k in NAMESPACE_KINDS if mine[k] != root[k])
            if differ:
                raise self.refuse(pid, "namespaces", "own " + ",".join(differ), "the sandbox's own")
        if "user" in own:
            self.check_userns(root_pid, root["user"])
        return root["mnt"], no_ids

    def check_userns(self, pid: int, ns_id: int | None) -> None:
        name = f"userns-{ns_id}.img"
        try:
            msg = self.one(name, pbimage.USERNS_MAGIC)
            maps = [
                tuple(IdMap(e.uint32(1) or 0, e.uint32(2) or 0, e.uint32(3) or 0) for e in msg.messages(num))
                for num in (1, 2)
            ]
        except Malformed as exc:
            raise _Bad(name, str(exc)) from exc
        for label, got, want in (
            ("uid map", maps[0], self.posture.uid_map),
            ("gid map", maps[1], self.posture.gid_map),
        ):
            # The host side is not the image's to choose: the runc backend rewrites it to the new container's
            # own range before CRIU runs (backends/runc/userns_image.py), so a restore into another range is
            # normal.  What the image may not change is the shape: which ids exist inside, and how many.
            # And never host root, whatever rewrites it later: a second wall if that rewrite were skipped.
            if _shape(got) != _shape(want) or any(e.outside == 0 for e in got):
                raise self.refuse(pid, f"user namespace {label}", _maps(got), _maps(want))

    # --- credentials and seccomp ----------------------------------------------------

    def seccomp_filters(self) -> list[tuple[bytes, int | None]]:
        """Each filter's program and ``prev`` (None: the chain's end), by index; [] without seccomp.img."""
        try:
            entry = self.one("seccomp.img", pbimage.SECCOMP_MAGIC)
            filters = entry.messages(1)
            if len(filters) > MAX_FILTERS:
                raise Malformed(f"{len(filters)} filters")
            out: list[tuple[bytes, int | None]] = []
            for f in filters:
                program = f.blob(1)
                if program is None:
                    raise Malformed("a filter without its program")
                out.append((program, f.uint32(2)))
        except Malformed as exc:
            if not _exists(self.dirfd, "seccomp.img"):
                return []
            raise _Bad("seccomp.img", str(exc)) from exc
        return out

    def allowed_syscall(self, chain: tuple[bytes, ...]) -> str | None:
        """A syscall the posture refuses that ``chain`` lets through (with its entry point), or None; cached."""
        if chain not in self.verdicts:
            self.verdicts[chain] = next(
                (
                    f"{name} ({ARCH_NAMES[arch]})"
                    for arch, numbers in SYSCALLS.items()
                    for name in sorted(self.posture.refused_syscalls)
                    if name in numbers and not refuses(list(chain), numbers[name], arch)
                ),
                None,
            )
        return self.verdicts[chain]

    def check_core(self, pid: int, tid: int, filters: list[tuple[bytes, int | None]], *, zombie: bool = False) -> None:
        name = f"core-{tid}.img"
        try:
            core = self.one(name, pbimage.CORE_MAGIC)
            tc = core.message(3)
            if (tc is None) == (tid == pid):
                # CRIU reads the task part from the leader's core only, and refuses it in a thread's.
                raise Malformed("the task part in a thread's core, or none in the leader's")
            if tc is not None and tc.uint32(1) == TASK_DEAD:
                return  # a zombie: nothing of it runs again
            if zombie:
                raise Malformed(f"task {pid} lacks its ids or is not among its own threads, and is not dead")
            if tc is not None and (tc.has(11) or tc.has(12)):
                # CRIU copies these over the per-thread fields: one place to judge, not two.
                raise Malformed("old per-task seccomp fields")
            thread = core.message(5)
            creds = thread.message(10) if thread is not None else None
            if thread is None or creds is None:
                raise Malformed("no per-thread credentials")
            caps = {label: _mask(creds.uint32s(num)) for label, num in _CAP_SETS.items()}
            nnp = creds.uint32(18)
            mode = thread.uint32(11)
            index = thread.uint32(12)
        except Malformed as exc:
            raise _Bad(name, str(exc)) from exc
        allowed = self.posture.capabilities
        for label, mask in caps.items():
            if mask & ~allowed:
                raise self.refuse(tid, f"{label} capability set", _caps(mask), f"at most {_caps(allowed)}")
        if self.posture.no_new_privs and not nnp:
            raise self.refuse(tid, "no_new_privs", "cleared", "set")
        if self.posture.seccomp_filter and tid != pid and mode is None and index is None:
            # CRIU dumps a process's other threads without a mode when they share the leader's
            # filter (seen: threads at Seccomp 2 dumped so, restored at Seccomp 2): the leader's
            # core, judged on its own, carries it.
            pass
        elif self.posture.seccomp_filter:
            if mode != SECCOMP_MODE_FILTER:
                raise self.refuse(tid, "seccomp mode", str(mode or 0), f"{SECCOMP_MODE_FILTER} (filter)")
            chain = None if index is None else _chain(filters, index)
            if chain is None:
                raise self.refuse(tid, "seccomp filter", "missing or broken", "the sandbox's filter chain")
            let_through = self.allowed_syscall(chain)
            if let_through is not None:
                raise self.refuse(tid, "seccomp filter", f"one allowing {let_through}", f"one refusing {let_through}")

    # --- mounts -----------------------------------------------------------------

    def check_mounts(self, pid: int, mnt_ns: int | None) -> None:
        """The root task's mount table: each entry is the root, a spec bind, or a kernel file system, safely.

        Steps: decode every MntEntry; find the one root; judge each entry by
        kind (see :func:`_judge_mount`); then check that the read-only points
        under /proc that this host's runtimes mount (they skip absent ones)
        are all there, so that dropping one cannot make /proc/sys writable.
        """
        name = f"mountpoints-{mnt_ns}.img"
        try:
            mounts = [_Mount.of(e) for e in pbimage.messages(self.dirfd, name, pbimage.MNTS_MAGIC)]
            ids = {m.mnt_id for m in mounts}
            roots = [m for m in mounts if m.parent not in ids]
            if len(roots) != 1:
                raise Malformed(f"{len(roots)} root mounts")
        except Malformed as exc:
            raise _Bad(name, str(exc)) from exc
        root = roots[0]
        # CRIU mounts an entry as a bind of any entry of the same device whose root holds its root:
        # a kernel file system may not share a device with the container's root or a host bind.
        masks = self.posture.mask_binds | {MASKED_DIR_KEY}
        host_devs = {root.dev} | {
            m.dev for m in mounts if m.external and m.key not in masks and not TmpfsCopy.is_key(m.key)
        }
        points = set()
        for m in mounts:
            inside = sandbox_point(m.point, root.point)
            points.add(inside)
            problem = _judge_mount(m, inside, m is root, host_devs, self.posture)
            if problem is not None:
                found, expected = problem
                raise self.refuse(pid, "root mount" if m is root else f"mount at {inside}", found, expected)
        for path in sorted(self.posture.readonly):
            if path.startswith("/proc/") and path not in points and os.path.exists(path):
                raise self.refuse(pid, f"mount at {path}", "absent", "a read-only mount")


@dataclass(frozen=True)
class _Mount:
    fstype: int
    mnt_id: int
    dev: int
    parent: int
    flags: int
    root: str
    point: str
    external: bool
    key: str | None

    @classmethod
    def of(cls, e: Message) -> _Mount:
        fields = (e.uint32(1), e.uint32(2), e.uint32(3), e.uint32(4), e.text(6), e.text(7))
        if any(f is None for f in fields):
            raise Malformed("a mount entry without a required field")
        fstype, mnt_id, dev, parent, root, point = fields
        assert isinstance(root, str) and isinstance(point, str)
        key = e.text(18)
        return cls(
            fstype or 0, mnt_id or 0, dev or 0, parent or 0, e.uint32(5) or 0, root, point,
            bool(e.uint32(13)) or key is not None, key,
        )  # fmt: skip


def _judge_mount(
    m: _Mount, inside: str, is_root: bool, host_devs: set[int], posture: Posture
) -> tuple[str, str] | None:
    """(found, expected) if mount ``m`` is beyond the posture, else None."""
    if not _normal_path(m.root):
        return f"a mount of {m.root!r}", "a plain absolute path"
    if is_root:
        return None if m.root == "/" else (f"a bind of {m.root!r}", "the container's root")
    ro = bool(m.flags & MS_RDONLY)
    if m.external:
        # runc names a bind to CRIU by its destination; its host source comes from runc, not the image.
        if m.key in posture.mask_binds:
            return None
        if TmpfsCopy.is_key(m.key):
            # A fresh tmpfs of the sandbox's root (runc/tmpfs_copies.py), only where the spec has a tmpfs.
            try:
                copy = TmpfsCopy.parse(m.key or "")
            except ValueError as exc:
                return f"a tmpfs copy keyed {m.key!r} ({exc})", "a key a dump of crab's writes"
            if inside not in posture.tmpfs_points or copy.point != inside:
                return f"a tmpfs copy for {copy.point} at {inside}", "one only where the spec mounts a tmpfs, its own"
            return None
        if m.key == MASKED_DIR_KEY:
            # crab's empty tmpfs (runc/masks.py), only where the spec masks a directory, and read-only.
            if inside not in posture.mask_dirs:
                return f"a masked-directory mount at {inside}", "one only at a path the spec masks"
            return None if ro else ("a writable masked directory", "read-only")
        if m.key not in posture.binds or m.key != inside:
            return f"a host bind keyed {m.key!r}", "only the spec's own bind mounts, each at its own place"
    elif m.fstype not in _VIRTUAL_FS:
        return f"a mount of file system type {m.fstype} at {m.root!r}", "no mounts beyond the spec's"
    elif m.dev in host_devs:
        return f"a bind of {m.root!r} from the root or a host bind", "no mounts beyond the spec's"
    elif m.fstype in (2, 12, 23) and not ro:
        return f"a writable {_VIRTUAL_FS[m.fstype]}", "read-only (it reaches the host's kernel settings)"
    elif m.fstype == 1 and m.root == "/" and inside != "/proc":
        return "a second proc", "one proc, at /proc"
    elif m.fstype == 1 and m.root != "/" and not ro:
        return f"a writable bind of proc's {m.root!r}", "read-only"
    if inside in posture.readonly and not ro:
        return "writable", "read-only"
    return None


def _normal_path(path: str) -> bool:
    return path == "/" or (path.startswith("/") and all(p not in ("", ".", "..") for p in path[1:].split("/")))


class _Bad(Exception):
    """A malformed image: (file name, why)."""


def _exists(dirfd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        return True
    except OSError:
        return False


def sandbox_point(point: str, root_point: str) -> str:
    """A mount point as the sandbox sees it (CRIU records them under the dump's root mount point)."""
    if root_point not in ("", "/") and (point == root_point or point.startswith(root_point.rstrip("/") + "/")):
        point = point[len(root_point.rstrip("/")) :]
    point = point.removeprefix(".")
    return point if point.startswith("/") else "/" + point


def _mask(words: list[int]) -> int:
    if len(words) > 4:
        raise Malformed(f"a capability set of {len(words)} words")
    return sum(w << (32 * i) for i, w in enumerate(words))


_CAP_NAMES = {bit: name for name, bit in CAPABILITY_BITS.items()}


def _caps(mask: int) -> str:
    names = [_CAP_NAMES.get(b, str(b)) for b in range(mask.bit_length()) if mask >> b & 1]
    return f"{mask:#x} ({','.join(names) or 'none'})"


#: Namespaces CRIU itself makes at a restore, whatever the spec says (see ``check_namespaces``).
RESTORE_MADE = frozenset({"time"})


def _shape(m: tuple[IdMap, ...]) -> tuple[tuple[int, int], ...]:
    """A map without its host side: (first id inside, how many), line by line."""
    return tuple((e.inside, e.count) for e in m)


def _maps(m: tuple[IdMap, ...]) -> str:
    return "; ".join(f"{e.inside} {e.outside} {e.count}" for e in m) or "none"


def _chain(filters: list[tuple[bytes, int | None]], index: int) -> tuple[bytes, ...] | None:
    """The programs of the chain from ``index``; None if it names a missing filter or loops."""
    seen: list[int] = []
    at: int | None = index
    while at is not None:
        if at >= len(filters) or at in seen:
            return None
        seen.append(at)
        at = filters[at][1]
    return tuple(filters[i][0] for i in seen)


def check(images_dir: Path, posture: Posture, checkpoint: str) -> None:
    """Refuse the images in ``images_dir`` unless every process fits ``posture``.

    Steps: open the dir once (no link followed); read inventory and pstree;
    check namespaces (and the user namespace's maps); check every thread's
    core (credentials, no_new_privs, seccomp); check the root task's mounts.
    Raises PostureViolation for a process holding more than the posture,
    CriuImageInvalid for an image that does not parse.
    """
    try:
        dirfd = pbimage.open_dir(images_dir)
    except Malformed as exc:
        raise _invalid(images_dir, images_dir.name, str(exc)) from exc
    try:
        c = _Checker(dirfd, images_dir, posture, checkpoint)
        try:
            inventory = c.one("inventory.img", pbimage.INVENTORY_MAGIC, common=False)
            root_msg = inventory.message(3)
            if root_msg is None:
                raise _Bad("inventory.img", "no root task ids")
            root_ids = {kind: root_msg.uint32(num) for kind, num in _NS_FIELD.items()}
            tasks = _pstree(dirfd)
            mnt_ns, no_ids = c.check_namespaces(root_ids, tasks)
            filters = c.seccomp_filters()
            for pid, threads in tasks:
                # A zombie has no ids image and its thread list does not name it (CRIU keeps
                # neither for a dead task): a task like that must be dead by its own core.
                for tid in threads if pid in threads else [pid]:
                    c.check_core(pid, tid, filters, zombie=pid not in threads or pid in no_ids)
            c.check_mounts(tasks[0][0], mnt_ns)
        except Malformed as exc:
            raise _invalid(images_dir, "inventory.img or pstree.img", str(exc)) from exc
        except _Bad as exc:
            name, why = exc.args
            raise _invalid(images_dir, name, why) from exc
    finally:
        with contextlib.suppress(OSError):
            os.close(dirfd)


def _pstree(dirfd: int) -> list[tuple[int, list[int]]]:
    tasks: list[tuple[int, list[int]]] = []
    for rec in pbimage.records(pbimage.read_file(dirfd, "pstree.img"), pbimage.PSTREE_MAGIC):
        if len(tasks) >= MAX_TASKS:
            raise Malformed(f"more than {MAX_TASKS} tasks")
        msg = Message(rec)
        pid = msg.uint32(1)
        if pid is None:
            raise Malformed("a task without its pid")
        threads = msg.uint32s(5)
        if len(threads) > MAX_TASKS:
            raise Malformed(f"a task of {len(threads)} threads")
        tasks.append((pid, threads))
    if not tasks:
        raise Malformed("no tasks")
    return tasks


def _invalid(images_dir: Path, name: str, why: str) -> CriuImageInvalid:
    return CriuImageInvalid(
        f"process image {name} is malformed ({why}); nothing was restored",
        path=str(images_dir / name),
        hint="The checkpoint's process image is damaged or forged: restore another checkpoint, "
        "or fork it as files only (kind fs).",
    )
