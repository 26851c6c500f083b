"""The masked directories of a restored container: an empty read-only tmpfs of crab's, not CRIU's tar.

runc masks a directory of ``linux.maskedPaths`` (``/proc/acpi``,
``/sys/firmware`` on this host kind) with an empty read-only tmpfs.  CRIU
saves every tmpfs it dumps with a ``tar | gzip`` and extracts it again at
every restore: about 5 ms of the frozen time per mask and 3 ms of CPU per
mask per restored clone, for contents that are always nothing.  So the
direct dumps (dumps.py) name each masked directory to CRIU as an external
mount keyed :data:`~crabd.backends.procdump.MASKED_DIR_KEY`, and a restore
maps that key to a fresh tmpfs made here:

* mounted by crabd in the host's initial user namespace, read-only at the
  superblock: no one in a sandbox, root of its user namespace or not, can
  make it writable (a remount of the bind changes the mount, not the
  superblock, which only the initial namespace's root may change), so one
  tenant's restore never holds anything another could have written;
* owned by the sandbox's root (the range's base id, or 0 without a user
  namespace), mode 1777, as runc's own mask tmpfs is seen from inside;
* at ``<layout.mounts>/<id>/masked``, beside the container's rootfs: the
  user namespace's root, which does CRIU's mounts, can reach it there
  (cleanup.Layout.userns_rootfs), and teardown detaches what a crash left;
* named to CRIU by a CRIU configuration file in the bundle (``criu.conf``,
  given by runc's ``org.criu.config`` annotation, the only way to pass
  ``runc restore`` an external mount it does not know): the host's
  ``/etc/criu/runc.conf`` that runc would have read, then one line
  ``external mnt[crab-masked-dir]:<source>``.

After ``runc restore`` the host side is detached (:func:`~.idmap.detach_dir`): the
container's binds hold the superblock.  Images whose masks are tarred (a dump
through ``runc checkpoint``, or by crab before this) restore as before; the
mapping then goes unused.  The posture check (criu/posture.py) accepts the key
only at a masked path and read-only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from crabd.backends.procdump import MASKED_DIR_KEY
from crabd.backends.runc import idmap
from crabd.backends.runc.dumps import RUNC_CRIU_CONFIG
from crabd.errors import ContainerRuntimeError
from crabd.util import libc
from crabd.util.smallfiles import read_small

#: The source's name in the container's directory under ``layout.mounts``.
SOURCE = "masked"
#: runc.conf is a few lines; a larger one is not the host's settings file.
_HOST_CONF_LIMIT = 64 << 10


@contextlib.contextmanager
def source(target: Path, *, owner: int) -> Iterator[Path]:
    """:func:`mount_source` for the ``with`` body (``runc restore``), then :func:`~.idmap.detach_dir`."""
    mount_source(target, owner)
    try:
        yield target
    finally:
        idmap.detach_dir(target)


def mount_source(target: Path, owner: int) -> Path:
    """An empty tmpfs at ``target`` (the directory made if missing): read-only, its root ``owner``'s, mode 1777."""
    target.mkdir(mode=0o755, exist_ok=True)
    # Read-only and nothing else: the flags of runc's own mask (ro, relatime) as CRIU recorded them.  In
    # a user namespace the bind inherits this mount's flags locked, and CRIU's remount to the recorded
    # ones fails (EPERM) if that would clear any (nosuid, nodev, noexec: nothing here to guard anyway).
    flags = libc.MS_RDONLY
    try:
        # Named and optioned as runc's mask is, so /proc/self/mountinfo reads the same (no size: read-only).
        libc.mount("tmpfs", target, "tmpfs", flags, f"mode=1777,uid={owner},gid={owner}")
        # Private: nothing mounted later under it (there is nothing) or over it propagates anywhere.
        libc.mount("none", target, "", libc.MS_PRIVATE)
    except OSError as exc:
        idmap.detach_dir(target)
        raise ContainerRuntimeError(
            f"cannot mount the masked directories' tmpfs at {target}: {exc}", container=""
        ) from exc
    return target


def criu_conf(source: Path, host_conf: Path = RUNC_CRIU_CONFIG, *, extra: bytes = b"") -> bytes:
    """The bundle's CRIU configuration: the host's runc.conf (if a readable regular file), the mapping, ``extra``.

    The host's file is read without following a link and bounded; one that
    cannot be read so is an error, not silently dropped, since runc would
    have applied its options to this restore.
    """
    host = b""
    if os.path.lexists(host_conf):
        data = read_small(host_conf, _HOST_CONF_LIMIT)
        if data is None:
            raise ContainerRuntimeError(
                f"{host_conf} is not a readable regular file of at most {_HOST_CONF_LIMIT} bytes",
                container="",
                hint="It holds CRIU's options for runc; `make setup` writes it (docs/processes.md).",
            )
        host = data if data.endswith(b"\n") or not data else data + b"\n"
    return host + f"external mnt[{MASKED_DIR_KEY}]:{source}\n".encode() + extra
