"""Any image (issue 36): a sandbox from any image the host's Docker has, a `docker save` archive or an OCI layout.

On each backend: an image built here (``FROM`` crab's busybox env image, plus
a file and an ENV; busybox has no bash) runs exec, checkpoints, forks and
restores, and every record names it by its digest.  An archive and an OCI
layout dir of another build are loaded once, as their digest; a fork of a
checkpoint whose image Docker no longer has is refused naming that digest.
Every image the tests made is removed at the end.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.backends.runc import rootfs
from crabd.errors import CrabError, ImageError, InvalidRequest
from crabd.host import images
from crabd.sdk import Client, EmbeddedDaemon
from tests.integration import conftest
from tests.integration.conftest import daemon_with_config

pytestmark = [pytest.mark.integration, pytest.mark.docker]


def _docker(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _image_id(ref: str) -> str:
    return _docker("image", "inspect", "-f", "{{.Id}}", ref)


def _gone(ref: str) -> None:
    subprocess.run(["docker", "rmi", "-f", ref], capture_output=True, timeout=120, check=False)


def _forget(digest: str) -> None:
    """The test image's lower dir, as the runc backend exported it (keyed by its id: no other image's)."""
    shutil.rmtree(rootfs.DEFAULT_ROOTFS_ROOT / digest.removeprefix("sha256:"), ignore_errors=True)


@pytest.fixture(scope="module", params=conftest.BACKENDS)
def daemon(request: pytest.FixtureRequest) -> Iterator[EmbeddedDaemon]:
    with daemon_with_config(conftest.backend_toml(request.param, "crabimg"), "crabimg") as d:
        yield d


def _build(tmp: Path, text: str) -> tuple[str, str]:
    """An image FROM crab's busybox env image, with /hello.txt holding ``text`` and GREETING=hi; (tag, digest)."""
    base = images.find_recipe("busybox").image_ref
    if not images.image_exists(base):
        pytest.skip(f"crab's busybox env image {base} is not built (`make images`)")
    (tmp / "hello.txt").write_text(text)
    (tmp / "Dockerfile").write_text(f"FROM {base}\nCOPY hello.txt /hello.txt\nENV GREETING=hi\n")
    tag = f"crab-test-any:{secrets.token_hex(4)}"
    _docker("build", "-q", "-t", tag, str(tmp))
    return tag, _image_id(tag)


@pytest.fixture
def built(tmp_path: Path) -> Iterator[tuple[str, str]]:
    tag, digest = _build(tmp_path, "hello from any image\n")
    try:
        yield tag, digest
    finally:
        _gone(tag)
        _gone(digest)
        _forget(digest)


def test_a_sandbox_from_any_image_execs_checkpoints_forks_and_restores(client: Client, built: tuple[str, str]) -> None:
    tag, digest = built
    with client.create(image=tag, checkpoints="none") as sb:
        assert (sb.info.image, sb.info.env) == (digest, "")
        assert sb.run(["cat", "/hello.txt"]).stdout == b"hello from any image\n"
        assert sb.run(["sh", "-c", "echo $GREETING"]).stdout == b"hi\n"  # the image's own ENV
        with pytest.raises(CrabError, match="no bash"):
            sb.session.run("echo hi")
        assert sb.run(["sh", "-c", "echo one > /root/state.txt"]).exit_code == 0
        ck = sb.checkpoint(kind="fs")
        assert ck.image == digest
        assert client.checkpoint(ck.id).checkpoint.image == digest
        assert sb.run(["sh", "-c", "echo two > /root/state.txt"]).exit_code == 0
        with sb.fork(1, ck.id) as forks:
            assert forks[0].info.image == digest
            assert forks[0].run(["cat", "/root/state.txt", "/hello.txt"]).stdout == b"one\nhello from any image\n"
        assert sb.restore(ck.id).image == digest
        assert sb.run(["cat", "/root/state.txt"]).stdout == b"one\n"


def test_an_unknown_image_is_refused_and_nothing_is_made(client: Client) -> None:
    before = {s.id for s in client.list()}
    with pytest.raises(ImageError, match="crab-test-none:nope"):
        client.create(image="crab-test-none:nope")
    with pytest.raises(InvalidRequest):
        client.create(image="--privileged")
    with pytest.raises(InvalidRequest, match="both an env"):
        client.create("busybox", image="debian:12")
    assert {s.id for s in client.list()} == before


def _oci_layout(saved: Path, into: Path) -> None:
    """The image of the `docker save` archive ``saved`` as an OCI image layout dir (its config unchanged)."""
    into.mkdir()
    blobs = into / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    with tarfile.open(saved) as t:

        def read(name: str) -> bytes:
            f = t.extractfile(name)
            assert f is not None
            return f.read()

        entry = json.loads(read("manifest.json"))[0]
        config = {"mediaType": "application/vnd.oci.image.config.v1+json", **blob(read(entry["Config"]))}
        layers = [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **blob(read(n))} for n in entry["Layers"]]
    manifest = json.dumps({"schemaVersion": 2, "config": config, "layers": layers}).encode()
    desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json", **blob(manifest)}
    index = {"schemaVersion": 2, "manifests": [desc]}
    (into / "index.json").write_text(json.dumps(index))
    (into / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')


def test_an_archive_and_an_oci_layout_are_loaded_once_by_digest(client: Client, tmp_path: Path) -> None:
    (tmp_path / "ctx").mkdir()
    tag, digest = _build(tmp_path / "ctx", "from an archive\n")
    loaded = f"crab-loaded:{digest.removeprefix('sha256:')}"
    saved, layout = tmp_path / "img.tar", tmp_path / "layout"
    try:
        _docker("save", "-o", str(saved), tag)
        _oci_layout(saved, layout)
        _gone(tag)  # Docker lacks it now: the archive brings it back
        sb = client.create(image=str(saved), checkpoints="none")
        assert sb.info.image == digest
        assert _image_id(loaded) == digest  # loaded under crab's own tag, not the archive's
        assert sb.run(["cat", "/hello.txt"]).stdout == b"from an archive\n"
        sb.run(["sh", "-c", "echo kept > /root/x"])
        ck = sb.checkpoint(kind="fs")
        sb.remove(keep_checkpoints=True)
        _gone(loaded)
        # A host whose Docker lacks the image: refused, naming the digest.
        with pytest.raises(ImageError, match=f"digest {digest}"):
            client.fork(ck.id)
        # The OCI layout (read as the caller) loads the same image again, and the fork works.
        with client.create(image=str(layout), checkpoints="none") as sb2:
            assert sb2.info.image == digest
        with client.fork(ck.id) as forks:
            assert forks[0].run(["cat", "/root/x"]).stdout == b"kept\n"
        # Hostile input changes nothing: a file that is no image archive.
        junk = tmp_path / "junk.tar"
        junk.write_bytes(b"\0" * 4096)
        with pytest.raises(ImageError, match="not an image archive"):
            client.create(image=str(junk))
    finally:
        _gone(tag)
        _gone(loaded)
        _forget(digest)
