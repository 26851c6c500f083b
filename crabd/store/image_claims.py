"""Which crabd instance pinned which image, host-wide, and what in crab's database still names each image.

crabd pins every image a sandbox of any image starts from under its own tag,
``crab-loaded:<digest hex>`` (the backend's ``pin_image``), and collects it
once nothing needs it (``coordinator/image_gc.py``).  Docker and the runc
backend's exports (``/var/lib/crab/rootfs``) are shared by every crabd
instance on the host (the service, test and embedded daemons), each with its
own database; so each instance records its pins here, in one host-wide
directory (``[images] claims_dir``, like ``store/idranges.py``'s)::

    <dir>/.lock               flock(2): LOCK_SH while a crabd pins an image and records its use (a
                              create: from the pin to the sandbox's registry row); LOCK_EX while a
                              collector re-checks and removes (never waited for: tried, else next time)
    <dir>/<hex>/<instance>    one claim: crabd instance <instance> pinned sha256:<hex>; its mtime is
                              that instance's last pin; its content JSON {"state_dir": "..."}

An image is removed only once no claim is left: an instance drops its own
claim when its database no longer names the image and its last pin is older
than the grace; a claim whose instance's state dir is gone (an embedded
daemon's, removed with it) is stale and dropped by whoever finds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from crabd.errors import StoreBusy
from crabd.store.db import Database

DEFAULT_DIR = Path("/var/lib/crab/image-claims")
_LOCK = ".lock"
_HEX = re.compile(r"[0-9a-f]{64}\Z")
_INSTANCE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
#: Bytes read of a claim (a path and a little JSON).
_MAX_CLAIM = 8192
#: Seconds between tries of the lock (every try is LOCK_NB: see util/filelock.py for why).
_POLL_S = 0.005


@dataclass(frozen=True)
class Claim:
    instance: str
    #: The claiming instance's state dir ("" if unreadable: then never taken for stale).
    state_dir: str
    #: Its last pin (the claim file's mtime).
    at: float

    def stale(self) -> bool:
        """The claiming instance is gone for good: its state dir (and database) no longer exist."""
        return bool(self.state_dir) and not (Path(self.state_dir) / "registry.db").exists()


@dataclass
class Refs:
    """What names one image digest: sandboxes (any state), checkpoints, checkpoints the remote tier holds."""

    sandboxes: int = 0
    checkpoints: int = 0
    remote: int = 0

    @property
    def any(self) -> bool:
        return bool(self.sandboxes or self.checkpoints or self.remote)


class ImageClaims:
    def __init__(self, root: Path, instance: str, state_dir: Path) -> None:
        if not _INSTANCE.match(instance):
            raise ValueError(f"not a crabd instance id: {instance!r}")
        self.root = root
        self.instance = instance
        self.state_dir = state_dir

    # --- the lock -----------------------------------------------------------------------

    def _open_lock(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        return os.open(self.root / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def acquire_shared(self, timeout_s: float = 60.0) -> int:
        """Take the lock shared (blocking: call off the event loop); the descriptor to :meth:`release`.

        StoreBusy after ``timeout_s`` (a collection holds it exclusively only while it
        re-checks and removes).  flock belongs to the open file, not to a thread: any
        thread may release it.
        """
        fd = self._open_lock()
        try:
            deadline = time.monotonic() + timeout_s
            while not _try(fd, fcntl.LOCK_SH):
                if time.monotonic() > deadline:
                    raise StoreBusy(
                        f"the image claims lock ({self.root / _LOCK}) stayed taken for {timeout_s:.0f} s",
                        waited_s=timeout_s,
                        hint="An image collection holds it; try again in a moment. Nothing was changed.",
                    )
                time.sleep(_POLL_S)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)  # drops the flock with the last descriptor

    @contextlib.contextmanager
    def shared(self, timeout_s: float = 60.0) -> Iterator[None]:
        """:meth:`acquire_shared` for the ``with`` body."""
        fd = self.acquire_shared(timeout_s)
        try:
            yield
        finally:
            self.release(fd)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[bool]:
        """Try to hold the lock exclusively, once; yields whether it is held (no pin is in progress then)."""
        fd = self._open_lock()
        try:
            yield _try(fd, fcntl.LOCK_EX)
        finally:
            os.close(fd)

    # --- claims ---------------------------------------------------------------------------

    def claim(self, digest: str) -> None:
        """Record (or refresh: its mtime is now) this instance's pin of ``digest``."""
        d = self.root / _hex(digest)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = d / self.instance
        try:
            os.utime(path)
        except FileNotFoundError:
            tmp = d / f".{self.instance}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"state_dir": str(self.state_dir)}))
            os.replace(tmp, path)

    def read(self) -> dict[str, list[Claim]]:
        """Every image's claims, by digest (``sha256:<hex>``); an image dir left without claims maps to []."""
        found: dict[str, list[Claim]] = {}
        if not self.root.is_dir():
            return found
        for d in self.root.iterdir():
            if not _HEX.match(d.name) or not d.is_dir():
                continue
            claims = found.setdefault("sha256:" + d.name, [])
            for f in d.iterdir():
                if f.name.startswith(".") or not _INSTANCE.match(f.name):
                    continue
                try:
                    at = f.stat().st_mtime
                except FileNotFoundError:  # dropped meanwhile
                    continue
                claims.append(Claim(f.name, _state_dir_of(f), at))
        return found

    def drop(self, digest: str, instance: str) -> None:
        """Remove ``instance``'s claim of ``digest``, and the image's dir once it has none."""
        d = self.root / _hex(digest)
        (d / instance).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: another instance still claims it
            d.rmdir()


def _hex(digest: str) -> str:
    hexd = digest.removeprefix("sha256:")
    if not _HEX.match(hexd):
        raise ValueError(f"not an image digest: {digest!r}")
    return hexd


def _state_dir_of(claim: Path) -> str:
    """The state dir a claim names; "" if it cannot be read (such a claim is never taken for stale)."""
    try:
        with open(claim, encoding="utf-8", errors="replace") as fh:
            meta = json.loads(fh.read(_MAX_CLAIM))
    except (OSError, ValueError):
        return ""
    return str(meta.get("state_dir", "")) if isinstance(meta, dict) else ""


def _try(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def references(db: Database, owner_uid: int | None = None) -> dict[str, Refs]:
    """Every image digest crab's database names, and by how much; only ``owner_uid``'s rows if given.

    Sandboxes in any state (a stopped or dead one can be restarted or recovered),
    every checkpoint of the catalog (kept ones of removed sandboxes too), and every
    checkpoint the remote tier holds (it can be fetched here and restored).
    """
    where = "" if owner_uid is None else " AND owner_uid=?"
    args: tuple[int, ...] = () if owner_uid is None else (owner_uid,)
    out: dict[str, Refs] = {}
    with db.lock:
        conn = db.conn
        for image, n in conn.execute(
            f"SELECT image, COUNT(*) FROM sandboxes WHERE image LIKE 'sha256:%'{where} GROUP BY image", args
        ):
            out.setdefault(str(image), Refs()).sandboxes = int(n)
        for image, n in conn.execute(
            f"SELECT image, COUNT(*) FROM checkpoints WHERE image LIKE 'sha256:%'{where} GROUP BY image", args
        ):
            out.setdefault(str(image), Refs()).checkpoints = int(n)
        for image, n in conn.execute(
            "SELECT json_extract(meta_json, '$.image') AS image, COUNT(*) FROM remote_index"
            f" WHERE image LIKE 'sha256:%'{where} GROUP BY image",
            args,
        ):
            out.setdefault(str(image), Refs()).remote = int(n)
    return out
