"""Checks of request values, shared by the service (the edge every request crosses) and the SDK.

The daemon validates every request in ``crabd/service`` whatever the client
did; the SDK runs the same checks before sending, so a bad value gets the
same :class:`~crabd.errors.InvalidRequest` (not a transport error) without a
round trip.

Why :func:`math.isfinite` everywhere: a NaN compares false with everything,
so ``nan < 0`` and ``nan > maximum`` both pass, and ``nan or default`` is
NaN (NaN is truthy).  An infinite timeout passes ``>= 0``, overflows
``int()`` and makes gRPC deadlines fail before the call is sent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from crabd.errors import InvalidRequest

#: Environment variable names: what a shell can ``export`` (and so what the
#: session can carry over and re-apply).  A name with ``=`` would be split
#: differently by every reader, NUL ends the C string, an empty name is
#: nothing.
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _number(value: object, what: str) -> float | int:
    # bool is an int subclass; True as a timeout is a caller's mistake.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{what} must be a number, not {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{what} must be a finite number, not {value!r}")
    return value


def seconds(value: object, what: str, *, maximum: float | None = None) -> float:
    """A finite duration in ``[0, maximum]`` (0 usually means "the default")."""
    v = float(_number(value, what))
    if v < 0:
        raise InvalidRequest(f"{what} {v:g} s must not be negative")
    if maximum is not None and v > maximum:
        raise InvalidRequest(f"{what} {v:g} s exceeds the maximum of {maximum:g} s")
    return v


def fraction(value: object, what: str, *, maximum: float | None = None) -> float:
    """A finite, non-negative real (a CPU count) at most ``maximum``."""
    v = float(_number(value, what))
    if v < 0 or (maximum is not None and v > maximum):
        top = "" if maximum is None else f", at most {maximum:g}"
        raise InvalidRequest(f"{what}={v:g} is out of range (0 = unlimited{top})")
    return v


def integer(value: object, what: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """An integer in ``[minimum, maximum]``; floats are accepted only when integral and finite."""
    v = _number(value, what)
    if isinstance(v, float):
        if not v.is_integer():
            raise InvalidRequest(f"{what} must be a whole number, not {v!r}")
        v = int(v)
    if v < minimum:
        raise InvalidRequest(f"{what}={v} must be at least {minimum}")
    if maximum is not None and v > maximum:
        raise InvalidRequest(f"{what}={v} exceeds the maximum of {maximum}")
    return v


def env_vars(env: Mapping[Any, object], what: str = "environment") -> dict[str, str]:
    """The one rule for environment variables, wherever they come from (create, exec, session state).

    Names: letters, digits and ``_``, not starting with a digit (so never
    empty, never ``=`` or NUL).  Values: any text without NUL.
    """
    if not isinstance(env, Mapping):
        raise InvalidRequest(f"the {what} must map names to values, not {type(env).__name__}")
    out: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME_RE.match(name):
            raise InvalidRequest(
                f"invalid {what} variable name {name!r}",
                hint="Use letters, digits and '_', not starting with a digit (no '=', no NUL, not empty).",
            )
        if not isinstance(value, str):
            raise InvalidRequest(f"invalid {what} variable {name!r}: its value must be text, not {value!r}")
        if "\0" in value:
            raise InvalidRequest(f"invalid {what} variable {name!r}: its value contains a NUL byte")
        out[name] = value
    return out


#: A Docker image reference as crab takes it: a name (``[registry/]repo[:tag][@sha256:...]``) or an
#: id (``sha256:<hex>``, or a prefix of the hex).  It starts with a letter or digit, so it is never an
#: option to a ``docker`` command; Docker parses the rest (through its API, never a shell).
IMAGE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}\Z")
#: An image's digest as crab records it: Docker's image id (the SHA-256 of its config).
IMAGE_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}\Z")
#: Longest path of an image archive or OCI layout dir a request may name.
MAX_IMAGE_PATH = 4096


def image_ref(value: object) -> str:
    """A create request's ``image``: a Docker image reference, or an absolute path (archive or OCI layout).

    Relative paths are refused (crabd's working directory is not the
    caller's); control characters, NUL and ``..`` components too.
    """
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"an image must be a non-empty text, not {value!r}")
    if value.startswith("/"):
        if len(value.encode("utf-8", "surrogateescape")) > MAX_IMAGE_PATH:
            raise InvalidRequest(f"the image path is longer than {MAX_IMAGE_PATH} bytes")
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise InvalidRequest(f"the image path {value[:200]!r} contains a control character")
        if ".." in value.split("/"):
            raise InvalidRequest(f"the image path {value[:200]!r} has a '..' component", hint="Give it resolved.")
        return value
    if not IMAGE_NAME_RE.match(value) or "//" in value:
        raise InvalidRequest(
            f"{value[:200]!r} is not an image reference crab takes",
            hint="Name a Docker image (e.g. debian:12, sha256:<id>; letters, digits and ._/:@+-, at most 255,"
            " starting with a letter or digit), or give the absolute path of a `docker save` archive"
            " or an OCI layout directory.",
        )
    return value


def is_image_path(ref: str) -> bool:
    """Whether a checked :func:`image_ref` names a file or directory (else a Docker image)."""
    return ref.startswith("/")
