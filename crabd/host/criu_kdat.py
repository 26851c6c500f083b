"""CRIU's cache of kernel features, ``/run/criu.kdat``, on hosts whose /run is not a tmpfs.

Every CRIU run starts by probing the kernel ("kerndat": a dozen child
processes, sockets, namespaces and ptrace probes).  On this machine kind
that probe took ~40 ms of a 53 ms dump of one idle process; with its result
loaded from the cache the whole dump took 8 ms.  crab runs CRIU for every
process checkpoint, restore and fork, so the probe is most of CRIU's own time
on a small sandbox.

CRIU keeps the cache itself, but only when ``/run`` is a tmpfs: a reboot
must forget it, since the next kernel may differ.  systemd hosts mount /run
as a tmpfs and need nothing from here.  Where /run is on a disk (some VMs
and containers, this machine kind included) CRIU warns "Can't keep kdat
cache on non-tempfs" and probes again on every run.  Reading the cache does
not check the file system, so crabd writes it there itself:

1. ``python -m crabd.host.criu_kdat probe CRIU`` runs under ``unshare --mount
   --propagation private``: in that private mount namespace a small tmpfs is
   mounted over /run (the host's /run is untouched, and nothing of the host's
   is visible to the probe's run), ``CRIU check`` probes the kernel and saves
   its cache there, and the file's bytes go to stdout.
2. crabd writes them to ``/run/criu.kdat`` atomically (a temporary name in
   /run, then rename), at every start, before any CRIU run of its own: a
   cache left by an earlier boot is replaced before crab uses CRIU.
3. ``systemd/crab.tmpfiles`` removes ``/run/criu.kdat`` at boot, as a tmpfs
   /run would, for other CRIU users on the host.

The file's format is CRIU's (a ``struct kerndat_s`` with two magic numbers);
crab never reads it, and CRIU discards one whose size or magics do not match
its own build.
"""

from __future__ import annotations

import contextlib
import enum
import os
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from crabd.errors import CommandError, CrabError, HostError
from crabd.util import libc, proc

RUN = Path("/run")
#: Where CRIU (run as root) loads and saves the cache: ``KDAT_RUNDIR "/criu.kdat"``, fixed at build time.
KDAT = RUN / "criu.kdat"
#: Bigger than any CRIU's ``struct kerndat_s`` (912 bytes for CRIU 4.2); a bound on what is read back.
MAX_BYTES = 64 << 10
PROBE_TIMEOUT_S = 60.0


class KdatState(enum.StrEnum):
    #: /run is a tmpfs: CRIU keeps its cache itself.
    CRIU_KEEPS = "criu-keeps"
    #: crabd wrote the cache for this boot.
    INSTALLED = "installed"
    #: /run is not a tmpfs and holds no cache: every CRIU run probes the kernel.
    ABSENT = "absent"


@dataclass(frozen=True)
class Kdat:
    state: KdatState
    detail: str


def run_is_tmpfs(run: Path = RUN) -> bool:
    fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return libc.fs_type(fd) == libc.TMPFS_MAGIC
    finally:
        os.close(fd)


def status(run: Path = RUN) -> Kdat:
    """What the next CRIU run will find (for ``crabctl doctor``)."""
    if run_is_tmpfs(run):
        return Kdat(KdatState.CRIU_KEEPS, f"{run} is a tmpfs: CRIU keeps its kernel-feature cache there itself")
    if (run / KDAT.name).is_file():
        return Kdat(KdatState.INSTALLED, f"{run} is not a tmpfs; crabd wrote {run / KDAT.name} at its start")
    return Kdat(
        KdatState.ABSENT,
        f"{run} is not a tmpfs and has no {KDAT.name}: every CRIU run probes the kernel again (~40 ms)",
    )


def probe(criu: str, *, timeout: float = PROBE_TIMEOUT_S) -> bytes:
    """CRIU's kernel-feature cache for the running kernel, made in a private mount namespace (module doc, step 1)."""
    argv = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        sys.executable,
        "-m",
        "crabd.host.criu_kdat",
        "probe",
        criu,
    ]
    try:
        data = proc.run(argv, timeout=timeout).stdout
    except CommandError as exc:
        raise HostError(
            f"could not make CRIU's kernel-feature cache: {exc.message}",
            hint="Check that `criu check` runs as root; crab works without the cache, each CRIU run ~40 ms slower.",
        ) from exc
    if not data or len(data) > MAX_BYTES:
        raise HostError(f"`{criu} check` left a kernel-feature cache of {len(data)} bytes; expected 1..{MAX_BYTES}")
    return data


def install(data: bytes, run: Path = RUN) -> Path:
    """Write ``data`` as ``run``/criu.kdat atomically: a concurrent CRIU reads the old file or the new, never half."""
    target = run / KDAT.name
    tmp = run / f".crab-kdat-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.rename(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


def ensure(criu: str, run: Path = RUN) -> Kdat:
    """Make sure CRIU finds a cache made by this kernel (module doc); a no-op where /run is a tmpfs."""
    if run_is_tmpfs(run):
        return status(run)
    where = install(probe(criu), run)
    return Kdat(KdatState.INSTALLED, f"wrote {where} ({run} is not a tmpfs, so CRIU does not keep it itself)")


def _probe_here(criu: str) -> None:
    """Step 1 inside the private mount namespace: tmpfs over /run, ``criu check``, the cache to stdout."""
    proc.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "crab-kdat", str(RUN)], timeout=10)
    # check's verdict does not matter here (a missing optional feature fails it); its cache does.
    proc.run([criu, "check"], timeout=PROBE_TIMEOUT_S, check=False)
    sys.stdout.buffer.write(KDAT.read_bytes()[:MAX_BYTES])


def main(argv: list[str]) -> None:
    """``install``: what crabd does at start (``make setup`` runs it); ``probe CRIU``: step 1's inside."""
    if argv[:1] == ["probe"] and len(argv) == 2:
        _probe_here(argv[1])
    elif argv == ["install"]:
        criu = shutil.which("criu")
        if criu is None:
            raise SystemExit("criu is not on PATH; run `make setup`")
        try:
            print(f"[setup] CRIU kernel-feature cache: {ensure(criu).detail}")
        except (CrabError, OSError) as exc:
            # Speed only: set-up goes on, and `crabctl doctor` warns.
            print(f"[setup] warning: no CRIU kernel-feature cache: {exc}", file=sys.stderr)
    else:
        raise SystemExit("usage: python -m crabd.host.criu_kdat install | probe CRIU")


if __name__ == "__main__":
    main(sys.argv[1:])
