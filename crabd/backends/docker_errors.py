"""Docker's exceptions, translated into crab's at the boundary.

docker-py raises its own hierarchy (``docker.errors``) and lets ``requests``
errors through when the engine's socket fails; crab's callers see only
:class:`~crabd.errors.CrabError`.  One context manager does the translation
for every call into Docker, so the mapping is the same everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import docker.errors
import requests

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
    except docker.errors.ImageNotFound as exc:
        raise ImageError(f"{what}: image not found: {exc.explanation}", env="") from exc
    except docker.errors.APIError as exc:
        raise DockerError(f"{what}: {exc.explanation or exc}", status=exc.status_code) from exc
    except (docker.errors.DockerException, requests.RequestException) as exc:
        raise DockerError(f"{what}: {exc}") from exc
