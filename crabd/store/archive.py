"""Portable checkpoint archives: the format, its manifest, and which process images a host accepts.

An archive is one plain POSIX tar stream (ustar, uncompressed container;
``tar tvf FILE`` lists it), written by ``crabctl checkpoint export`` and read
by ``crabctl checkpoint import`` (docs/checkpoints.md, "Portable archives")::

    crab-archive.json        the manifest (below); always the first member
    blobs/<64 hex>.zst       one per blob: a zstd frame of the blob's content, exactly as the
                             local store holds it (store/fsblobs.py); <hex> = SHA-256 of the content

Every member is a regular file; there is nothing else (no directories,
links, devices, pax or GNU extension headers).  The tar stream (headers,
padding, end marker) is in ``store/archive_tar.py``.

Manifest (JSON, ``format`` = :data:`FORMAT`)::

    {"format": "crab-archive/1",
     "crab_version": "0.1.0", "host": "<exporting host>", "created_at": <unix time>,
     "criu_version": "4.2.1",        -- `criu --version` on the exporting host ("" if it has none)
     "kernel": "6.18.0-...",         -- its kernel release (uname -r)
     "arch": "x86_64",               -- its machine (uname -m)
     "checkpoints": [<record>, ...], -- parent first; a record is a remote manifest's (store/remote/manifest.py)
     "blobs": {"<hex>": <content size>, ...},        -- the closure of every checkpoint's roots
     "edges": {"<parent hex>": ["<child hex>", ...]}, -- which blobs name others (as blob_edges)
     "members": {"blobs/<hex>.zst": {"size": <bytes>, "sha256": "<hex of the member's bytes>"}, ...},
     "seal": "<the exporting host's signature of the rest>"}   -- crabd/trust/seals.py ("" = unsealed)

Each checkpoint record carries ``provenance``, its producer's signed statement
(crabd/trust/provenance.py).  Process images are imported only when the seal and the
record's provenance verify under keys the importing host trusts (see below).

**Process images and the host** (:func:`process_images_refused`).  A CRIU
image records the process state as the dumping kernel exposed it, and it is
restored by replaying it through CRIU on the target: a kernel that lacks a
feature the dumping kernel had (a syscall, an ns or socket option, a vDSO
layout), or an older CRIU that lacks the code for an image field, fails the
restore, or worse restores something subtly different.  So process images
are accepted only when this host's machine architecture is the archive's,
its CRIU is at least the archive's (major.minor), and its kernel release is
at least the archive's (major.minor).  Otherwise the checkpoint still
imports, with its files and session state only (kind ``fs``), and the
result says which images were dropped and why.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crabd import __version__
from crabd.errors import ArchiveRejected
from crabd.models import CheckpointRecord
from crabd.store.blobs import valid_address
from crabd.store.remote.manifest import (
    VOID_SEAL,
    RemoteCheckpoint,
    closure_problem,
    remote_record,
    valid_checkpoint_id,
)

FORMAT = "crab-archive/1"
MANIFEST_NAME = "crab-archive.json"
#: The largest manifest read (a checkpoint line of ~300,000 blobs).
MAX_MANIFEST_BYTES = 64 << 20
#: Checkpoints one archive may hold (a line of history, ancestors included).
MAX_CHECKPOINTS = 10_000
#: Largest blob content accepted (a file extent is at most 4 MiB; CRIU page blobs are bigger).
MAX_BLOB_BYTES = 16 << 30
#: All blob content of one archive together: bounds the time its verification may take.
MAX_CONTENT_BYTES = 256 << 30

_VERSION = re.compile(r"(\d+)\.(\d+)")


def member_name(hex_: str) -> str:
    return f"blobs/{hex_}.zst"


def blob_of(name: str) -> str | None:
    """The blob a member name stands for (None: not a blob member's name)."""
    if name.startswith("blobs/") and name.endswith(".zst"):
        hex_ = name[len("blobs/") : -len(".zst")]
        if valid_address(hex_):
            return hex_
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Member(_Strict):
    size: int = Field(ge=1, le=MAX_BLOB_BYTES * 2)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ArchiveManifest(_Strict):
    format: Literal["crab-archive/1"]
    crab_version: str = Field(max_length=64)
    host: str = Field(max_length=255)
    created_at: float
    criu_version: str = Field(max_length=128)
    kernel: str = Field(max_length=256)
    arch: str = Field(max_length=64)
    checkpoints: list[RemoteCheckpoint] = Field(min_length=1, max_length=MAX_CHECKPOINTS)
    blobs: dict[str, int]
    edges: dict[str, list[str]]
    members: dict[str, Member]
    #: The exporting host's signature of this whole manifest less ``seal`` (crabd/trust/seals.py).
    seal: str = Field(default="", max_length=1 << 20)

    def encode(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()

    def member_bytes(self, blobs: set[str] | None = None) -> int:
        """Bytes of the blob members (of ``blobs`` only, if given)."""
        return sum(m.size for n, m in self.members.items() if blobs is None or blob_of(n) in blobs)


def roots(c: RemoteCheckpoint, *, with_process: bool = True) -> set[str]:
    blobs = (c.index_blob, c.delta_blob, c.session_blob, c.process_blob if with_process else None)
    return {b for b in blobs if b}


def reachable(start: set[str], edges: dict[str, list[str]]) -> set[str]:
    """``start`` and every blob reachable from it through ``edges``."""
    out: set[str] = set()
    todo = list(start)
    while todo:
        b = todo.pop()
        if b not in out:
            out.add(b)
            todo.extend(edges.get(b, ()))
    return out


def decode_manifest(data: bytes) -> ArchiveManifest:
    """Parse and check the manifest member; ArchiveRejected saying what is wrong."""
    try:
        m = ArchiveManifest.model_validate(json.loads(data))
    except (ValueError, ValidationError) as exc:
        raise _bad(f"the archive's manifest is not a crab archive manifest: {str(exc)[:400]}") from exc
    problem = manifest_problem(m)
    if problem:
        raise _bad(f"the archive's manifest is inconsistent: {problem}")
    if data != m.encode():
        # Not byte for byte what crab writes: its seal covers the meaning, so a byte changed without
        # changing the meaning (an escape, a number's spelling) would pass it.  Voided instead.
        m = m.model_copy(update={"seal": VOID_SEAL})
    return m


def manifest_problem(m: ArchiveManifest) -> str:
    """What is wrong with ``m`` ("" if nothing)."""
    seen: set[str] = set()
    every_id = {x.id for x in m.checkpoints}  # once: per checkpoint it made checking 10,000 quadratic
    for c in m.checkpoints:
        if not valid_checkpoint_id(c.id):
            return f"{c.id[:80]!r} is not a checkpoint id"
        if c.id in seen:
            return f"checkpoint {c.id} is listed twice"
        if c.parent_id is not None and c.parent_id in every_id and c.parent_id not in seen:
            return f"checkpoint {c.id} comes before its parent {c.parent_id}"
        seen.add(c.id)
    every_root = {b for c in m.checkpoints for b in roots(c)}
    problem = closure_problem(m.blobs, m.edges, every_root)
    if problem:
        return problem
    if reachable(every_root, m.edges) != m.blobs.keys():
        return "its blob list holds blobs no checkpoint needs"
    if any(size > MAX_BLOB_BYTES for size in m.blobs.values()):
        return f"a blob is larger than {MAX_BLOB_BYTES} bytes"
    if sum(m.blobs.values()) > MAX_CONTENT_BYTES:
        return f"its blobs hold more than {MAX_CONTENT_BYTES} bytes"
    if set(m.members) != {member_name(b) for b in m.blobs}:
        return "its member list is not one member per blob"
    return ""


def _bad(message: str, member: str = MANIFEST_NAME, reason: str = "manifest") -> ArchiveRejected:
    return ArchiveRejected(message, member=member, reason=reason)


# --- the hosts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HostInfo:
    """What an archive records of the host that wrote it, and what an import compares it with."""

    host: str
    criu_version: str
    kernel: str
    arch: str

    @classmethod
    def here(cls, criu_version: str) -> HostInfo:
        u = os.uname()
        return cls(socket.gethostname()[:255], criu_version[:128], u.release, u.machine)


def major_minor(text: str) -> tuple[int, int] | None:
    """The first ``major.minor`` in a version string ("4.2.1" -> (4, 2); "6.18.0-fc" -> (6, 18))."""
    found = _VERSION.search(text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def process_images_refused(archive: HostInfo, here: HostInfo) -> str:
    """Why this host must not restore the archive's process images ("" when it may): see the module doc."""
    if archive.arch != here.arch:
        return f"the archive's process images are for {archive.arch!r}; this host is {here.arch!r}"
    theirs, ours = major_minor(archive.criu_version), major_minor(here.criu_version)
    if theirs is None:
        return f"the archive does not say which CRIU dumped its processes ({archive.criu_version!r})"
    if ours is None:
        return f"this host has no CRIU whose version crab can read ({here.criu_version!r})"
    if ours < theirs:
        return (
            f"the archive's process images were dumped by CRIU {archive.criu_version}; this host's CRIU "
            f"{here.criu_version} is older (at least {theirs[0]}.{theirs[1]} is needed)"
        )
    kt, kh = major_minor(archive.kernel), major_minor(here.kernel)
    if kt is None or kh is None or kh < kt:
        return f"the archive's process images were dumped on kernel {archive.kernel}; this host runs {here.kernel}" + (
            f" (at least {kt[0]}.{kt[1]} is needed)" if kt else ""
        )
    return ""


def new_manifest(
    host: HostInfo,
    recs: list[CheckpointRecord],
    sizes: dict[str, int],
    edges: dict[str, list[str]],
    members: dict[str, Member],
) -> ArchiveManifest:
    """The manifest of ``recs`` (parent first) whose closure is ``sizes`` with ``edges``."""
    return ArchiveManifest(
        format=FORMAT,
        crab_version=__version__,
        host=host.host,
        created_at=time.time(),
        criu_version=host.criu_version,
        kernel=host.kernel,
        arch=host.arch,
        checkpoints=[remote_record(r) for r in recs],
        blobs=dict(sorted(sizes.items())),
        edges={p: sorted(kids) for p, kids in sorted(edges.items()) if kids},
        members=dict(sorted(members.items())),
    )
