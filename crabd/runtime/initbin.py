"""crab's init binary: build it, and install an immutable copy for sandboxes.

Sandboxes bind-mount ``<state_dir>/bin/crab-init-<sha256[:12]>`` read-only at
``/.crab/init``.  The name carries the content hash, so a running sandbox's
init file is never replaced under it, and an upgrade simply adds a file.

Where the source is and where the binary is built differ between a checkout
and an installed package (:mod:`crabd.util.resources`: the wheel ships the
source only).  ``crabctl host setup`` (or ``make`` in a checkout) builds it;
crabd builds it at start only if it is missing, which fails under the unit's
read-only ``/opt`` with a hint to run the set-up.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from crabd.errors import CommandError, HostError
from crabd.util import proc, resources

_HINT = "Run `crabctl host setup` as root (`make setup` in a checkout); it needs gcc and libc6-dev."


def source_path() -> Path:
    return resources.crab_init_source()


def binary_path() -> Path:
    return resources.crab_init_binary()


def is_built() -> bool:
    """Whether :func:`build` would find the binary up to date (and compile nothing)."""
    out = binary_path()
    if not out.exists():
        return False
    # An installed package's binary is named by its source's hash; a checkout's is rebuilt when older.
    return resources.installed() or out.stat().st_mtime >= source_path().stat().st_mtime


def build(force: bool = False) -> Path:
    """Compile crab-init statically (it must run in any image, even busybox)."""
    src, out = source_path(), binary_path()
    if not force and is_built():
        return out
    tmp = out.with_name(out.name + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        proc.run(["gcc", "-static", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(tmp), str(src)], timeout=300)
        os.replace(tmp, out)
    except CommandError as exc:
        raise HostError(f"cannot build crab's init: {exc.message}", hint=_HINT) from exc
    except OSError as exc:
        raise HostError(f"cannot build crab's init into {out.parent}: {exc.strerror or exc}", hint=_HINT) from exc
    return out


def install(state_dir: Path) -> Path:
    """Copy the (built) binary to ``state_dir/bin/crab-init-<hash>`` atomically; return that path."""
    src = build()
    data = src.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:12]
    bindir = state_dir / "bin"
    bindir.mkdir(parents=True, exist_ok=True, mode=0o755)
    target = bindir / f"crab-init-{digest}"
    if target.exists():
        return target
    tmp = bindir / f".crab-init-{digest}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o755)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o755)  # noqa: S103 - an executable every sandbox runs; no secrets in it

    os.replace(tmp, target)
    dfd = os.open(bindir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return target
