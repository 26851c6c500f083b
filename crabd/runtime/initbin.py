"""crab's init binary: build it, and install an immutable copy for sandboxes.

Sandboxes bind-mount ``<state_dir>/bin/crab-init-<sha256[:12]>`` read-only at
``/.crab/init``.  The name carries the content hash, so a running sandbox's
init file is never replaced under it, and an upgrade simply adds a file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from crabd.errors import CommandError, HostError
from crabd.util import proc

_HERE = Path(__file__).resolve().parent / "init"


def source_path() -> Path:
    return _HERE / "crab-init.c"


def binary_path() -> Path:
    return _HERE / "crab-init"


def build(force: bool = False) -> Path:
    """Compile crab-init statically (it must run in any image, even busybox)."""
    src, out = source_path(), binary_path()
    if not force and out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    tmp = out.with_suffix(".tmp")
    try:
        proc.run(["gcc", "-static", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(tmp), str(src)], timeout=300)
    except CommandError as exc:
        raise HostError(
            f"cannot build crab's init: {exc.message}",
            hint="Install gcc and the static libc (build-essential), or run `make setup`.",
        ) from exc
    os.replace(tmp, out)
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
