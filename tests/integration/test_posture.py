"""A real checkpoint whose CRIU core images were forged is never restored: the posture check refuses it.

The forgery is done the way an attacker holding the images would: the
capability sets, no_new_privs or the seccomp mode rewritten in the stored
``core-N.img`` files, keeping every size (so the hot copy is still used as
is).  Each backend's posture comes from its own container config.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crabd.backends.criu import pbimage
from crabd.backends.criu.posture import check
from crabd.backends.docker_sandbox import DockerSandboxBackend
from crabd.backends.procdump import Posture
from crabd.backends.runc.bundle import Bundle
from crabd.backends.runc.cleanup import Layout
from crabd.backends.runc.posture import posture_of
from crabd.errors import PostureViolation
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.criu_forge import varint
from tests.integration.conftest import BACKENDS, backend_toml, daemon_with_config, instance_containers

NORMAL_CAPS = 0x80004FB
#: Same varint length as NORMAL_CAPS (4 bytes): the file keeps its size.  Holds SYS_ADMIN, DAC_READ_SEARCH ...
FORGED_CAPS = 0x0FFFFFFF


def _cores(d: EmbeddedDaemon) -> list[Path]:
    hot = sorted((d.state_dir / "images-hot").glob("*/core-*.img"))
    assert hot, "the full checkpoint left no hot image"
    return hot


def _forge(path: Path, old: bytes, new: bytes, count: int | None = None) -> bytes:
    data = path.read_bytes()
    assert (count is None and old in data) or data.count(old) == count, (path, old)
    path.chmod(0o600)
    path.write_bytes(data.replace(old, new))
    return data


FORGERIES: dict[str, Callable[[bytes], tuple[bytes, bytes, int | None]]] = {
    # creds fields 10, 11, 12 (permitted, effective, bounding), each the low word of its set.
    "capabilities": lambda _: (b"\x58" + varint(NORMAL_CAPS), b"\x58" + varint(FORGED_CAPS), None),
    # creds field 18 (no_new_privs) = 1 -> 0.
    "no_new_privs": lambda _: (b"\x90\x01\x01", b"\x90\x01\x00", 1),
    # thread_core field 11 (seccomp_mode) = 2 -> 0, followed by field 12 (the filter's index).
    "seccomp": lambda _: (b"\x58\x02\x60", b"\x58\x00\x60", 1),
}


def _forge_filters(d: EmbeddedDaemon) -> dict[Path, bytes]:
    """Each filter program in the hot seccomp.img starts with "return ALLOW" (same size): a filter allowing all."""
    out = {}
    for path in (d.state_dir / "images-hot").glob("*/seccomp.img"):
        data = path.read_bytes()
        forged = data
        dirfd = pbimage.open_dir(path.parent)
        try:
            (entry,) = pbimage.messages(dirfd, path.name, pbimage.SECCOMP_MAGIC)
        finally:
            os.close(dirfd)
        for f in entry.messages(1):
            program = f.blob(1)
            assert program is not None
            forged = forged.replace(program, struct.pack("<HBBI", 0x06, 0, 0, 0x7FFF0000) + program[8:])
        assert forged != data and len(forged) == len(data)
        path.chmod(0o600)
        path.write_bytes(forged)
        out[path] = data
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def daemon(backend: str) -> Iterator[EmbeddedDaemon]:
    with daemon_with_config(backend_toml(backend, "crabpstr"), "crabpstr") as d:
        yield d


def _posture(backend: str, container_id: str) -> Posture:
    """The running container's posture, from what its backend created it with."""
    if backend == "docker":
        docker = DockerSandboxBackend()
        try:
            return docker.posture(container_id)
        finally:
            docker.close()
    return posture_of(Bundle(Layout().bundles / container_id).config())


@pytest.fixture
def sandbox(daemon: EmbeddedDaemon) -> Iterator[tuple[Client, Sandbox]]:
    with Client(daemon.socket) as c:
        sb = c.create("busybox")
        try:
            yield c, sb
        finally:
            sb.remove(force=True)


@pytest.mark.parametrize("what", [*FORGERIES, "seccomp_filter"])
def test_a_forged_core_image_is_refused_and_changes_nothing(
    daemon: EmbeddedDaemon, sandbox: tuple[Client, Sandbox], what: str
) -> None:
    client, sb = sandbox
    sb.run(["sh", "-c", "sleep 1000 >/dev/null 2>&1 &"])
    ck = sb.checkpoint(kind="full")
    before = instance_containers(daemon.state_dir)
    source_cid = sb.refresh().container_id
    originals = _forge_filters(daemon) if what == "seccomp_filter" else {}
    for core in _cores(daemon) if what != "seccomp_filter" else []:
        old, new, count = FORGERIES[what](core.read_bytes())
        if what == "capabilities" or old in core.read_bytes():
            originals[core] = _forge(core, old, new, count)
    assert originals
    try:
        with pytest.raises(PostureViolation) as fork_err:
            client.fork(ck.id, 1)
        with pytest.raises(PostureViolation) as restore_err:
            sb.restore(ck.id)
    finally:
        for core, data in originals.items():
            core.write_bytes(data)
    for err in (fork_err.value, restore_err.value):
        assert err.checkpoint == ck.id and err.pid > 0, err
        assert {"capabilities": "capability", "no_new_privs": "no_new_privs"}.get(what, "seccomp") in err.what
    if what == "capabilities":
        assert "SYS_ADMIN" in fork_err.value.found and "0x80004fb" in fork_err.value.expected
    # Nothing half-restored: no new container; the sandbox runs on in its own container, as before.
    assert instance_containers(daemon.state_dir) == before
    assert sb.refresh().container_id == source_cid and sb.refresh().state == "running"
    assert sb.run(["sh", "-c", "grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/1/status"]).text.split() == [
        "CapEff:", f"{NORMAL_CAPS:016x}", "NoNewPrivs:", "1", "Seccomp:", "2",
    ]  # fmt: skip
    # The same images, unforged, fork and restore as ever.
    clone = client.fork(ck.id, 1)[0]
    try:
        assert "NoNewPrivs:\t1" in clone.run(["cat", "/proc/1/status"]).text
    finally:
        clone.remove(force=True)
    sb.restore(ck.id)
    assert sb.refresh().container_id != source_cid and "Seccomp:\t2" in sb.run(["cat", "/proc/1/status"]).text


def test_the_check_costs_little_on_a_real_checkpoint(
    sandbox: tuple[Client, Sandbox], daemon: EmbeddedDaemon, backend: str
) -> None:
    _, sb = sandbox
    sb.run(["sh", "-c", "for i in 1 2 3 4; do sleep 1000 >/dev/null 2>&1 & done"])
    sb.checkpoint(kind="full")
    images = _cores(daemon)[0].parent
    posture = _posture(backend, sb.refresh().container_id)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        check(images, posture, "measure")
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"posture check ({backend}): median {times[10] * 1000:.2f} ms, max {times[-1] * 1000:.2f} ms, 6 tasks")
    assert times[10] < 0.05
