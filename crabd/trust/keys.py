"""This host's signing key and the public keys it trusts (provenance: ``crabd/trust/provenance.py``).

On-disk layout, under ``<state_dir>/trust/`` (made by crabd at start, mode 0700 for the
directory, everything owned by the user crabd runs as, i.e. root)::

    host.key            this host's Ed25519 private key, PKCS#8 PEM, mode 0600; made once,
                        atomically (temp file, fsync, link into place), never replaced
    host.pub            its public key in the one-line form below, mode 0644 (to copy to other hosts)
    trusted/            the public keys of other hosts whose checkpoints this host trusts
      <name>.pub        one key per file, the one-line form below; <name> is free (a host id)

Public key line: ``crab-ed25519 <base64 of the 32-byte raw key> [<host>]``.  A key's id is
the SHA-256 (hex) of its raw 32 bytes, so renaming a file changes nothing.

**Distribution.** In a cluster the keys travel with the mTLS material: the operator who
issues a host's certificate (``crabctl cluster ca ...``, ``crabd/cluster/tls.py``) copies
each host's ``host.pub`` into every other host's ``trusted/`` beside its certificate and
CA, as root.  A host without any ``trusted/`` file trusts only itself.

**Who may make a key trusted.** Only someone who can write as root: a file under
``trusted/`` counts only if it, ``trusted/`` and ``trust/`` are owned by crabd's user, are
not symlinks, and are not writable by group or others (a file failing that is ignored and
logged).  Nothing a client sends (an archive, a bucket object, an RPC) is ever written here,
so a tenant cannot make its own key trusted.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import logging
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from crabd.errors import HostError

log = logging.getLogger("crabd.trust")

KEY_FILE = "host.key"
PUB_FILE = "host.pub"
TRUSTED_DIR = "trusted"
KEY_PREFIX = "crab-ed25519"
#: Largest public key file read (one line).
MAX_PUB_BYTES = 4096


def key_id(public: Ed25519PublicKey) -> str:
    """The stable id of a public key: SHA-256 (hex) of its raw 32 bytes."""
    return hashlib.sha256(_raw(public)).hexdigest()


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_line(public: Ed25519PublicKey, host: str) -> str:
    """The one-line text form of a public key (``host.pub`` and the files of ``trusted/``)."""
    return f"{KEY_PREFIX} {base64.b64encode(_raw(public)).decode()} {host}".rstrip() + "\n"


def parse_public_line(text: str) -> tuple[Ed25519PublicKey, str]:
    """A public key and its host label from its one-line form; ValueError if it is not one."""
    parts = text.strip().split()
    if len(parts) not in (2, 3) or parts[0] != KEY_PREFIX:
        raise ValueError(f"not a {KEY_PREFIX} public key line")
    try:
        raw = base64.b64decode(parts[1], validate=True)
    except binascii.Error as exc:
        raise ValueError("its key is not base64") from exc
    if len(raw) != 32:
        raise ValueError("its key is not 32 bytes")
    return Ed25519PublicKey.from_public_bytes(raw), parts[2] if len(parts) == 3 else ""


def root_only_problem(path: Path) -> str:
    """Why ``path`` may not hold trust material ("" if only crabd's user can write it).

    lstat, not stat: a symlink is refused whatever it points at (it could be repointed by
    whoever owns the directory it sits in).
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not crabd's ({os.geteuid()})"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def _write_new(path: Path, data: bytes, mode: int) -> bool:
    """Write ``path`` once: a temp file (mode set before it has a name), fsync, hard link into place.

    A link, not a rename, so that two crabds starting at once never replace each other's key:
    the second one's link fails and it reads the first one's.  False if ``path`` existed.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return True


@dataclass
class KeyRing:
    """This host's key and the keys it trusts (its own included), by key id.

    ``trusted/`` is re-read when its modification time changes, so a key an operator adds
    counts from the next check on, without a restart.
    """

    directory: Path
    host: str
    private: Ed25519PrivateKey
    #: key id -> (public key, host label)
    trusted: dict[str, tuple[Ed25519PublicKey, str]] = field(default_factory=dict)
    #: Files of ``trusted/`` that were not taken, and why.
    ignored: dict[str, str] = field(default_factory=dict)
    _seen_mtime: int = -1

    @property
    def key_id(self) -> str:
        return key_id(self.private.public_key())

    def sign(self, message: bytes) -> tuple[str, bytes]:
        """This host's signature of ``message``: (key id, signature)."""
        return self.key_id, self.private.sign(message)

    def verify(self, kid: str, message: bytes, signature: bytes) -> str:
        """Why ``signature`` is not a trusted key's signature of ``message`` ("" if it is)."""
        self.refresh()
        known = self.trusted.get(kid)
        if known is None:
            return f"it is signed by key {kid[:16]}, which this host does not trust"
        try:
            known[0].verify(signature, message)
        except InvalidSignature:
            return f"its signature by key {kid[:16]} ({known[1] or '?'}) does not verify"
        return ""

    def label(self, kid: str) -> str:
        """The host a trusted key belongs to ("" if it is not trusted)."""
        self.refresh()
        known = self.trusted.get(kid)
        return known[1] if known else ""

    def refresh(self) -> None:
        """Re-read ``trusted/`` if it changed (see the class doc)."""
        tdir = self.directory / TRUSTED_DIR
        try:
            mtime = os.lstat(tdir).st_mtime_ns
        except OSError:
            mtime = 0
        if mtime == self._seen_mtime:
            return
        self._seen_mtime = mtime
        own = self.private.public_key()
        trusted: dict[str, tuple[Ed25519PublicKey, str]] = {key_id(own): (own, self.host)}
        ignored: dict[str, str] = {}
        problem = root_only_problem(self.directory) or root_only_problem(tdir) if mtime else "no trusted/"
        if not problem:
            for entry in sorted(tdir.iterdir()):
                if not entry.name.endswith(".pub"):
                    continue
                why = root_only_problem(entry) or _load_into(entry, trusted)
                if why:
                    ignored[entry.name] = why
        elif mtime:
            ignored[TRUSTED_DIR] = problem
        for name, why in ignored.items():
            log.warning("trusted key ignored", extra={"file": name, "why": why})
        self.trusted, self.ignored = trusted, ignored


def _load_into(entry: Path, trusted: dict[str, tuple[Ed25519PublicKey, str]]) -> str:
    """Read one trusted key file into ``trusted``; why it was not taken ("" if it was)."""
    try:
        with open(entry, "rb") as f:
            data = f.read(MAX_PUB_BYTES + 1)
        if len(data) > MAX_PUB_BYTES:
            return "it is too large for a public key"
        public, label = parse_public_line(data.decode("ascii"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"not a public key: {exc}"
    trusted[key_id(public)] = (public, label or entry.stem)
    return ""


def open_keyring(directory: Path, host: str) -> KeyRing:
    """This host's key ring under ``directory`` (``<state_dir>/trust``): the key made on first use.

    Steps: make the directory (0700); if ``host.key`` is absent, make a key and write it once
    (:func:`_write_new`); check ``host.key``'s ownership and mode, load it; (re)write
    ``host.pub``; read ``trusted/``.  HostError if the key exists but is unsafe or unreadable:
    a key others could read or replace signs nothing.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / KEY_FILE
    if not path.exists():
        fresh = Ed25519PrivateKey.generate()
        pem = fresh.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        if _write_new(path, pem, 0o600):
            log.info("host signing key made", extra={"path": str(path), "key": key_id(fresh.public_key())})
    problem = root_only_problem(directory) or root_only_problem(path)
    if not problem and stat.S_IMODE(os.lstat(path).st_mode) & 0o077:
        problem = f"{path} is readable by group or others"
    if problem:
        raise HostError(
            f"crab's host signing key cannot be used: {problem}",
            hint=f"Make {directory} and {path} owned by crabd's user (root) with modes 0700 and 0600.",
        )
    try:
        private = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise HostError(
            f"crab's host signing key {path} cannot be read: {exc}",
            hint=f"Move {path} away and restart crabd to make a new key (re-distribute its host.pub).",
        ) from exc
    if not isinstance(private, Ed25519PrivateKey):
        raise HostError(f"{path} is not an Ed25519 key", hint=f"Move {path} away and restart crabd.")
    line = public_line(private.public_key(), host).encode()
    pub = directory / PUB_FILE
    if not pub.exists() or pub.read_bytes() != line:
        pub.unlink(missing_ok=True)
        _write_new(pub, line, 0o644)
    (directory / TRUSTED_DIR).mkdir(mode=0o755, exist_ok=True)
    ring = KeyRing(directory, host, private)
    ring.refresh()
    return ring
