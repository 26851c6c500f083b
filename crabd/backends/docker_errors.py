"""Docker's exceptions, translated into crab's at the boundary.

docker-py raises its own hierarchy (``docker.errors``) and lets ``requests``
errors through when the engine's socket fails; crab's callers see only
:class:`~crabd.errors.CrabError`.  One context manager does the translation
for every call into Docker, so the mapping is the same everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from crabd.errors import DockerError, ImageError


@contextmanager
def docker_errors(what: str) -> Iterator[None]:
    """Re-raise a Docker failure inside the block as a crab error whose message starts with ``what``.

    ``ImageNotFound`` becomes :class:`ImageError`; any other answer of the
    engine :class:`DockerError` with its HTTP status; no answer at all
    (socket, timeout, protocol) :class:`DockerError` without one.  Cases a
    caller treats as normal (a container already gone) it catches inside the
    block, before they get here.
    """
    try:
        yield
    except Exception as exc:
        # docker-py (and requests under it) is imported by the first call into Docker, not here:
        # the runc backend uses this module too and never needs it (~65 ms of crabd's start-up).
        # Before that first call no exception can be Docker's.
        if "docker" not in sys.modules:
            raise
        import docker.errors
        import requests

        if isinstance(exc, docker.errors.ImageNotFound):
            raise ImageError(f"{what}: image not found: {exc.explanation}", env="") from exc
        if isinstance(exc, docker.errors.APIError):
            raise DockerError(f"{what}: {exc.explanation or exc}", status=exc.status_code) from exc
        if isinstance(exc, docker.errors.DockerException | requests.RequestException):
            raise DockerError(f"{what}: {exc}") from exc
        raise
