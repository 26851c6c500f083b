"""CrabError survives the trip through gRPC status + metadata."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from crabd.api import errors as wire
from crabd.errors import CrabError, DaemonUnavailable, PermissionDenied, SandboxDead
from tests.unit.test_errors import crabd_error_classes


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailers: Any = ()) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailers


def test_round_trip_keeps_class_attrs_and_hint() -> None:
    err = SandboxDead("sandbox x is dead", sandbox="x", container_id="c", exit_code=137, oom_killed=True, reason="OOM")
    code, message, trailers = wire.encode(err)
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    back = wire.decode(FakeRpcError(code, message, trailers))
    assert type(back) is SandboxDead
    assert back.exit_code == 137 and back.oom_killed is True and back.reason == "OOM"
    assert back.hint == err.hint and str(back) == "sandbox x is dead"


@pytest.mark.parametrize("char", ["x", "\u00e9", "\U0001f980", "\x01"])
def test_an_error_quoting_a_huge_input_still_arrives_as_itself(char: str) -> None:
    # A caller's 1 MB word quoted in the message, the hint and attrs; non-ASCII and control
    # characters grow up to 12-fold on the wire.  gRPC's client rejects metadata past 8-16 KiB.
    huge = char * 1_000_000
    err = SandboxDead(f"unknown word {huge!r}", sandbox=huge, reason=huge, hint=huge)
    code, message, trailers = wire.encode(err)
    assert wire._status_size(message) + sum(len(k) + len(v) for k, v in trailers) <= wire.METADATA_BUDGET
    assert all(v.isascii() for _, v in trailers)
    back = wire.decode(FakeRpcError(code, message, trailers))
    assert type(back) is SandboxDead
    assert back.message.startswith("unknown word '") and back.message.endswith("more characters)")
    assert back.sandbox.endswith("more characters)") and back.hint.endswith("more characters)")


def test_a_long_but_reasonable_message_arrives_whole() -> None:
    excerpt = "\n".join(
        f"(00.{i:06d}) Error (criu/sk-unix.c:{i}): unix: something failed on a socket" for i in range(15)
    )
    code, message, trailers = wire.encode(CrabError(f"the dump failed: {excerpt}"))
    assert message == f"the dump failed: {excerpt}"
    assert wire.decode(FakeRpcError(code, message, trailers)).message == message


def test_permission_denied_code() -> None:
    code, _, _ = wire.encode(PermissionDenied("no", uid=5, sandbox="s"))
    assert code is grpc.StatusCode.PERMISSION_DENIED


def test_transport_errors_become_daemon_unavailable() -> None:
    back = wire.decode(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connect failed"), socket="/x.sock")
    assert isinstance(back, DaemonUnavailable) and "/x.sock" in str(back)


def test_unknown_kind_falls_back_to_base() -> None:
    trailers = ((wire.METADATA_KEY, '{"kind": "FutureError", "message": "m", "hint": "h", "attrs": {}}'),)
    back = wire.decode(FakeRpcError(grpc.StatusCode.INTERNAL, "m", trailers))
    assert type(back) is CrabError and back.hint == "h"


#: A value per field type, unlike every default, so a field lost on the way shows.
SAMPLES: dict[Any, Any] = {
    str: "s-1",
    int: 7,
    float: 1.5,
    bool: True,
    str | None: "s-2",
    int | None: 8,
    list[str]: ["a", "b"],
    list[int]: [3, 4],
    Sequence[str]: ("argv0", "-x"),
}


def _sample(cls: type[CrabError]) -> CrabError:
    hints = typing.get_type_hints(cls.__init__)
    values = {}
    for name in cls.fields:
        if hints[name] not in SAMPLES:
            pytest.fail(f"{cls.__name__}.{name}: add a sample for {hints[name]} to SAMPLES")
        values[name] = SAMPLES[hints[name]]
    return cls(f"{cls.__name__} happened", hint="do this", **values)


@pytest.mark.parametrize("cls", [CrabError, *crabd_error_classes()], ids=lambda c: c.__name__)
def test_every_error_class_round_trips(cls: type[CrabError]) -> None:
    err = _sample(cls)
    code, message, trailers = wire.encode(err)
    assert code.name == err.grpc_code  # an instance may refine its class's code (RemoteStoreError: retryable)
    back = wire.decode(FakeRpcError(code, message, trailers))
    assert type(back) is cls
    assert back.attrs == err.attrs and back.hint == "do this" and str(back) == str(err)
