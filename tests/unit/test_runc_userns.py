"""User namespaces for runc sandboxes without root: host id range claims, the CRIU userns image, bundle config."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import pytest

from crabd.backends.criu.runc import DUMP_OPTIONS
from crabd.backends.network import SANDBOX_SYSCTLS
from crabd.backends.runc import bundle, userns_image
from crabd.backends.runc.cli import EMPTY_NETNS, CheckpointOptions
from crabd.backends.runc.idmap import IdRange
from crabd.config import CrabConfig
from crabd.errors import ContainerRuntimeError, CriuImageInvalid
from crabd.store.idranges import FIRST_BASE, MAX_SLOTS, RANGE_SIZE, IdRanges

# --- the allocator ------------------------------------------------------------------------


def test_claims_are_unique_and_kept_per_owner(tmp_path: Path) -> None:
    r = IdRanges(tmp_path / "u")
    a, b = r.claim("i1-a-g1"), r.claim("i1-b-g1")
    assert (a.base, b.base) == (FIRST_BASE, FIRST_BASE + RANGE_SIZE) and a.size == RANGE_SIZE
    assert r.claim("i1-a-g1") == a  # a retried start keeps its range
    assert r.find("i1-b-g1") == b and r.find("nobody") is None
    assert set(r.owners("i1-")) == {"i1-a-g1", "i1-b-g1"} and r.owners("i2-") == {}
    assert r.release("i1-a-g1") and not r.release("i1-a-g1")
    assert r.claim("i1-c-g1").base == FIRST_BASE  # the freed slot serves the next
    # Survives a restart: a new allocator over the same directory sees the claims.
    again = IdRanges(tmp_path / "u")
    assert again.find("i1-b-g1") == b and again.find("i1-c-g1") is not None


def test_claims_are_unique_across_threads_and_allocators(tmp_path: Path) -> None:
    d = tmp_path / "u"
    got: list[int] = []
    lock = threading.Lock()

    def take(i: int) -> None:
        c = IdRanges(d).claim(f"x-{i}-g")  # one allocator each: as two crabd instances
        with lock:
            got.append(c.base)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 16


def test_exhausted_ranges_say_so_and_bad_owners_are_refused(tmp_path: Path) -> None:
    r = IdRanges(tmp_path / "u", slots=2)
    r.claim("a")
    r.claim("b")
    with pytest.raises(ContainerRuntimeError, match="no free user-namespace id range"):
        r.claim("c")
    for bad in ("", "a\nb", "x" * 300, "a/b", "..", ".hidden"):
        with pytest.raises(ContainerRuntimeError):
            r.claim(bad)
    assert FIRST_BASE + (MAX_SLOTS + 1) * RANGE_SIZE <= 2**32 - 1  # the last range ends below "no id"
    with pytest.raises(ValueError):
        IdRanges(tmp_path, slots=0)


def test_a_foreign_file_in_the_claims_dir_is_no_claim(tmp_path: Path) -> None:
    d = tmp_path / "u"
    d.mkdir()
    (d / "0").write_bytes(b"\xff not json")
    (d / "notes").write_text("x")
    r = IdRanges(d)
    assert r.owners() == {} and r.claim("a").base == FIRST_BASE + RANGE_SIZE  # slot 0 stays taken


def test_a_claim_or_lookup_reads_no_other_claim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A host with a thousand sandboxes: a create must not read a thousand claim files.
    r = IdRanges(tmp_path / "u")
    for i in range(40):
        r.claim(f"i1-s{i}-g1")
    reads: list[int] = []
    real = IdRanges._read

    def counted(self: IdRanges, slot: int) -> str | None:
        reads.append(slot)
        return real(self, slot)

    monkeypatch.setattr(IdRanges, "_read", counted)
    fresh = r.claim("i1-new-g1")
    assert fresh.slot == 40 and reads == []
    assert r.find("i1-s7-g1") == r.claim("i1-s7-g1") and reads == [7, 7]
    assert r.release("i1-s3-g1") and reads[-1] == 3 and len(reads) == 3


def test_claims_without_an_index_entry_are_still_found_by_release(tmp_path: Path) -> None:
    d = tmp_path / "u"
    r = IdRanges(d)
    a = r.claim("i1-a-g1")
    # As a claim made before the index existed, or a crash between the claim and its entry.
    (d / "owners" / "i1-a-g1").unlink()
    assert r.find("i1-a-g1") is None and r.owners("i1-") == {"i1-a-g1": a}
    assert r.release("i1-a-g1") and not (d / str(a.slot)).exists() and r.owners() == {}


def test_a_stale_index_entry_is_not_believed(tmp_path: Path) -> None:
    d = tmp_path / "u"
    r = IdRanges(d)
    a, b = r.claim("i1-a-g1"), r.claim("i1-b-g1")
    (d / "owners" / "i1-a-g1").write_text(str(b.slot))  # names b's claim
    assert r.find("i1-a-g1") is None
    (d / "owners" / "i1-a-g1").write_text("junk")
    assert r.find("i1-a-g1") is None
    (d / "owners" / "i1-a-g1").unlink()
    (d / "owners" / "i1-a-g1").symlink_to(d / "owners" / "i1-b-g1")
    assert r.find("i1-a-g1") is None  # O_NOFOLLOW
    # release falls back to the claims themselves and frees a's, never b's.
    assert r.release("i1-a-g1") and not (d / str(a.slot)).exists() and r.find("i1-b-g1") == b
    assert not r.release("../u/i1-b-g1") and r.find("i1-b-g1") == b


# --- the CRIU user namespace image --------------------------------------------------------


def _image(uid: tuple[userns_image.Extent, ...], gid: tuple[userns_image.Extent, ...] | None = None) -> bytes:
    return userns_image.encode(userns_image.UsernsEntry(uid, gid if gid is not None else uid))


#: What CRIU 4.2.1 wrote here for a container mapped "0 2000000 65536" (xxd of userns-14.img).
CRIU_BYTES = bytes.fromhex("1943565406494755180000000a0a08001080897a18808004120a08001080897a18808004")


def test_parses_what_criu_wrote_and_encodes_it_back() -> None:
    e = userns_image.parse(CRIU_BYTES, Path("userns-14.img"))
    assert e.uid_map == e.gid_map == (userns_image.Extent(0, 2_000_000, 65536),)
    assert userns_image.encode(e) == CRIU_BYTES


def test_retarget_writes_the_containers_range_and_breaks_hard_links(tmp_path: Path) -> None:
    images = tmp_path / "img"
    images.mkdir()
    cache = tmp_path / "cache-userns"
    # A forged dump asking for host root: the mapping is replaced whatever it said.
    cache.write_bytes(_image((userns_image.Extent(0, 0, 4294967295),)))
    os.link(cache, images / "userns-14.img")
    userns_image.retarget(images, FIRST_BASE, RANGE_SIZE)
    got = userns_image.read(images)
    assert got is not None and got.uid_map == got.gid_map == (userns_image.Extent(0, FIRST_BASE, RANGE_SIZE),)
    assert userns_image.parse(cache.read_bytes(), cache).uid_map[0].lower_first == 0  # the cache keeps its copy
    assert not list(images.glob(".*tmp"))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        CRIU_BYTES[:-1],  # truncated
        CRIU_BYTES[:4] + b"\0\0\0\0" + CRIU_BYTES[8:],  # another image's magic
        CRIU_BYTES[:8] + struct.pack("<I", 999) + CRIU_BYTES[12:],  # size beyond the file
        CRIU_BYTES + b"\x18\x01",  # an unknown field after the entry
        _image((), ()),  # no map at all
        b"\0" * 5000,
    ],
)
def test_bad_userns_images_are_refused(tmp_path: Path, data: bytes) -> None:
    images = tmp_path / "img"
    images.mkdir()
    (images / "userns-14.img").write_bytes(data)
    with pytest.raises(CriuImageInvalid):
        userns_image.retarget(images, FIRST_BASE, RANGE_SIZE)


def test_retarget_wants_exactly_one_userns_image(tmp_path: Path) -> None:
    images = tmp_path / "img"
    images.mkdir()
    assert userns_image.read(images) is None
    with pytest.raises(CriuImageInvalid):
        userns_image.retarget(images, FIRST_BASE, RANGE_SIZE)
    for n in (14, 15):
        (images / f"userns-{n}.img").write_bytes(CRIU_BYTES)
    with pytest.raises(CriuImageInvalid, match="2 user"):
        userns_image.retarget(images, FIRST_BASE, RANGE_SIZE)


# --- the bundle -------------------------------------------------------------------------


def _spec(**kw: object) -> bundle.ContainerSpec:
    base: dict[str, object] = {"id": "sb1", "netns": Path("/run/crab/netns/sb1"), "init_binary": Path("/x/init")}
    return bundle.ContainerSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_a_userns_bundle_maps_root_and_owns_its_netns() -> None:
    ids = IdRange(FIRST_BASE, RANGE_SIZE)
    spec = _spec(userns=ids, networked=True)
    cfg = bundle.config(spec, Path("/b/sb1"), {})
    ns = cfg["linux"]["namespaces"]
    assert {"type": "user"} in ns and {"type": "network"} in ns  # runc's own netns, inside the user namespace
    assert not any("path" in n for n in ns)
    want = [{"containerID": 0, "hostID": FIRST_BASE, "size": RANGE_SIZE}]
    assert cfg["linux"]["uidMappings"] == cfg["linux"]["gidMappings"] == want
    assert cfg["linux"]["sysctl"] == {}  # crabd sets SANDBOX_SYSCTLS in the pinned netns
    assert set(spec.namespaces) == {"pid", "ipc", "uts", "mount", "cgroup", "network", "user"}
    # PID 1 is crab-init's keeper: CRIU must be able to dump a restored tree again (crab-init.c, "PID 1 keeper").
    assert cfg["process"]["args"] == ["/.crab/init", "--keeper"]
    # Without: the old shape (a crabd-made netns by path, runc's sysctls, no mappings).
    plain = bundle.config(_spec(networked=True), Path("/b/sb1"), {})
    assert "uidMappings" not in plain["linux"] and plain["linux"]["sysctl"] == dict(SANDBOX_SYSCTLS)
    assert plain["process"]["args"] == ["/.crab/init"]
    assert "user" not in _spec().namespaces


def test_etc_files_are_named_where_the_idmapped_view_is(tmp_path: Path) -> None:
    spec = _spec(userns=IdRange(FIRST_BASE, RANGE_SIZE), networked=True, hostname="box")
    view = Path("/run/crab-rootfs/sb1/etc")
    b = bundle.write(spec, tmp_path / "bundles", etc_dir=tmp_path / "etc", etc_seen_at=view)
    mounts = {m["destination"]: m for m in json.loads(b.config_path.read_text())["mounts"]}
    assert mounts["/etc/hostname"]["source"] == str(view / "hostname")
    assert (tmp_path / "etc" / "hostname").read_text() == "box\n"


def test_idrange_and_dump_options() -> None:
    assert IdRange(FIRST_BASE, 10).map_line() == f"0 {FIRST_BASE} 10\n"
    for bad in ((0, 10), (5, 0), (2**32 - 5, 10)):
        with pytest.raises(ContainerRuntimeError):
            IdRange(*bad)
    assert CheckpointOptions(empty_ns_network=True).argv() == (*DUMP_OPTIONS, *EMPTY_NETNS)
    assert CheckpointOptions().argv() == DUMP_OPTIONS


def test_userns_is_on_by_default_with_an_off_switch() -> None:
    assert CrabConfig().runtime.userns is True
    assert CrabConfig.model_validate({"runtime": {"userns": False}}).runtime.userns is False


def test_doctor_reports_userns(tmp_path: Path) -> None:
    from crabd.host.backend_check import check_userns

    limit = tmp_path / "max"
    limit.write_text("100\n")
    on = CrabConfig.model_validate({"runtime": {"userns": True, "userns_dir": str(tmp_path / "u")}})
    IdRanges(tmp_path / "u").claim("a-b-c")
    got = check_userns(on, limit).as_dict()
    assert got["status"] == "ok" and "1 ranges held" in got["summary"]
    limit.write_text("0\n")
    assert check_userns(on, limit).as_dict()["status"] == "fail"
    off = CrabConfig.model_validate({"runtime": {"userns": False}})
    assert check_userns(off, limit).as_dict()["status"] == "warn"
    docker = CrabConfig.model_validate({"runtime": {"backend": "docker"}})
    assert "not used" in check_userns(docker, limit).as_dict()["summary"]
