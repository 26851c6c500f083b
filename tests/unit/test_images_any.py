"""Any image (issue 36): the image reference's checks, the archive checks, and digests on fake backends."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from crabd.backends import image_archive
from crabd.errors import ArchiveRejected, ImageError, InvalidRequest, PermissionDenied
from crabd.models import CheckpointKind, SandboxSpec
from crabd.sdk import CreateOptions
from crabd.service.images import image_source
from crabd.util import validate
from tests.fakes import ALICE, Stack, build_stack, engine_running, run, spec

DIGEST = "sha256:" + "ab" * 32

# --- the reference -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ref",
    [
        "debian:12",
        "busybox",
        "registry.local:5000/team/tool:v1.2-rc_3",
        "debian@" + DIGEST,
        DIGEST,
        "6cf6cfe3e74c",
        "/srv/images/tool.tar",
        "/home/alice/oci layout",
    ],
)
def test_image_references_crab_takes(ref: str) -> None:
    assert validate.image_ref(ref) == ref


@pytest.mark.parametrize(
    "ref",
    [
        "",
        "-v",
        "--privileged",
        "-",
        ".hidden",
        "a b",
        "a//b",
        "x" * 256,
        "tool;rm -rf /",
        "tool$(id)",
        "./tool.tar",
        "tool.tar\n",
        "/srv/../etc/shadow",
        "/srv/x\x00y",
        "/srv/x\ny",
        "/" + "a" * 4096,
        "débian",
    ],
)
def test_image_references_refused(ref: str) -> None:
    with pytest.raises(InvalidRequest):
        validate.image_ref(ref)


def test_a_reference_that_is_not_text_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        validate.image_ref(3)


def test_the_sdk_checks_the_image_before_sending_and_makes_a_path_absolute(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        CreateOptions(image="--privileged").request()
    assert CreateOptions(image="debian:12").request().image == "debian:12"
    assert CreateOptions("bookworm").request().image == ""
    os.chdir(tmp_path)
    assert CreateOptions(image=Path("x.tar")).request().image == str(tmp_path / "x.tar")


# --- env or image --------------------------------------------------------------------------------


def test_env_or_image_one_of_the_two() -> None:
    with pytest.raises(InvalidRequest, match="both an env"):
        image_source(SandboxSpec(env="bookworm", image="debian:12"))
    with pytest.raises(InvalidRequest, match="no env or image"):
        image_source(SandboxSpec(env=""))
    s = SandboxSpec(env="bookworm")
    assert image_source(s) == (s, "")


def test_crab_env_without_a_tag_is_the_env() -> None:
    got, path = image_source(SandboxSpec(env="", image="crab-env/bookworm"))
    assert (got.env, got.image, path) == ("bookworm", "", "")
    # With a tag it names that very image (any image), recorded by digest.
    got, path = image_source(SandboxSpec(env="", image="crab-env/bookworm:0123abcd"))
    assert (got.env, got.image, path) == ("", "crab-env/bookworm:0123abcd", "")


def test_a_path_is_to_be_loaded() -> None:
    got, path = image_source(SandboxSpec(env="", image="/srv/tool.tar"))
    assert path == "/srv/tool.tar" and got.image == "/srv/tool.tar"
    with pytest.raises(InvalidRequest):
        image_source(SandboxSpec(env="", image="--help"))


# --- archives ------------------------------------------------------------------------------------


def _layer(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _tar(members: dict[str, bytes], path: Path) -> Path:
    with tarfile.open(path, "w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def _config(layers: list[bytes], **extra: Any) -> bytes:
    diff_ids = ["sha256:" + hashlib.sha256(layer).hexdigest() for layer in layers]
    return json.dumps({"os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids}, **extra}).encode()


def _docker_save(path: Path, *, tags: list[str] | None = None, images: int = 1) -> tuple[Path, bytes]:
    layer = _layer({"hello.txt": b"hi\n"})
    config = _config([layer])
    cfg_name = hashlib.sha256(config).hexdigest() + ".json"
    entry = {"Config": cfg_name, "RepoTags": tags or ["crab-env/bookworm:evil"], "Layers": ["l1/layer.tar"]}
    members = {
        "manifest.json": json.dumps([entry] * images).encode(),
        cfg_name: config,
        "l1/layer.tar": layer,
        "repositories": json.dumps({"crab-env/bookworm": {"evil": "x"}}).encode(),
    }
    return _tar(members, path), config


def _blob(members: dict[str, bytes], data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    members[f"blobs/sha256/{digest}"] = data
    return "sha256:" + digest


def _oci(path: Path, *, gz: bool = True, break_config: bool = False, nested: bool = False) -> tuple[Path, bytes]:
    members: dict[str, bytes] = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}'}
    raw = _layer({"etc/motd": b"from an OCI layout\n"})
    layer = gzip.compress(raw) if gz else raw
    config = _config([raw])
    kind = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else "")
    layer_digest = _blob(members, layer)
    config_digest = _blob(members, config)
    if break_config:
        members[f"blobs/sha256/{config_digest.removeprefix('sha256:')}"] = config + b" "
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest},
            "layers": [{"mediaType": kind, "digest": layer_digest, "size": len(layer)}],
        }
    ).encode()
    desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": _blob(members, manifest)}
    if nested:
        inner = json.dumps({"schemaVersion": 2, "manifests": [desc]}).encode()
        desc = {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": _blob(members, inner)}
    members["index.json"] = json.dumps({"schemaVersion": 2, "manifests": [desc]}).encode()
    return _tar(members, path), config


def test_a_docker_save_archive_is_planned_by_its_configs_digest(tmp_path: Path) -> None:
    path, config = _docker_save(tmp_path / "a.tar")
    p = image_archive.plan(path, "/x.tar")
    assert p.digest == "sha256:" + hashlib.sha256(config).hexdigest()
    assert p.layers == ("l1/layer.tar",)


@pytest.mark.parametrize(("gz", "nested"), [(True, False), (False, False), (True, True)])
def test_an_oci_layout_is_planned(tmp_path: Path, gz: bool, nested: bool) -> None:
    path, config = _oci(tmp_path / "o.tar", gz=gz, nested=nested)
    p = image_archive.plan(path, "/o")
    assert p.digest == "sha256:" + hashlib.sha256(config).hexdigest()
    assert len(p.layers) == 1 and p.layers[0].startswith("blobs/sha256/")


def test_the_load_tar_carries_crabs_manifest_only(tmp_path: Path) -> None:
    """The archive's own tags (RepoTags, repositories) never reach Docker."""
    path, _ = _docker_save(tmp_path / "a.tar")
    p = image_archive.plan(path, "/x.tar")
    out = tmp_path / "load.tar"
    image_archive._load_tar(path, p, out)
    with tarfile.open(out) as t:
        names = t.getnames()
        f = t.extractfile("manifest.json")
        assert f is not None
        manifest = json.loads(f.read())
    assert "repositories" not in names
    assert manifest == [
        {
            "Config": "config.json",
            "RepoTags": [f"crab-loaded:{p.digest.removeprefix('sha256:')}"],
            "Layers": ["layers/0/layer.tar"],
        }
    ]
    assert image_archive.plan(out, "/again").digest == p.digest


def test_an_image_docker_has_is_not_loaded_again(tmp_path: Path) -> None:
    path, _ = _docker_save(tmp_path / "a.tar")
    p = image_archive.plan(path, "/x.tar")
    asked: list[str] = []

    def exists(digest: str) -> bool:
        asked.append(digest)
        return True

    assert image_archive.load(path, p, "/x.tar", exists) == p.digest
    assert asked == [p.digest] and not (tmp_path / "load.tar").exists()


def _refused(path: Path, match: str) -> None:
    with pytest.raises(ImageError, match=match) as err:
        image_archive.plan(path, "/given")
    assert "nothing was loaded" in err.value.message


def test_hostile_or_broken_archives_are_refused(tmp_path: Path) -> None:
    _refused(_docker_save(tmp_path / "two.tar", images=2)[0], "lists 2 images")
    _refused(_oci(tmp_path / "bad.tar", break_config=True)[0], "does not match its digest")
    (tmp_path / "junk").write_bytes(b"not a tar at all" * 100)
    _refused(tmp_path / "junk", "not a tar archive")
    (tmp_path / "gz").write_bytes(gzip.compress(b"x" * 1000))
    _refused(tmp_path / "gz", "compressed")
    _refused(_tar({"hello": b"x"}, tmp_path / "plain.tar"), "neither manifest.json")
    _refused(_tar({"manifest.json": b"{nope"}, tmp_path / "nojson.tar"), "not JSON")
    entry = {"Config": "c.json", "Layers": ["missing.tar"]}
    layer = _layer({"a": b"a"})
    members = {"manifest.json": json.dumps([entry]).encode(), "c.json": _config([layer])}
    _refused(_tar(members, tmp_path / "nolayer.tar"), "no regular file 'missing.tar'")
    members["missing.tar"] = layer
    members["c.json"] = _config([layer, layer])
    _refused(_tar(members, tmp_path / "diffids.tar"), "diff_ids")
    members["c.json"] = _config([layer], os="windows")
    _refused(_tar(members, tmp_path / "windows.tar"), "not linux")


def test_two_members_of_one_name_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as t:
        for data in (b"[]", b"[1]"):
            info = tarfile.TarInfo("manifest.json")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    _refused(path, "two members named 'manifest.json'")


def test_a_symlink_is_no_member_to_load(tmp_path: Path) -> None:
    members = {"manifest.json": json.dumps([{"Config": "c.json", "Layers": ["l.tar"]}]).encode()}
    link = tmp_path / "link.tar"
    with tarfile.open(link, "w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        sym = tarfile.TarInfo("c.json")
        sym.type, sym.linkname = tarfile.SYMTYPE, "/etc/shadow"
        t.addfile(sym)
    _refused(link, "no regular file 'c.json'")


@pytest.mark.skipif(os.geteuid() != 0, reason="reads as another uid through setpriv: needs root")
def test_staging_reads_as_the_caller_and_is_bounded(tmp_path: Path) -> None:
    secret = tmp_path / "secret.tar"
    secret.write_bytes(b"x" * 100)
    secret.chmod(0o600)
    tmp_path.chmod(0o755)
    (tmp_path / "stage").mkdir()
    with pytest.raises(PermissionDenied, match="uid 65534 cannot read"):
        image_archive.stage_as(str(secret), 65534, 65534, tmp_path / "stage", 1 << 20)
    assert not (tmp_path / "stage" / "staged.tar").read_bytes()
    (tmp_path / "stage" / "staged.tar").unlink()
    with pytest.raises(ImageError, match="larger than the limit of 10 bytes"):
        image_archive.stage_as(str(secret), 0, 0, tmp_path / "stage", 10)


# --- digests on the fake stack -------------------------------------------------------------------


@asynccontextmanager
async def _running(st: Stack) -> AsyncIterator[None]:
    async with engine_running(st):
        yield


def test_a_sandbox_of_any_image_records_its_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        async with _running(st):
            rec = await st.service.create(ALICE, replace(spec("anyimg", checkpoints="fs"), env="", image="tool:1"))
            want = "sha256:" + hashlib.sha256(b"tool:1").hexdigest()
            assert (rec.image, rec.spec.env, rec.spec.image) == (want, "", "tool:1")
            ck = await st.checkpointer.take(rec, kind=CheckpointKind.FS)
            assert ck.image == want
            _, forks = await st.service.fork(ALICE, ck.id, "", 1, "")
            assert forks[0].image == want
            # A host whose Docker lacks the image refuses, naming the digest.
            st.backend.missing_images.add(want)
            with pytest.raises(ImageError, match=f"digest {want}") as err:
                await st.service.fork(ALICE, ck.id, "", 1, "")
            assert want in (err.value.hint or "")
            with pytest.raises(ImageError, match="no Docker image 'gone:1'"):
                st.backend.missing_images.add("gone:1")
                await st.service.create(ALICE, replace(spec("gone"), env="", image="gone:1"))
            assert "gone" not in [r.name for r in st.registry.list_sandboxes()]

    run(body())


def test_an_archive_of_an_any_image_sandbox_imports_only_where_docker_has_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = build_stack(tmp_path / "a", monkeypatch), build_stack(tmp_path / "b", monkeypatch)

    async def body() -> None:
        async with _running(a), _running(b):
            rec = await a.service.create(ALICE, replace(spec("anyimg", checkpoints="fs"), env="", image="tool:1"))
            ck = await a.service.create_checkpoint(ALICE, rec.id, "", "fs")
            data = b"".join([c async for c in a.service.archives.export(ALICE, ck.id, False)])

            async def chunks() -> AsyncIterator[bytes]:
                yield data

            b.backend.missing_images.add(rec.image)
            with pytest.raises(ArchiveRejected, match=f"digest {rec.image}"):
                await b.service.archives.import_archive(ALICE, chunks())
            assert not b.catalog.list_checkpoints()
            b.backend.missing_images.clear()
            got = await b.service.archives.import_archive(ALICE, chunks())
            assert [c.id for c in got.checkpoints] == [ck.id]

    run(body())
