"""Dumps of the runc backend's containers by CRIU directly, not through ``runc checkpoint``.

Why (measured on this host kind, a small sandbox; docs/processes.md, "A dump without runc"):

* ``runc checkpoint`` starts CRIU twice (a version query, then ``criu swrk``)
  and loads its own state first: about 20 ms of every dump;
* CRIU records the container's cgroups ("soft", runc's mode), and to read
  them it mounts every cgroup hierarchy (ten v1 ones and the unified one)
  for each cgroup set it meets: 40 mounts a dump here, all while the sandbox
  is frozen, and a cgroup2 mount takes about 10 ms in the kernel when none
  was made in the last ~100 ms.  ``--cgroup-yard`` hands CRIU the host's
  hierarchies, already mounted (:func:`yard_links`), so it mounts none.

  ``--manage-cgroups=ignore`` would save 5 ms more but is wrong here: the
  image then names the old container's cgroups with no directory of theirs,
  so ``runc restore`` cannot move them to the new container's, and CRIU put
  the restored tasks back into the OLD container's cgroups (seen on the
  first try: crabd then refused the restored init as not the container's).

What is passed is what runc 1.1's ``Checkpoint`` passes, worked out from the
container's ``state.json`` in crab's own runc root (root's, 0700; nothing a
sandbox writes), so ``runc restore`` takes the images as if runc had made them:

* ``-t`` the init's pid, checked against the start time runc recorded
  (a pid reused by another process is never dumped);
* ``--root`` the rootfs, ``--freeze-cgroup`` the freezer (the caller froze it);
* ``--external mnt[DEST]:DEST`` for every bind mount and device node, and
  ``mnt[PATH]:/dev/null`` for every masked path that is not a directory
  (runc binds /dev/null over those);
* ``--external mnt[PATH]:crab-masked-dir`` for every masked directory, which
  runc covers with an empty read-only tmpfs: not in runc's list.  CRIU
  would otherwise save each one with a ``tar | gzip`` while the sandbox is
  frozen (about 5 ms each here) and extract it again at every restore; a
  restore maps the key to an empty read-only tmpfs of crab's (masks.py);
* ``--external mnt[POINT]:crab-tmpfs:POINT:...`` (tmpfs_key.py) for each tmpfs
  that holds only what runc put there (runc's cgroup tmpfs, an unused
  /dev/shm, /dev), which CRIU would otherwise tar while the sandbox is frozen; a
  restore mounts a fresh tmpfs with that content (tmpfs_copies.py);
* ``--external net[INODE]:extRootNetNS`` when the netns was given by path
  (runc's key; the same for pid), ``--empty-ns net`` where the backend asks
  for ``--empty-ns network``;
* ``--config`` the CRIU configuration runc would name (the ``org.criu.config``
  annotation, else /etc/criu/runc.conf), so the host's settings apply alike;
* ``descriptors.json`` in the images: the init's stdio as runc recorded it,
  which ``runc restore`` reads.

A container this module does not recognise (no cgroup namespace, so runc
would describe its cgroup mounts as bind mounts; a state it cannot read; an
option it does not know) is dumped through runc as before.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from crabd.backends.criu.runc import DUMP_OPTIONS, RuncDumper
from crabd.backends.procdump import MASKED_DIR_KEY
from crabd.backends.runc import statefile, tmpfs_copies
from crabd.backends.runc.bundle import CRIU_CONFIG_ANNOTATION
from crabd.backends.runc.cli import EMPTY_NETNS
from crabd.backends.runc.statefile import Unreadable, parse_record
from crabd.backends.tmpfs_key import TmpfsCopy
from crabd.errors import CriuError
from crabd.util import mountinfo as mountinfo_lines

log = logging.getLogger(__name__)

#: runc's CRIU configuration file when a container names none (libcontainer's handleCriuConfigurationFile).
RUNC_CRIU_CONFIG = Path("/etc/criu/runc.conf")
CONFIG_ANNOTATION = CRIU_CONFIG_ANNOTATION
#: The file ``runc restore`` reads the init's stdio from.
DESCRIPTORS = "descriptors.json"
#: runc's keys for namespaces given by path ("extRoot" + name + "NS").
_EXTERNAL_NS = {"NEWNET": ("net", "extRootNetNS"), "NEWPID": ("pid", "extRootPidNS")}


class NotPlanned(Exception):
    """This container is dumped through runc (the reason is the message)."""


@dataclass(frozen=True)
class DumpPlan:
    """What CRIU is told about one container, from its state.json."""

    pid: int
    start: int
    rootfs: str
    freezer: str
    #: ``--external`` arguments: mounts and namespaces.
    externals: tuple[str, ...]
    #: runc's CRIU configuration file; "" for none.
    config: str
    #: The init's stdio as runc recorded it (written to descriptors.json).
    descriptors: tuple[str, ...]

    def argv(self, images_dir: Path, work_dir: Path, extra: tuple[str, ...], yard: Path | None) -> list[str]:
        """``criu dump`` of this container, leaving it running (and frozen, if it was)."""
        argv = [
            "criu",
            "dump",
            "-t",
            str(self.pid),
            "--root",
            self.rootfs,
            "--images-dir",
            str(images_dir),
            "--work-dir",
            str(work_dir),
            "--log-file",
            "dump.log",
            "-v4",
            "--leave-running",
            *DUMP_OPTIONS,
            *criu_options(extra),
            "--freeze-cgroup",
            self.freezer,
        ]
        if yard is not None:
            argv += ["--cgroup-yard", str(yard)]
        # runc's RPC reads no default configuration (/etc/criu/default.conf, ~/.criu): neither does this.
        argv.append("--no-default-config")
        if self.config:
            argv += ["--config", self.config]
        for ext in self.externals:
            argv += ["--external", ext]
        return argv


def criu_options(runc_options: tuple[str, ...]) -> tuple[str, ...]:
    """The backend's extra dump options (runc's spelling) in CRIU's; NotPlanned for one not known here."""
    if runc_options == ():
        return ()
    if runc_options == EMPTY_NETNS:
        return ("--empty-ns", "net")
    raise NotPlanned(f"runc options {runc_options!r} have no CRIU spelling here")


def plan(state: Any, *, root_of_init: Path | None = None, mountinfo: str | None = None) -> DumpPlan:
    """The :class:`DumpPlan` of a decoded state.json; NotPlanned when runc should do it.

    ``root_of_init``: where the container's root is seen from here
    (``/proc/<pid>/root``), to tell masked files from masked directories and
    to look into the tmpfs mounts (tmpfs_copies.py); ``mountinfo``: its
    init's (read from /proc when None).  The container is frozen.
    """
    try:
        rec = parse_record(state)
        cfg = state["config"]
        binds = [str(m["destination"]) for m in cfg.get("mounts") or () if m.get("device") == "bind"]
        namespaces = {str(n["type"]): str(n.get("path") or "") for n in cfg.get("namespaces") or ()}
        devices = [str(d["path"]) for d in cfg.get("devices") or ()]
        masks = [str(p) for p in cfg.get("mask_paths") or ()]
        tmpfs = {str(m["destination"]) for m in cfg.get("mounts") or () if m.get("device") in ("tmpfs", "cgroup")}
        owner = tmpfs_copies.root_owner(cfg)
        descriptors = tuple(str(d) for d in state.get("external_descriptors") or ())
    except (KeyError, TypeError, ValueError, AttributeError, Unreadable) as exc:
        raise NotPlanned(f"state.json not understood: {exc!r}") from exc
    if "NEWCGROUP" not in namespaces:
        # Without a cgroup namespace runc describes the cgroup mounts as bind mounts of the host's
        # hierarchies (its getCgroupMounts); crab's bundles always have one.
        raise NotPlanned("the container has no cgroup namespace")
    if rec.freezer is None or not rec.rootfs:
        raise NotPlanned("state.json names no freezer or rootfs")
    root = root_of_init if root_of_init is not None else Path(f"/proc/{rec.pid}/root")
    externals = [f"mnt[{dest}]:{dest}" for dest in binds]
    kinds = {path: _masked_kind(root, path) for path in masks}
    externals += [f"mnt[{path}]:/dev/null" for path in masks if kinds[path] == "file"]
    externals += [f"mnt[{path}]:{MASKED_DIR_KEY}" for path in masks if kinds[path] == "dir"]
    externals += [f"mnt[{path}]:{path}" for path in devices]
    info = tmpfs_copies.read_mountinfo(rec.pid) if mountinfo is None else mountinfo
    copies = tmpfs_copies.survey(root, info, tmpfs - set(masks), owner)
    externals += [f"mnt[{point}]:{copy.key}" for point, copy in copies.items()]
    for kind, (name, key) in _EXTERNAL_NS.items():
        if namespaces.get(kind):
            externals.append(f"{name}[{_ns_inode(namespaces[kind])}]:{key}")
    return DumpPlan(
        pid=rec.pid,
        start=rec.start,
        rootfs=rec.rootfs,
        freezer=str(rec.freezer),
        externals=tuple(externals),
        config=_config_file(rec.annotations),
        descriptors=descriptors,
    )


def _masked_kind(root: Path, path: str) -> Literal["file", "dir", ""]:
    """How runc masked ``path``: with /dev/null ("file"), with a tmpfs ("dir"), or not at all ("": absent here).

    Only a stat, as runc's own check: what it finds decides an option of this sandbox's own dump, nothing
    else.  lstat keeps the last component from being followed; a sandbox that rearranged the paths above it
    (its root may remount its /proc) gets a dump that fails, as it would through runc.
    """
    try:
        st = os.lstat(f"{root}{path}")
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise NotPlanned(f"cannot look at masked path {path}: {exc}") from exc
    return "dir" if stat.S_ISDIR(st.st_mode) else "file"


def _ns_inode(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except OSError as exc:
        raise NotPlanned(f"namespace {path}: {exc}") from exc


def _config_file(annotations: dict[str, str]) -> str:
    """runc's rule: the annotation if set (empty: none), else runc.conf; only a file that exists."""
    named = annotations.get(CONFIG_ANNOTATION)
    path = RUNC_CRIU_CONFIG if named is None else Path(named) if named else None
    return str(path) if path is not None and path.is_file() else ""


def yard_links(mountinfo: str, own_cgroups: str) -> dict[str, str] | None:
    """{name in CRIU's cgroup yard: the host's mount of that hierarchy}; None if one is not mounted whole.

    CRIU names a yard's entries after the controllers of /proc/self/cgroup:
    ``name=X`` -> ``X``, the unified hierarchy ("") -> ``unified``, else the
    controllers as listed (``cpu,cpuacct``).  Only a mount of a hierarchy's
    root will do: CRIU walks the cgroup's full path below it.
    """
    mounts = [
        (m.point, {""} if m.fstype == "cgroup2" else set(m.super_options.split(",")))
        for m in mountinfo_lines.parse(mountinfo)
        if m.root == "/" and m.fstype in ("cgroup", "cgroup2")
    ]
    links: dict[str, str] = {}
    for line in own_cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ctrls = parts[1]
        wanted = {""} if ctrls == "" else set(ctrls.split(","))
        found = next((point for point, have in mounts if wanted <= have), None)
        if found is None:
            return None
        name = "unified" if ctrls == "" else ctrls.removeprefix("name=") if ctrls.startswith("name=") else ctrls
        links[name] = found
    return links or None


def make_yard(yard: Path) -> Path | None:
    """``yard`` holding a link per hierarchy (:func:`yard_links`), made or refreshed; None: no yard here."""
    try:
        links = yard_links(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())
        if links is None:
            return None
        yard.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name, target in links.items():
            link = yard / name
            if os.path.islink(link) and os.readlink(link) == target:
                continue
            tmp = yard / f".{name}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            os.symlink(target, tmp)
            os.replace(tmp, link)
    except OSError as exc:
        log.warning("no cgroup yard for CRIU; it mounts the hierarchies itself", extra={"error": str(exc)})
        return None
    return yard


class DirectDumper(RuncDumper):
    """:class:`~crabd.backends.procdump.ProcessDumper` that runs ``criu dump`` itself (see the module).

    ``yard``: where the cgroup yard is kept (made at the first dump); None: CRIU mounts the hierarchies.
    """

    def __init__(self, *, yard: Path | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._yard_dir = yard
        self._yard: Path | None = None

    def _cgroup_yard(self) -> Path | None:
        if self._yard_dir is not None and (self._yard is None or not self._yard.is_dir()):
            self._yard = make_yard(self._yard_dir)
        return self._yard

    def _argv(self, container_id: str, images_dir: Path, work_dir: Path, extra: tuple[str, ...]) -> list[str]:
        """``criu dump`` for a container this module knows, else ``runc checkpoint``."""
        try:
            p = plan(self._state(container_id))
            argv = p.argv(images_dir, work_dir, extra, self._cgroup_yard())
        except NotPlanned as exc:
            log.info("dumping through runc", extra={"container": container_id, "reason": str(exc)})
            return super()._argv(container_id, images_dir, work_dir, extra)
        self._check_init(container_id, p)
        _write_descriptors(images_dir, p.descriptors)
        copied = [ext.split("]", 1)[0].removeprefix("mnt[") for ext in p.externals if f"]:{TmpfsCopy.PREFIX}:" in ext]
        if copied:
            log.info("tmpfs kept out of CRIU's tar", extra={"container": container_id, "points": ",".join(copied)})
        return argv

    def _state(self, container_id: str) -> Any:
        """The container's state.json (statefile.py reads it: no link followed, bounded)."""
        try:
            fd = statefile.open_state(self.runc_root, container_id)
        except (OSError, Unreadable) as exc:
            raise NotPlanned(f"state.json of {container_id}: {exc}") from exc
        try:
            return statefile.decode_state(fd, self.runc_root / container_id / statefile.STATE_FILE)
        except Unreadable as exc:
            raise NotPlanned(str(exc)) from exc
        finally:
            os.close(fd)

    @staticmethod
    def _check_init(container_id: str, p: DumpPlan) -> None:
        """The pid runc recorded is still the container's init (runc's own check before a checkpoint)."""
        try:
            running = statefile.init_running(p.pid, p.start)
        except Unreadable:
            running = False
        if not running:
            raise CriuError(
                f"sandbox container {container_id[:12]} is not running (its init, pid {p.pid}, is gone)",
                log_path=None,
                log_excerpt="",
                hint="No checkpoint was made; the sandbox has stopped.",
            )


def _write_descriptors(images_dir: Path, descriptors: tuple[str, ...]) -> None:
    """descriptors.json as runc writes it (a JSON list of the init's stdio paths), mode 0600."""
    images_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(images_dir / DESCRIPTORS, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(list(descriptors), f)
