"""Portable archives as hostile input: the tar reader refuses every malformed or lying archive, and writes
nothing but verified frames into its staging dir; the writer's archives round-trip; the compatibility rule."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard

from crabd.errors import ArchiveRejected
from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store import archive
from crabd.store.archive import ArchiveManifest, HostInfo, Member, member_name, process_images_refused
from crabd.store.archive_tar import ArchiveReader, frame_member, iter_archive
from crabd.store.fsblobs import FileBlobStore

HOST = HostInfo("here", "4.2.1", "6.18.0-fc-1", "x86_64")


def _rec(ckpt_id: str, index: str, delta: str, session: str | None, process: str | None = None) -> CheckpointRecord:
    return CheckpointRecord(
        id=ckpt_id,
        sandbox_id="sb-1",
        sandbox_name="web",
        owner_uid=1000,
        parent_id=None,
        branch=0,
        turn=1,
        kind=CheckpointKind.FULL if process else CheckpointKind.FS,
        created_at=1.0,
        label="",
        image="crab-env/bookworm:x",
        spec_json="{}",
        index_blob=index,
        delta_blob=delta,
        session_blob=session,
        process_blob=process,
    )


class World:
    """A blob store with one checkpoint (index -> two contents, delta, session) and its archive."""

    def __init__(self, root: Path) -> None:
        self.store = FileBlobStore(root / "blobs")
        big = bytes(range(256)) * 8192  # 2 MiB: streamed through several pieces
        self.contents = {self.store.put_bytes(d).hex: d for d in (b"hello\n", big, b"delta", b'{"cwd":"/"}')}
        keys = list(self.contents)
        index = self.store.put_bytes(b"index:" + keys[0].encode() + keys[1].encode()).hex
        self.contents[index] = b"index:" + keys[0].encode() + keys[1].encode()
        self.rec = _rec("ck-0001", index, keys[2], keys[3])
        self.edges = {index: sorted(keys[:2])}
        self.sizes = {h: len(d) for h, d in self.contents.items()}

    def frame(self, hex_: str) -> bytes:
        return self.store.path(hex_).read_bytes()

    def manifest(self, **change: object) -> ArchiveManifest:
        members = {member_name(h): frame_member(io.BytesIO(self.frame(h))) for h in self.sizes}
        m = archive.new_manifest(HOST, [self.rec], self.sizes, self.edges, members)
        return m.model_copy(update=change) if change else m

    def archive(self, m: ArchiveManifest | None = None) -> bytes:
        return b"".join(iter_archive(m or self.manifest(), lambda h: open(self.store.path(h), "rb")))


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def _read(data: bytes, staging: Path, *, chunk: int = 4096, wanted: set[str] | None = None) -> dict[str, Path]:
    staging.mkdir(exist_ok=True)
    reader = ArchiveReader(data[i : i + chunk] for i in range(0, len(data), chunk))
    m = reader.manifest()
    return reader.stage(m, staging, set(m.blobs) if wanted is None else wanted)


def _refused(data: bytes, staging: Path, reason: str, member: str | None = None) -> ArchiveRejected:
    with pytest.raises(ArchiveRejected) as info:
        _read(data, staging)
    assert info.value.reason == reason, info.value.message
    if member is not None:
        assert info.value.member == member
    return info.value


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]], fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _special(name: str, kind: bytes, target: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def _members(world: World, m: ArchiveManifest) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    return [_file(archive.MANIFEST_NAME, m.encode()), *(_file(member_name(h), world.frame(h)) for h in m.blobs)]


# --- the round trip ------------------------------------------------------------------------


def test_an_archive_round_trips_and_tar_lists_it(world: World, tmp_path: Path) -> None:
    data = world.archive()
    assert len(data) % tarfile.RECORDSIZE == 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
        assert names[0] == archive.MANIFEST_NAME
        assert sorted(names[1:]) == sorted(member_name(h) for h in world.sizes)
        assert all(t.isreg() for t in tar.getmembers())
    for chunk in (1, 511, 512, 4096, 1 << 20):
        staging = tmp_path / f"stage-{chunk}"
        staged = _read(data, staging, chunk=chunk)
        assert set(staged) == set(world.sizes)
        for hex_, path in staged.items():
            assert path.read_bytes() == world.frame(hex_)
    manifest = ArchiveReader([data]).manifest()
    assert manifest.checkpoints[0].id == "ck-0001" and manifest.criu_version == "4.2.1"


def test_only_wanted_blobs_are_staged(world: World, tmp_path: Path) -> None:
    one = next(iter(world.sizes))
    staged = _read(world.archive(), tmp_path / "s", wanted={one})
    assert list(staged) == [one] and [p.name for p in (tmp_path / "s").iterdir()] == [one]


# --- hostile archives ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("special", "what"),
    [
        (lambda: _special("blobs/x", tarfile.SYMTYPE, "/etc/shadow"), "symbolic link"),
        (lambda: _special("crab-archive.json", tarfile.LNKTYPE, "/etc/shadow"), "hard link"),
        (lambda: _special("dev", tarfile.CHRTYPE), "character device"),
        (lambda: _special("blk", tarfile.BLKTYPE), "block device"),
        (lambda: _special("fifo", tarfile.FIFOTYPE), "fifo"),
        (lambda: _special("blobs", tarfile.DIRTYPE), "directory"),
    ],
)
def test_members_that_are_not_regular_files_are_refused(
    world: World, tmp_path: Path, special: Callable[[], tuple[tarfile.TarInfo, None]], what: str
) -> None:
    m = world.manifest()
    for position in (0, 1, 3):  # first, right after the manifest, among the blobs
        members = _members(world, m)
        members.insert(position, special())
        err = _refused(_tar(members), tmp_path / "s", "member")
        assert what in err.message
    # The staging dir holds only frames verified before the bad member (the importer removes it whole).
    assert all(f.read_bytes() == world.frame(f.name) for f in (tmp_path / "s").iterdir())


@pytest.mark.parametrize(
    "name", ["/etc/passwd", "../../etc/cron.d/x", "blobs/../../x", "blobs/abc.zst", "notes.txt", "blobs/"]
)
def test_unexpected_or_escaping_names_are_refused(world: World, tmp_path: Path, name: str) -> None:
    m = world.manifest()
    members = _members(world, m)
    members.insert(2, _file(name, b"x"))
    _refused(_tar(members, tarfile.GNU_FORMAT), tmp_path / "s", "member")


def test_a_pax_header_is_refused(world: World, tmp_path: Path) -> None:
    m = world.manifest()
    members = _members(world, m)
    members.insert(1, _file("blobs/" + "a" * 200, b"x"))  # a long name: tarfile writes a pax header
    _refused(_tar(members, tarfile.PAX_FORMAT), tmp_path / "s", "member")


def test_the_manifest_must_come_first_and_once(world: World, tmp_path: Path) -> None:
    m = world.manifest()
    members = _members(world, m)
    _refused(_tar(members[1:] + members[:1]), tmp_path / "a", "member")
    _refused(_tar(members + members[:1]), tmp_path / "b", "member")


def test_a_duplicate_blob_member_is_refused(world: World, tmp_path: Path) -> None:
    members = _members(world, world.manifest())
    err = _refused(_tar(members + members[1:2]), tmp_path / "s", "member")
    assert "twice" in err.message


def test_a_truncated_archive_is_refused_wherever_it_is_cut(world: World, tmp_path: Path) -> None:
    data = world.archive()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.getmembers()
        marker = tar.offset  # where the end marker starts: the zero padding after it may be absent
    cuts = {0, 100, 512, 700, 1024, 4000, 9000, marker // 2, marker - 1, marker, marker + 512, marker + 1023}
    for i, cut in enumerate(sorted(cuts)):
        err = _refused(data[:cut], tmp_path / f"s{i}", "truncated")
        assert err.member in ("", archive.MANIFEST_NAME) or err.member.startswith("blobs/")


def test_data_after_the_end_marker_is_refused(world: World, tmp_path: Path) -> None:
    _refused(world.archive() + b"\x01", tmp_path / "s", "member")
    _refused(world.archive() + bytes(tarfile.RECORDSIZE + 1), tmp_path / "t", "member")


def test_a_damaged_header_checksum_is_refused(world: World, tmp_path: Path) -> None:
    data = bytearray(world.archive())
    data[0] ^= 0x20
    _refused(bytes(data), tmp_path / "s", "member")


def test_a_corrupted_blob_is_refused(world: World, tmp_path: Path) -> None:
    data = world.archive()
    frame = world.frame(next(iter(world.sizes)))
    at = data.index(frame) + len(frame) // 2
    bad = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
    err = _refused_any(bad, tmp_path / "s")
    assert err.reason in ("hash", "frame")


def _refused_any(data: bytes, staging: Path) -> ArchiveRejected:
    with pytest.raises(ArchiveRejected) as info:
        _read(data, staging)
    return info.value


def test_a_member_hash_that_does_not_match_is_refused(world: World, tmp_path: Path) -> None:
    m = world.manifest()
    victim = member_name(next(iter(m.blobs)))
    members = {**m.members, victim: Member(size=m.members[victim].size, sha256="0" * 64)}
    _refused(_lying(world, m, members), tmp_path / "s", "hash", victim)


def test_a_blob_whose_content_is_not_its_address_is_refused(world: World, tmp_path: Path) -> None:
    """A consistent manifest naming content under the wrong address: the frame decompresses fine."""
    m = world.manifest()
    hexes = list(world.sizes)
    a, b = hexes[2], hexes[3]  # delta and session: swap their frames under each other's names
    members = _members(world, m)
    swapped = []
    for info, data in members:
        if info.name == member_name(a):
            data = world.frame(b)
        elif info.name == member_name(b):
            data = world.frame(a)
        swapped.append((info, data))
    # Make the member hashes and sizes agree with the swapped frames, so only the content check can notice.
    fixed = {
        **m.members,
        member_name(a): frame_member(io.BytesIO(world.frame(b))),
        member_name(b): frame_member(io.BytesIO(world.frame(a))),
    }
    sizes = {**m.blobs, a: m.blobs[b], b: m.blobs[a]}
    m2 = m.model_copy(update={"members": fixed, "blobs": sizes})
    swapped[0] = _file(archive.MANIFEST_NAME, m2.encode())
    err = _refused_any(_tar(swapped), tmp_path / "s")
    assert err.reason in ("hash", "size")


def test_a_manifest_lying_about_a_member_size_is_refused(world: World, tmp_path: Path) -> None:
    m = world.manifest()
    victim = member_name(next(iter(m.blobs)))
    members = {**m.members, victim: Member(size=m.members[victim].size + 1, sha256=m.members[victim].sha256)}
    _refused(_lying(world, m, members), tmp_path / "s", "size", victim)


def _lying(world: World, m: ArchiveManifest, members: dict[str, Member]) -> bytes:
    """The real frames, under a manifest that says other things about them."""
    lie = m.model_copy(update={"members": members})
    return _tar([_file(archive.MANIFEST_NAME, lie.encode()), *_members(world, m)[1:]])


def test_a_manifest_lying_about_a_content_size_is_refused(world: World, tmp_path: Path) -> None:
    m = world.manifest()
    big = max(m.blobs, key=lambda h: m.blobs[h])
    for i, wrong in enumerate((m.blobs[big] - 1, m.blobs[big] + 1, 0)):
        lie = m.model_copy(update={"blobs": {**m.blobs, big: wrong}})
        data = _tar([_file(archive.MANIFEST_NAME, lie.encode()), *_members(world, m)[1:]])
        err = _refused_any(data, tmp_path / f"s{i}")
        assert err.reason in ("size", "hash") and err.member == member_name(big)


def _zeros_frame(size: int, *, declare: bool) -> bytes:
    """A zstd frame of ``size`` zero bytes, its content size in the header or not, made without holding them."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(out, size=size if declare else -1, closefd=False) as w:
        for _ in range(size // (1 << 24)):
            w.write(bytes(1 << 24))
    return out.getvalue()


def test_a_zstd_bomb_is_refused_before_it_inflates(world: World, tmp_path: Path) -> None:
    """A frame of 256 MiB of zeros (a few KiB) under a manifest that says 10 bytes, its size declared or not."""
    for declare in (True, False):
        frame = _zeros_frame(256 << 20, declare=declare)
        assert len(frame) < 1 << 20
        hex_ = hashlib.sha256(b"x" * 10).hexdigest()
        rec = _rec("ck-0002", hex_, hex_, None)
        m = archive.new_manifest(HOST, [rec], {hex_: 10}, {}, {member_name(hex_): frame_member(io.BytesIO(frame))})
        data = _tar([_file(archive.MANIFEST_NAME, m.encode()), _file(member_name(hex_), frame)])
        err = _refused(data, tmp_path / f"s{declare}", "size", member_name(hex_))
        assert "10" in err.message


def test_a_huge_manifest_is_refused_unread(tmp_path: Path) -> None:
    info = tarfile.TarInfo(archive.MANIFEST_NAME)
    info.size = archive.MAX_MANIFEST_BYTES + 1
    header = info.tobuf(format=tarfile.USTAR_FORMAT)
    consumed = []

    def chunks() -> object:
        yield header
        while True:  # an endless stream: the reader must stop at the header
            consumed.append(1)
            yield b"{" * 65536

    reader = ArchiveReader(chunks())  # type: ignore[arg-type]
    with pytest.raises(ArchiveRejected) as err:
        reader.manifest()
    assert err.value.reason == "size" and not consumed


@pytest.mark.parametrize(
    "change",
    [
        lambda m: {"format": "crab-archive/2"},
        lambda m: {"blobs": {**m.blobs, "f" * 64: 1}},  # a blob nothing needs
        lambda m: {"blobs": {k: v for k, v in list(m.blobs.items())[1:]}},  # a root missing
        lambda m: {"members": {k: v for k, v in list(m.members.items())[1:]}},
        lambda m: {"edges": {next(iter(m.edges)): ["0" * 64]}},
        lambda m: {"checkpoints": [*m.checkpoints, m.checkpoints[0]]},
        lambda m: {"checkpoints": [m.checkpoints[0].model_copy(update={"id": "../../etc"})]},
    ],
)
def test_an_inconsistent_manifest_is_refused(
    world: World, tmp_path: Path, change: Callable[[ArchiveManifest], dict[str, object]]
) -> None:
    m = world.manifest()
    doc = json.loads(m.encode())
    doc.update(json.loads(json.dumps(change(m), default=lambda o: o.model_dump(mode="json"))))
    data = _tar([_file(archive.MANIFEST_NAME, json.dumps(doc).encode()), *_members(world, m)[1:]])
    _refused(data, tmp_path / "s", "manifest", archive.MANIFEST_NAME)


def test_parents_must_come_first(world: World) -> None:
    child = world.rec.__class__(**{**world.rec.__dict__, "id": "ck-0002", "parent_id": "ck-0001"})
    m = archive.new_manifest(HOST, [child, world.rec], world.sizes, world.edges, world.manifest().members)
    assert "before its parent" in archive.manifest_problem(m)


# --- which process images a host accepts -------------------------------------------------------


@pytest.mark.parametrize(
    ("theirs", "ours", "ok"),
    [
        (("4.2.1", "6.18.0", "x86_64"), ("4.2.1", "6.18.0-fc-1", "x86_64"), True),
        (("4.2", "6.1.0", "x86_64"), ("4.3.0", "6.18.0", "x86_64"), True),  # newer CRIU and kernel here
        (("4.2.1", "6.18.3", "x86_64"), ("4.2.0", "6.18.0", "x86_64"), True),  # patch levels do not count
        (("4.3.0", "6.18.0", "x86_64"), ("4.2.1", "6.18.0", "x86_64"), False),  # older CRIU here
        (("4.2.1", "6.19.0", "x86_64"), ("4.2.1", "6.18.0", "x86_64"), False),  # older kernel here
        (("4.2.1", "6.18.0", "aarch64"), ("4.2.1", "6.18.0", "x86_64"), False),  # another architecture
        (("", "6.18.0", "x86_64"), ("4.2.1", "6.18.0", "x86_64"), False),  # the archive does not say
        (("4.2.1", "6.18.0", "x86_64"), ("", "6.18.0", "x86_64"), False),  # no CRIU here
    ],
)
def test_process_images_need_the_same_arch_and_at_least_the_criu_and_kernel(
    theirs: tuple[str, str, str], ours: tuple[str, str, str], ok: bool
) -> None:
    why = process_images_refused(HostInfo("a", *theirs), HostInfo("b", *ours))
    assert (why == "") is ok, why
    if not ok:
        assert why  # a sentence the CLI prints


def test_the_refusal_names_the_versions() -> None:
    why = process_images_refused(HostInfo("a", "9.1.0", "6.18.0", "x86_64"), HOST)
    assert "CRIU 9.1.0" in why and "4.2.1" in why and "9.1" in why
