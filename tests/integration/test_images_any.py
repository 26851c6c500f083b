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
import threading
import time
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
    """The test image's lower dir, as the runc backend exported it, and crabd's claims of it (keyed by its id)."""
    from crabd.config import ImagesConfig

    shutil.rmtree(rootfs.DEFAULT_ROOTFS_ROOT / digest.removeprefix("sha256:"), ignore_errors=True)
    shutil.rmtree(ImagesConfig().claims_dir / digest.removeprefix("sha256:"), ignore_errors=True)


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


# --- pinned images and their collection (coordinator/image_gc.py) ----------------------------------

GRACE_S = 2.0


@pytest.fixture(scope="module", params=conftest.BACKENDS)
def gc_daemon(request: pytest.FixtureRequest) -> Iterator[EmbeddedDaemon]:
    """A private crabd whose pins may go 2 s after their last use; it collects by hand only."""
    toml = conftest.backend_toml(request.param, "crabimggc")
    toml += f"[images]\ngc_grace_s = {GRACE_S}\ngc_interval_s = 0\n"
    with daemon_with_config(toml, "crabimggc") as d:
        yield d


def _pinned(digest: str) -> bool:
    done = subprocess.run(
        ["docker", "image", "inspect", f"crab-loaded:{digest.removeprefix('sha256:')}"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    return done.returncode == 0


def _prune_until_done(c: Client, digest: str) -> None:
    """Collections, once the grace has passed, until one was not held back by a create."""
    from crabd.sdk.images import prune_pinned_images

    time.sleep(GRACE_S + 0.5)
    for _ in range(50):
        r = prune_pinned_images(c)
        if not r.busy:
            assert digest in r.removed, r
            return
        time.sleep(0.1)
    raise AssertionError("every collection was held back")


def test_a_pinned_image_stays_while_a_checkpoint_needs_it_and_goes_after(
    gc_daemon: EmbeddedDaemon, tmp_path: Path
) -> None:
    from crabd.sdk.images import list_pinned_images, prune_pinned_images

    tag, digest = _build(tmp_path, "pinned\n")
    hexd = digest.removeprefix("sha256:")
    export = rootfs.DEFAULT_ROOTFS_ROOT / hexd
    try:
        with Client(gc_daemon.socket) as c:
            sb = c.create(image=tag, checkpoints="none")
            assert _pinned(digest)
            sb.run(["sh", "-c", "echo kept > /root/x"])
            ck = sb.checkpoint(kind="fs")
            sb.remove(keep_checkpoints=True)
            # The user drops the name: crab's pin keeps the image the checkpoint needs.
            _gone(tag)
            time.sleep(GRACE_S + 0.5)
            r = prune_pinned_images(c)
            assert digest not in r.removed and _pinned(digest)
            rows = {i.digest: i for i in list_pinned_images(c)}
            assert (rows[digest].checkpoints, rows[digest].sandboxes, rows[digest].state) == (1, 0, "in use")
            with c.fork(ck.id) as forks:
                assert forks[0].run(["cat", "/root/x"]).stdout == b"kept\n"
            # The checkpoint goes: after the grace, so do the pin, the image and its export.
            c.delete_checkpoint(ck.id)
            _prune_until_done(c, digest)
            assert not _pinned(digest)
            assert subprocess.run(["docker", "image", "inspect", digest], capture_output=True).returncode != 0
            assert not export.exists()
            assert digest not in {i.digest for i in list_pinned_images(c)}
    finally:
        _gone(tag)
        _gone(f"crab-loaded:{hexd}")
        _gone(digest)
        _forget(digest)


def test_a_create_racing_a_collection_still_works(gc_daemon: EmbeddedDaemon, tmp_path: Path) -> None:
    from crabd.sdk.images import prune_pinned_images

    tag, digest = _build(tmp_path, "raced\n")
    hexd = digest.removeprefix("sha256:")
    stop = threading.Event()
    pruned: list[str] = []

    def prune_all_the_time() -> None:
        with Client(gc_daemon.socket) as c:
            while not stop.is_set():
                pruned.extend(prune_pinned_images(c).removed)
                time.sleep(0.02)

    try:
        pruner = threading.Thread(target=prune_all_the_time)
        pruner.start()
        try:
            with Client(gc_daemon.socket) as c:
                for _ in range(3):
                    # Each create meets an image nothing names and whose grace is over: a collection
                    # takes its pin (and export) before the create pins it, or the create comes first.
                    with c.create(image=tag, checkpoints="none") as sb:
                        assert sb.info.image == digest
                        assert sb.run(["cat", "/hello.txt"]).stdout == b"raced\n"
                    time.sleep(GRACE_S + 0.5)
        finally:
            stop.set()
            pruner.join(60)
        assert digest in pruned  # collections took it between the creates
    finally:
        _gone(tag)
        _gone(f"crab-loaded:{hexd}")
        _gone(digest)
        _forget(digest)
