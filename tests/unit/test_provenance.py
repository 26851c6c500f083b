"""Host keys, signed provenance and seals (crabd/trust/): what verifies, and every way it must not."""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from crabd.errors import HostError, ProvenanceRefused
from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store import archive
from crabd.store.archive import HostInfo, Member
from crabd.store.remote import manifest as mf
from crabd.trust.keys import KEY_FILE, PUB_FILE, TRUSTED_DIR, KeyRing, open_keyring
from crabd.trust.provenance import Provenance, verify
from crabd.trust.seals import archive_refusals, bucket_refusal, seal_archive, seal_bucket, vet_bucket

H = "ab" * 32


def _hex(n: int) -> str:
    return f"{n:064x}"


def _rec(**kw: object) -> CheckpointRecord:
    fields: dict[str, object] = {
        "id": "ck-0001",
        "sandbox_id": "sb-1",
        "sandbox_name": "one",
        "owner_uid": 1000,
        "parent_id": None,
        "branch": 0,
        "turn": 3,
        "kind": CheckpointKind.FULL,
        "created_at": 1234.5,
        "label": "",
        "image": "crab-env-python:abc",
        "spec_json": '{"env": "python"}',
        "index_blob": _hex(1),
        "delta_blob": _hex(2),
        "session_blob": _hex(3),
        "process_blob": _hex(4),
        "racy_ns": 77,
    }
    fields.update(kw)
    return CheckpointRecord(**fields)  # type: ignore[arg-type]


@pytest.fixture
def ring(tmp_path: Path) -> KeyRing:
    return open_keyring(tmp_path / "a" / "trust", "host-a")


@pytest.fixture
def other(tmp_path: Path) -> KeyRing:
    return open_keyring(tmp_path / "b" / "trust", "host-b")


def _trust(ring: KeyRing, peer: KeyRing) -> None:
    """Copy ``peer``'s public key into ``ring``'s trusted/ as root would."""
    dst = ring.directory / TRUSTED_DIR / f"{peer.host}.pub"
    shutil.copyfile(peer.directory / PUB_FILE, dst)
    os.chmod(dst, 0o644)


# --- keys ------------------------------------------------------------------------------------


def test_the_host_key_is_made_once_private_and_keeps_its_id(tmp_path: Path) -> None:
    d = tmp_path / "trust"
    first = open_keyring(d, "h")
    assert (os.stat(d / KEY_FILE).st_mode & 0o777) == 0o600
    assert (os.stat(d).st_mode & 0o777) == 0o700
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temp file left
    again = open_keyring(d, "h")
    assert again.key_id == first.key_id and len(first.key_id) == 64
    assert (d / PUB_FILE).read_text().startswith("crab-ed25519 ")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_key_others_can_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "trust"
    open_keyring(d, "h")
    os.chmod(d / KEY_FILE, mode)
    with pytest.raises(HostError, match="host signing key"):
        open_keyring(d, "h")


def test_a_symlinked_key_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "trust"
    open_keyring(d, "h")
    (d / KEY_FILE).rename(tmp_path / "elsewhere.key")
    (d / KEY_FILE).symlink_to(tmp_path / "elsewhere.key")
    with pytest.raises(HostError, match="symlink"):
        open_keyring(d, "h")


def test_only_root_only_key_files_become_trusted(ring: KeyRing, other: KeyRing, tmp_path: Path) -> None:
    rec = _rec()
    signed = replace(rec, provenance=Provenance(other).sign(rec))
    assert not verify(ring, signed).trusted
    # Writable by others: a tenant could have put it there.
    _trust(ring, other)
    tfile = ring.directory / TRUSTED_DIR / "host-b.pub"
    os.chmod(tfile, 0o666)
    os.utime(ring.directory / TRUSTED_DIR, ns=(1, 1))  # the directory's mtime is what triggers a re-read
    assert not verify(ring, signed).trusted and "host-b.pub" in ring.ignored
    # A symlink to a good key file: refused too.
    tfile.unlink()
    (tmp_path / "pub").write_bytes((other.directory / PUB_FILE).read_bytes())
    os.chmod(tmp_path / "pub", 0o644)
    tfile.symlink_to(tmp_path / "pub")
    assert not verify(ring, signed).trusted and "symlink" in ring.ignored["host-b.pub"]
    # A plain file, not writable by others: trusted.
    tfile.unlink()
    _trust(ring, other)
    assert verify(ring, signed).trusted
    # A trusted/ directory others can write: nothing in it counts.
    os.chmod(ring.directory / TRUSTED_DIR, 0o777)
    os.utime(ring.directory / TRUSTED_DIR, ns=(2, 2))
    assert not verify(ring, signed).trusted


def test_garbage_key_files_are_ignored(ring: KeyRing) -> None:
    for name, text in {"a.pub": "ssh-ed25519 AAAA", "b.pub": "crab-ed25519 !!!", "c.pub": "crab-ed25519 AAAA"}.items():
        (ring.directory / TRUSTED_DIR / name).write_text(text)
    ring.refresh()
    assert set(ring.ignored) == {"a.pub", "b.pub", "c.pub"} and list(ring.trusted) == [ring.key_id]


# --- provenance ------------------------------------------------------------------------------


def test_own_checkpoints_verify(ring: KeyRing) -> None:
    p = Provenance(ring)
    rec = _rec()
    rec = replace(rec, provenance=p.sign(rec))
    v = p.verify(rec)
    assert v.trusted and v.host == "host-a" and v.key == ring.key_id
    p.require(rec)
    assert p.describe(rec)["trusted"] is True


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("id", "ck-0002"),
        ("image", "crab-env-other:1"),
        ("spec_json", '{"env": "python", "privileged": true}'),
        ("index_blob", _hex(9)),
        ("delta_blob", _hex(9)),
        ("session_blob", _hex(9)),
        ("session_blob", None),
        ("process_blob", _hex(9)),
        ("racy_ns", 78),
        ("branch", 1),
        ("turn", 4),
        ("created_at", 1234.25),
        ("owner_uid", 0),
    ],
)
def test_a_changed_field_fails(ring: KeyRing, name: str, value: object) -> None:
    p = Provenance(ring)
    rec = _rec()
    forged = replace(rec, provenance=p.sign(rec), **{name: value})  # type: ignore[arg-type]
    v = p.verify(forged)
    assert not v.trusted and name in v.reason
    with pytest.raises(ProvenanceRefused) as err:
        p.require(forged)
    assert err.value.checkpoint == forged.id


def test_an_archive_import_keeps_trust_though_the_importer_owns_it(ring: KeyRing) -> None:
    p = Provenance(ring)
    rec = _rec()
    imported = replace(rec, provenance=p.sign(rec), owner_uid=2000, parent_id=None, stats={"archive": True})
    assert p.verify(imported).trusted
    # A dropped image: the files still verify; nothing to refuse at restore.
    dropped = replace(imported, kind=CheckpointKind.FS, process_blob=None)
    assert p.verify(dropped).trusted
    p.require(replace(dropped, provenance=""))


def test_tampered_signatures_and_statements_fail(ring: KeyRing) -> None:
    p = Provenance(ring)
    rec = _rec()
    doc = json.loads(p.sign(rec))

    def with_(**kw: str) -> CheckpointRecord:
        return replace(rec, provenance=json.dumps({**doc, **kw}))

    sig = bytearray(base64.b64decode(doc["sig"]))
    sig[5] ^= 1
    forged_sig = base64.b64encode(bytes(sig)).decode()
    stmt = json.loads(doc["statement"])
    cases = {
        "sig": with_(sig=forged_sig),
        "statement": with_(statement=json.dumps({**stmt, "process_blob": _hex(4)}, indent=1)),
        "key": with_(key="00" * 32),
        "garbage": replace(rec, provenance="{not json"),
        "none": replace(rec, provenance=""),
        "huge": replace(rec, provenance="x" * (5 << 20)),
    }
    for what, forged in cases.items():
        assert not p.verify(forged).trusted, what
        with pytest.raises(ProvenanceRefused):
            p.require(forged)


def test_another_hosts_key_is_unknown_until_root_trusts_it(ring: KeyRing, other: KeyRing) -> None:
    rec = _rec()
    theirs = replace(rec, provenance=Provenance(other).sign(rec))
    v = verify(ring, theirs)
    assert not v.trusted and "does not trust" in v.reason and v.host == "host-b"
    _trust(ring, other)
    assert verify(ring, theirs).trusted


# --- seals -----------------------------------------------------------------------------------


def _archive(ring: KeyRing, rec: CheckpointRecord) -> archive.ArchiveManifest:
    blobs = {b: 10 for b in (rec.index_blob, rec.delta_blob, rec.session_blob, rec.process_blob) if b}
    members = {archive.member_name(b): Member(size=5, sha256=H) for b in blobs}
    return archive.new_manifest(HostInfo("host-a", "4.2.1", "6.18.0", "x86_64"), [rec], blobs, {}, members)


def test_an_archive_seal_covers_every_manifest_field(ring: KeyRing, other: KeyRing) -> None:
    rec = _rec()
    rec = replace(rec, provenance=Provenance(ring).sign(rec))
    m = seal_archive(ring, _archive(ring, rec))
    assert archive_refusals(ring, m) == {}
    # Decoded from its own encoding: still verifies (the seal covers meaning, not one byte string).
    assert archive_refusals(ring, archive.decode_manifest(m.encode())) == {}
    doc = json.loads(m.encode())
    changes: list[Callable[[dict[str, Any]], object]] = [
        lambda d: d.update(kernel="6.99"),
        lambda d: d.update(host="host-z"),
        lambda d: d.update(created_at=1.0),
        lambda d: d["blobs"].update({rec.index_blob: 11}),
        lambda d: d["edges"].update({rec.index_blob: [rec.delta_blob]}),
        lambda d: d["members"][archive.member_name(rec.delta_blob)].update(sha256="cd" * 32),
        lambda d: d["checkpoints"][0].update(label="x"),
        lambda d: d["checkpoints"][0]["stats"].update(new_bytes=1),
        lambda d: d.update(seal=""),
        lambda d: d.update(seal=json.dumps({**json.loads(d["seal"]), "sig": "AAAA"})),
    ]
    for i, change in enumerate(changes):
        forged = json.loads(json.dumps(doc))
        change(forged)
        got = archive_refusals(ring, archive.ArchiveManifest.model_validate(forged))
        assert rec.id in got and "archive" in got[rec.id], i
    # Sealed by a host this one does not trust: refused, whatever the provenance says.
    assert rec.id in archive_refusals(ring, seal_archive(other, _archive(other, rec)))


def test_a_bucket_manifest_is_taken_whole_only_when_sealed_and_signed(ring: KeyRing, other: KeyRing) -> None:
    rec = _rec()
    rec = replace(rec, provenance=Provenance(ring).sign(rec))
    sizes = {b: 10 for b in (rec.index_blob, rec.delta_blob, rec.session_blob, rec.process_blob) if b}
    sizes[_hex(5)] = 3
    m = seal_bucket(ring, mf.build(rec, "host-a", sizes, {rec.process_blob or "": [_hex(5)]}))
    assert bucket_refusal(ring, m) == ""
    decoded = mf.decode(mf.encode(m), expect_id=rec.id)
    assert vet_bucket(ring, decoded) == decoded
    forged = decoded.model_copy(update={"host": "host-z"})
    why = bucket_refusal(ring, forged)
    assert "seal" in why
    less = vet_bucket(ring, forged)
    assert less.checkpoint.process_blob is None and less.checkpoint.kind is CheckpointKind.FS
    assert set(less.blobs) == {rec.index_blob, rec.delta_blob, rec.session_blob} and not less.edges
    assert less.record(parent_id=None).stats["process_image_dropped"] == why
    # Sealed and signed by a host not trusted here.
    theirs = replace(rec, provenance=Provenance(other).sign(rec))
    assert "does not trust" in bucket_refusal(ring, seal_bucket(other, mf.build(theirs, "host-b", sizes, {})))
    # Sealed by a trusted uploader, but the checkpoint's producer is not trusted: no laundering.
    assert "not from a trusted host" in bucket_refusal(ring, seal_bucket(ring, mf.build(theirs, "host-a", sizes, {})))
