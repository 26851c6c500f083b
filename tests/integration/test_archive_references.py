"""Declared references on the real daemon: an archive whose index names another tenant's file by its
address is refused exactly as one naming an address nothing has (crabd/trust/references.py).

Before, both imported: a fork of the first read root's file, and a fork of the second failed, which
told the importer that nobody here had that content.
"""

from __future__ import annotations

import grp
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from crabd.backends.fsdelta import Extent, Kind
from crabd.backends.overlay.entries import decode_page, decode_root, encode_page, encode_root
from crabd.sdk import Client, EmbeddedDaemon
from tests.archive_forge import open_archive
from tests.integration.conftest import USER_IN_GROUP, run_as

SECRET = b"root's secret: " + secrets.token_hex(16).encode() + b"\n"


@pytest.fixture
def archive_dir() -> Iterator[Path]:
    d = Path(f"/tmp/crab-refs-{os.getpid()}")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _forge(data: bytes, target: str, size: int) -> bytes:
    """The archive with one regular file's content replaced by the blob ``target`` (which it cannot carry):
    the page and root re-encoded and re-addressed, every hash right, the declared edges without ``target``."""
    o = open_archive(data)
    ck = o.checkpoint()
    old_root = ck["index_blob"]
    total, pages = decode_root(o.blobs[old_root])
    for i, (page_hex, count) in enumerate(pages):
        entries = decode_page(o.blobs[page_hex])
        j = next((k for k, e in enumerate(entries) if e.kind is Kind.REG and not e.link_to), None)
        if j is None:
            continue
        entries[j] = replace(entries[j], size=size, extents=[Extent(0, size, target)])
        new_page = o.put(encode_page(entries))
        pages[i] = (new_page, count)
        kids = sorted({x.blob for e in entries for x in e.extents} - {target})
        o.doc["edges"][new_page] = kids
        o.doc["blobs"][new_page] = 0
        break
    else:
        raise AssertionError("the archive's index holds no regular file")
    new_root = o.put(encode_root(total, pages))
    ck["index_blob"] = new_root
    o.doc["blobs"][new_root] = 0
    o.doc["edges"][new_root] = sorted(h for h, _ in pages)
    # What nothing names any more leaves the lists (the manifest must stay a closure).
    needed: set[str] = set()
    todo = [ck[k] for k in ("index_blob", "delta_blob", "session_blob", "process_blob") if ck.get(k)]
    while todo:
        b = todo.pop()
        if b not in needed:
            needed.add(b)
            todo.extend(o.doc["edges"].get(b, ()))
    o.doc["blobs"] = {b: 0 for b in o.doc["blobs"] if b in needed}
    o.doc["edges"] = {b: kids for b, kids in o.doc["edges"].items() if b in needed and kids}
    return o.pack()


def test_an_archive_naming_another_tenants_blob_is_refused_like_an_absent_one(
    daemon: EmbeddedDaemon, client: Client, users: dict[str, tuple[int, int]], archive_dir: Path
) -> None:
    victim = client.create("busybox", name="refs-victim", checkpoints="fs")
    source = client.create("busybox", name="refs-source", checkpoints="fs")
    try:
        victim.run(["sh", "-c", f"printf '%s' '{SECRET.decode()}' > /secret"])
        victim.checkpoint()  # root's checkpoint holds the secret's blob
        theirs = hashlib.sha256(SECRET).hexdigest()
        source.run(["sh", "-c", "echo mine > /mine.txt"])
        ck = source.checkpoint()
        real = archive_dir / "real.crab"
        client.export_checkpoint(ck, real)
        data = real.read_bytes()
        client.delete_checkpoint(ck.id)
        source.remove(force=True)
        paths = {}
        for name, target in (("theirs", theirs), ("absent", secrets.token_hex(32))):
            p = archive_dir / f"{name}.crab"
            p.write_bytes(_forge(data, target, len(SECRET)))
            os.chmod(p, 0o644)
            paths[name] = p
        os.chmod(daemon.base, 0o711)
        uid, gid = users[USER_IN_GROUP]
        body = f"""
            attempt("theirs", lambda: c.import_checkpoint({str(paths["theirs"])!r}).checkpoint.id)
            attempt("absent", lambda: c.import_checkpoint({str(paths["absent"])!r}).checkpoint.id)
            """
        res = run_as(uid, gid, [grp.getgrnam("crab").gr_gid], daemon.socket, body)
        kinds = {k: v[0] for k, v in res.items()}  # type: ignore[index]
        assert kinds == {"theirs": "ArchiveRejected", "absent": "ArchiveRejected"}, res
        texts = [re.sub(r"[0-9a-f]{64}", "<blob>", str(res[k][1])) for k in ("theirs", "absent")]  # type: ignore[index]
        assert texts[0] == texts[1] and "does not carry" in texts[0], texts
        assert ck.id not in {c.id for c in client.checkpoints()}  # nothing was imported
    finally:
        for s in client.list():
            if s.name in ("refs-victim", "refs-source") or s.info.owner_uid == users[USER_IN_GROUP][0]:
                s.remove(force=True)
