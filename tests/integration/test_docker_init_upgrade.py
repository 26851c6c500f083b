"""The Docker backend restores a process checkpoint with the crab-init build it was dumped with.

CRIU checks the size and build-id of ``/.crab/init`` against the images, so
before this a crab-init upgrade made every earlier process checkpoint of a
Docker sandbox fail in CRIU.  Real dockerd, runc and CRIU; a second build of
crab-init's own source stands in for the previous version.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.backends.criu import init_versions
from crabd.backends.criu.runc import RuncDumper
from crabd.backends.docker_sandbox import DockerSandboxBackend
from crabd.backends.sandbox import LABEL_INSTANCE, LABEL_OWNER, LABEL_SANDBOX
from crabd.config import NetworkConfig
from crabd.errors import ContainerRuntimeError, CrabError
from crabd.host import images
from crabd.models import SandboxSpec
from crabd.runtime import initbin
from crabd.util import proc

INSTANCE = f"dkinit{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("docker-init")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def builds(base: Path) -> tuple[Path, Path]:
    """(the current crab-init as crabd installs it, another build of the same source: other size and build-id)."""
    current = initbin.install(base / "state")
    kept = base / "previous"
    kept.mkdir()
    variant = kept / "crab-init-previous"
    proc.run(["gcc", "-static", "-O1", "-o", str(variant), str(initbin.source_path())], timeout=120)
    assert init_versions.of_binary(variant) != init_versions.of_binary(current)
    return current, variant


@pytest.fixture
def made() -> Iterator[list[tuple[DockerSandboxBackend, str]]]:
    """Containers a test made, removed afterwards through the backend that made it, then the backends closed."""
    out: list[tuple[DockerSandboxBackend, str]] = []
    yield out
    backends = {id(b): b for b, _ in out}
    try:
        for backend, cid in out:
            backend.remove(cid)
    finally:
        for backend in backends.values():
            backend.close()
    for backend in backends.values():
        assert backend.init_dir is not None and sorted(backend.init_dir.iterdir()) == []  # the files went too


def _backend(base: Path) -> DockerSandboxBackend:
    return DockerSandboxBackend(network=NetworkConfig(isolate=False), init_dir=base / "docker-init")


def _create(backend: DockerSandboxBackend, name: str, init: Path, made: list[tuple[DockerSandboxBackend, str]]) -> str:
    labels = {LABEL_SANDBOX: name, LABEL_INSTANCE: INSTANCE, LABEL_OWNER: "0"}
    image = images.find_recipe("busybox").image_ref
    cid = backend.create(name, SandboxSpec(env="busybox"), image, init, labels)
    made.append((backend, cid))
    return cid


def _in_sandbox(cid: str, *argv: str) -> str:
    return subprocess.run(["docker", "exec", cid, *argv], capture_output=True, text=True, check=True, timeout=30).stdout


def test_a_restore_binds_the_build_the_images_were_dumped_with(
    base: Path, builds: tuple[Path, Path], made: list[tuple[DockerSandboxBackend, str]]
) -> None:
    current, previous = builds
    backend = _backend(base)
    old = _create(backend, f"{INSTANCE}-old", previous, made)
    backend.start(old)
    own = base / "docker-init" / f"crab-{INSTANCE}-old"
    assert init_versions.of_binary(own) == init_versions.of_binary(previous)  # its own file, that build
    images_dir, work = base / "images", base / "work"
    work.mkdir()
    with backend.frozen(old):
        RuncDumper(log_dir=base / "criu-logs").dump(old, images_dir, work)
    assert init_versions.dumped(images_dir) == init_versions.of_binary(previous)

    # "After the upgrade": the new container is created with the current build.
    new = _create(backend, f"{INSTANCE}-new", current, made)
    shutil.copytree(images_dir, backend.checkpoint_dir(new, "crab"), dirs_exist_ok=True)
    backend.start(new, "crab")  # CRIU refused this before: "File .crab/init has bad size"
    assert backend.status(new).running
    want = subprocess.run(["sha256sum", str(previous)], capture_output=True, text=True, check=True).stdout
    assert _in_sandbox(new, "sha256sum", "/.crab/init").split()[0] == want.split()[0]

    # A fresh container from the current build still binds the current one.
    fresh = _create(backend, f"{INSTANCE}-fresh", current, made)
    backend.start(fresh)
    fresh_own = base / "docker-init" / f"crab-{INSTANCE}-fresh"
    assert init_versions.of_binary(fresh_own) == init_versions.of_binary(current)


def test_a_restore_needing_a_build_this_host_does_not_keep_is_refused_before_criu(
    base: Path, builds: tuple[Path, Path], made: list[tuple[DockerSandboxBackend, str]]
) -> None:
    current, previous = builds
    taker = _backend(base)
    images_dir, work = base / "images2", base / "work2"
    work.mkdir()
    old = _create(taker, f"{INSTANCE}-gone", previous, made)
    taker.start(old)
    with taker.frozen(old):
        RuncDumper(log_dir=base / "criu-logs").dump(old, images_dir, work)
    # Another crabd, which only ever bound the current build.
    unaware = _backend(base / "unaware")
    lost = _create(unaware, f"{INSTANCE}-lost", current, made)
    shutil.copytree(images_dir, unaware.checkpoint_dir(lost, "crab"), dirs_exist_ok=True)
    with pytest.raises(ContainerRuntimeError, match="does not keep") as caught:
        unaware.start(lost, "crab")
    want = init_versions.of_binary(previous)
    assert want is not None and want.describe() in caught.value.message
    assert not unaware.status(lost).running  # nothing started


def test_a_create_docker_refuses_leaves_no_crab_init_file_and_a_name_conflict_keeps_the_owners(
    base: Path, builds: tuple[Path, Path], made: list[tuple[DockerSandboxBackend, str]]
) -> None:
    current, _ = builds
    backend = _backend(base / "refused")
    assert backend.init_dir is not None
    labels = {LABEL_SANDBOX: "x", LABEL_INSTANCE: INSTANCE, LABEL_OWNER: "0"}
    with pytest.raises(CrabError):
        backend.create(f"{INSTANCE}-noimage", SandboxSpec(env="busybox"), "crab-no-such-image:0", current, labels)
    assert sorted(backend.init_dir.iterdir()) == []  # the file made for it went with the refusal
    first = _create(backend, f"{INSTANCE}-twice", current, made)
    with pytest.raises(CrabError):  # the same name again: dockerd refuses (a conflict)
        _create(backend, f"{INSTANCE}-twice", current, made)
    # The first container's file stays: it is bound there.
    assert [p.name for p in backend.init_dir.iterdir()] == [f"crab-{INSTANCE}-twice"]
    backend.start(first)
    assert _in_sandbox(first, "ls", "/.crab/init").strip() == "/.crab/init"
