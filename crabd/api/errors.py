"""CrabError <-> gRPC status, at the wire boundary.

A server-side :class:`CrabError` becomes a status code (its ``grpc_code``)
plus the trailing metadata key ``crab-error`` holding JSON
``{"kind", "message", "hint", "attrs"}``: ``kind`` is the class's name (every
CrabError class registers itself under it, see ``crabd.errors``) and
``attrs`` its :attr:`~crabd.errors.CrabError.fields`.  The SDK turns that back
into the same class through its keyword constructor, so the same checks
apply as at a raise site (``tests/unit/test_wire_errors.py`` round-trips every
class).  A gRPC failure without those details (daemon gone, transport
error), or with details that do not fit the class (another crab version),
becomes :class:`DaemonUnavailable` or a plain :class:`CrabError` by its
status code.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from crabd.errors import CrabError, DaemonUnavailable, error_class
from crabd.errors.client import unreachable

METADATA_KEY = "crab-error"


def _jsonable(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def encode(err: CrabError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """Status code, message and trailing metadata for ``err``."""
    code = getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL)
    details = {
        "kind": type(err).__name__,
        "message": err.message,
        "hint": err.hint,
        "attrs": _jsonable(err.attrs),
    }
    return code, err.message, ((METADATA_KEY, json.dumps(details)),)


def decode(exc: grpc.RpcError, *, socket: str = "") -> CrabError:
    """The CrabError a failed call stands for."""
    metadata: Any = None
    trailing = getattr(exc, "trailing_metadata", None)
    if callable(trailing):
        metadata = trailing()
    for key, value in metadata or ():
        if key == METADATA_KEY:
            try:
                details = json.loads(value)
                cls = error_class(str(details.get("kind", "CrabError")))
                attrs = details.get("attrs") or {}
                return cls(str(details["message"]), hint=details.get("hint"), **attrs)
            except (ValueError, KeyError, TypeError):
                break
    code_fn = getattr(exc, "code", None)
    code = code_fn() if callable(code_fn) else None
    details_fn = getattr(exc, "details", None)
    text = details_fn() if callable(details_fn) else str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or code is None:
        return unreachable(socket, text)  # says which: no socket, no permission, or a stale one
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DaemonUnavailable(
            f"crabd did not answer in time: {text}",
            socket=socket,
            hint="crabd may be overloaded; retry, or raise the call's timeout.",
        )
    return CrabError(f"crabd failed the request ({code.name}): {text}")
