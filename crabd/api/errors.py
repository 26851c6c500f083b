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
#: What an error may put in a reply's metadata: its status message and the ``crab-error`` key
#: together.  A gRPC client rejects metadata past 8 KiB now and then and past 16 KiB always
#: ("received metadata size exceeds hard limit"), so an error quoting a caller's long input (an
#: unknown word of 20 KB) reached the caller as RESOURCE_EXHAUSTED, not as itself.  Texts are
#: clipped to fit: first at MAX_TEXT characters (a CRIU log excerpt fits whole), then shorter.
METADATA_BUDGET = 7 * 1024
MAX_TEXT = 4096
MAX_ATTR_TEXT = 256
MIN_TEXT = 64


def _clipped(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _status_size(message: str) -> int:
    """The bytes of ``message`` as gRPC sends it (``grpc-message``: percent-encoded outside printable ASCII)."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in message.encode())


def _jsonable(value: Any, limit: int) -> Any:
    """``value`` as JSON can hold it, each text clipped to ``limit`` characters."""
    if isinstance(value, str):
        return _clipped(value, limit)
    if isinstance(value, int | float | bool) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v, limit) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, limit) for k, v in value.items()}
    return _clipped(str(value), limit)


def encode(err: CrabError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """Status code, message and trailing metadata for ``err``, within :data:`METADATA_BUDGET`."""
    code = getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL)
    limit = MAX_TEXT
    while True:
        message = _clipped(err.message, limit)
        details = {
            "kind": type(err).__name__,
            "message": message,
            "hint": err.hint if err.hint is None else _clipped(err.hint, limit),
            "attrs": _jsonable(err.attrs, min(limit, MAX_ATTR_TEXT)),
        }
        text = json.dumps(details)  # ASCII (metadata must be): a character may take 12 bytes
        if _status_size(message) + len(text) <= METADATA_BUDGET or limit <= MIN_TEXT:
            return code, message, ((METADATA_KEY, text),)
        limit //= 4


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
