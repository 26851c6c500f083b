from __future__ import annotations

from crabd.errors import CrabError, CriuError, HostError, error_class


def test_attrs_and_hint() -> None:
    err = CriuError("dump failed", log_path="/var/log/crab/x.log", log_excerpt="Error (criu/x.c:1)")
    assert err.log_path == "/var/log/crab/x.log"
    assert err.attrs["log_excerpt"].startswith("Error")
    assert "CRIU log" in err.hint
    assert "hint:" in err.describe()


def test_every_error_is_a_crab_error_and_registered() -> None:
    assert issubclass(HostError, CrabError)
    assert error_class("CriuError") is CriuError
    assert error_class("SomethingElse") is CrabError


def test_explicit_hint_wins() -> None:
    assert HostError("x", hint="do y").hint == "do y"
