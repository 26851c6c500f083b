"""Provenance at the bucket edge: a fetch takes a process image only from a sealed manifest of a trusted
uploader whose checkpoint a trusted host produced; a changed byte of the manifest object never does."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import zstandard

from crabd.config import EngineConfig
from crabd.coordinator.replication import Replication
from crabd.engine import HostEngine
from crabd.errors import CrabError
from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store.remote import manifest as mf
from crabd.trust.keys import PUB_FILE, TRUSTED_DIR, KeyRing, open_keyring
from crabd.trust.provenance import Provenance
from crabd.trust.seals import seal_bucket
from crabd.util.aiolock import RWLock
from tests.fakes import MemoryObjectStore
from tests.unit.test_remote_tier import Host, make_host


def _signed_host(h: Host, ring: KeyRing) -> None:
    """``h`` uploads sealed manifests, as daemon/provenance.py wires a tier."""

    def seal(m: mf.Manifest) -> mf.Manifest:
        return seal_bucket(ring, m)

    h.tier.seal = seal


def _publish(h: Host, ring: KeyRing, cid: str) -> CheckpointRecord:
    rec = h.publish(cid, [b"alpha", b"beta"])
    assert h.catalog.set_provenance(cid, Provenance(ring).sign(rec))
    return h.catalog.get(cid)


def _trust(ring: KeyRing, peer: KeyRing) -> None:
    dst = ring.directory / TRUSTED_DIR / f"{peer.host}.pub"
    shutil.copyfile(peer.directory / PUB_FILE, dst)
    os.chmod(dst, 0o644)


async def _fetch(b: Host, ring: KeyRing | None, cid: str) -> CheckpointRecord:
    async with HostEngine(EngineConfig.model_validate({"bandwidth_mib_s": 0})) as eng:
        rep = Replication(b.tier, eng, RWLock(), max_inflight=1, retry_initial_s=1, retry_max_s=1)
        rep.ring = ring
        return await rep.fetch(cid, lambda _uid: None)


def _manifest_key(objects: MemoryObjectStore, cid: str) -> str:
    (key,) = [k for k in objects.objects if k.endswith(mf.manifest_key(cid))]
    return key


def test_a_trusted_upload_is_fetched_with_its_process_image_an_untrusted_one_without(tmp_path: Path) -> None:
    objects = MemoryObjectStore()
    ra, rb = open_keyring(tmp_path / "ka", "host-a"), open_keyring(tmp_path / "kb", "host-b")
    for a in make_host(tmp_path / "a", "host-a", objects):
        _signed_host(a, ra)
        one = _publish(a, ra, "ck-one")
        a.tier.upload("ck-one")
        two = _publish(a, ra, "ck-two")
        a.tier.upload("ck-two")
    for b in make_host(tmp_path / "b", "host-b", objects):
        got = asyncio.run(_fetch(b, rb, "ck-one"))  # b does not trust a
        assert got.kind is CheckpointKind.FS and got.process_blob is None
        assert "does not trust" in got.stats["process_image_dropped"]
        assert one.process_blob not in b.catalog.live_blobs() and got.provenance == one.provenance
        _trust(rb, ra)
        got = asyncio.run(_fetch(b, rb, "ck-two"))
        assert got.kind is CheckpointKind.FULL and got.process_blob == two.process_blob
        assert "process_image_dropped" not in got.stats


def test_a_changed_byte_in_a_manifest_object_never_brings_the_process_image(tmp_path: Path) -> None:
    objects = MemoryObjectStore()
    ra = open_keyring(tmp_path / "ka", "host-a")
    for a in make_host(tmp_path / "a", "host-a", objects):
        _signed_host(a, ra)
        _publish(a, ra, "ck-one")
        a.tier.upload("ck-one")
    key = _manifest_key(objects, "ck-one")
    real = zstandard.ZstdDecompressor().decompress(objects.objects[key])
    tried = 0
    for i, at in enumerate(range(0, len(real), max(1, len(real) // 80))):
        ch = chr(real[at])
        if not ch.isalnum():
            continue
        forged = bytearray(real)
        forged[at] = ord("1" if ch != "1" else "2") if ch.isdigit() else ord("a" if ch != "a" else "b")
        objects.objects[key] = zstandard.ZstdCompressor().compress(bytes(forged))
        # A host that trusts a (the same key ring: a fetching back its own upload, the strongest case).
        for b in make_host(tmp_path / f"b{i}", "host-b", objects):
            try:
                got = asyncio.run(_fetch(b, ra, "ck-one"))
            except CrabError:
                continue
            assert got.process_blob is None, f"byte {at} ({ch!r}) changed: the process image came"
            tried += 1
    assert tried > 10
    # The object as uploaded still brings it.
    objects.objects[key] = zstandard.ZstdCompressor().compress(real)
    for b in make_host(tmp_path / "b-real", "host-b", objects):
        assert asyncio.run(_fetch(b, ra, "ck-one")).process_blob is not None


@pytest.mark.parametrize("ring", [None, "unsigned"])
def test_without_keys_or_provenance_no_process_image_is_fetched(tmp_path: Path, ring: str | None) -> None:
    objects = MemoryObjectStore()
    ra = open_keyring(tmp_path / "ka", "host-a")
    for a in make_host(tmp_path / "a", "host-a", objects):
        _signed_host(a, ra)
        a.publish("ck-one", [b"alpha"])  # no provenance: published before it existed
        a.tier.upload("ck-one")
    for b in make_host(tmp_path / "b", "host-b", objects):
        got = asyncio.run(_fetch(b, ra if ring else None, "ck-one"))
        assert got.process_blob is None and got.stats["process_image_dropped"]
