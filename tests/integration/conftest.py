"""Fixtures for tests against a real crabd, Docker and the env images."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator

import pytest

from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.conftest import have_docker, have_root, require


@pytest.fixture(scope="module")
def daemon() -> Iterator[EmbeddedDaemon]:
    """A private crabd for this module; its sandboxes go away with it."""
    require(have_root(), "needs root")
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    d = EmbeddedDaemon()
    d.start()
    try:
        yield d
    finally:
        d.close()
        # Belt and braces: no container of this daemon may outlive the module.
        from crabd.daemon.app import instance_id

        inst = instance_id(d.state_dir)
        ids = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=dev.crab.instance={inst}"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
        if ids:
            subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, timeout=120)


@pytest.fixture
def client(daemon: EmbeddedDaemon) -> Iterator[Client]:
    with Client(daemon.socket) as c:
        yield c


@pytest.fixture
def make_sandbox(client: Client) -> Iterator[Callable[..., Sandbox]]:
    """Create sandboxes that are removed when the test ends."""
    made: list[Sandbox] = []

    def make(env: str = "busybox", **kwargs: object) -> Sandbox:
        sb = client.create(env, **kwargs)  # type: ignore[arg-type]
        made.append(sb)
        return sb

    yield make
    for sb in made:
        with contextlib.suppress(Exception):
            sb.remove(force=True)


def docker_inspect(container_id: str, fmt: str) -> str:
    return subprocess.run(
        ["docker", "inspect", "-f", fmt, container_id], capture_output=True, text=True, timeout=60
    ).stdout.strip()
