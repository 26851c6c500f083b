"""The remote tier's view of an object store: a bucket of immutable keys.

The remote tier needs very little of S3, and asks for less than it offers,
so that any S3-compatible store (AWS, MinIO, Ceph, moto in tests) serves it
and an in-memory fake stands in for it in unit tests (``tests/fakes.py``):

* **Keys are written once.**  :meth:`ObjectStore.put_if_absent` is a
  conditional put (``If-None-Match: *``): the store itself refuses to
  replace an existing object, so two hosts racing to upload the same
  content-addressed blob cannot corrupt it, and no reader ever sees an
  object change.  Nothing is ever overwritten; "update" does not exist.
* **Existence is the only state.**  A key is there (with the bytes first
  written under it) or it is not.  Writers put what an object depends on
  before the object that names it, so "visible" implies "complete".
* **Deletes are idempotent** and only ever remove garbage: deleting a key
  that is gone is not an error.
* **Reads are bounded.**  :meth:`ObjectStore.get` takes a ``limit`` and
  refuses a bigger object before reading it: the bucket is shared, so its
  contents are untrusted input to this host.

Keys are relative: the implementation prepends its configured prefix
(``[remote] prefix``) and strips it from what :meth:`ObjectStore.list`
returns.  :func:`check_key` says what a key may look like.

Every failure is a :class:`~crabd.errors.RemoteStoreError` (or its
:class:`~crabd.errors.RemoteObjectMissing`); its ``retryable`` tells an
outage (try again later) from a refusal that needs a fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from crabd.errors import CrabError

#: S3's limit on a whole key (prefix included), in UTF-8 bytes.
MAX_KEY_BYTES = 1024


def check_key(key: str) -> str:
    """``key`` if it is a valid relative key, else ``CrabError`` (keys are crab's own, so a bad one is a bug).

    A key is non-empty ASCII-printable text of ``/``-separated segments, none
    empty, ``.`` or ``..``: the same key then means the same object on every
    store, whatever it does with odd names (some normalise ``a//b`` or ``./``).
    """
    if not key or len(key.encode()) > MAX_KEY_BYTES - 256:
        raise CrabError(f"invalid remote key {key!r}: empty or longer than {MAX_KEY_BYTES - 256} bytes")
    if not all(0x20 < ord(c) < 0x7F and c != "\\" for c in key):
        raise CrabError(f"invalid remote key {key!r}: only printable ASCII without spaces or backslashes")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise CrabError(f"invalid remote key {key!r}: an empty, '.' or '..' segment")
    return key


def check_list_prefix(prefix: str) -> str:
    """``prefix`` if :meth:`ObjectStore.list` may take it: empty, or a key's start (``blobs/``, ``blobs/ab``)."""
    if prefix:
        check_key(prefix.rstrip("/") or "/")
        if prefix.endswith("//"):
            raise CrabError(f"invalid remote list prefix {prefix!r}")
    return prefix


class ObjectStore(Protocol):
    """A bucket of immutable keys (see the module's docstring).  Implementations are thread-safe.

    Every method raises :class:`~crabd.errors.RemoteStoreError` when the
    store fails; ``retryable`` on it says whether trying again may help.
    """

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data`` unless it exists: True if this call created it, False if it was there.

        False also when an earlier attempt of this same call created it and
        its reply was lost (the store's retry then finds the key): the key
        holds the bytes of whoever wrote it first.  For content-addressed
        keys that is the same bytes.
        """
        ...

    def get(self, key: str, *, limit: int) -> bytes:
        """The bytes of ``key``; ``RemoteObjectMissing`` if absent, ``RemoteStoreError`` if over ``limit`` bytes."""
        ...

    def exists(self, key: str) -> bool:
        """Whether ``key`` is in the store now."""
        ...

    def list(self, prefix: str) -> Iterator[str]:
        """Every key starting with ``prefix`` (``""``: all), relative, in the store's (lexicographic) order.

        Lazy: the store is asked one page at a time as the iterator is consumed.
        """
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; nothing happens if it is not there."""
        ...

    def describe(self) -> str:
        """Where the objects are, for messages and logs (``s3://bucket/prefix at URL``)."""
        ...

    def close(self) -> None:
        """Release connections; the store is unusable afterwards.  Idempotent."""
        ...
