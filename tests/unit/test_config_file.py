"""The client's cheap read of crabd.toml (crabd.config_file) agrees with the full configuration (crabd.config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from crabd.config import load_config
from crabd.config_file import DEFAULT_SOCKET, config_path, socket_path
from crabd.errors import ConfigError
from crabd.sdk._requests import default_socket

# Files crabd accepts, each with what a client must take as the socket.
VALID = {
    "empty": "",
    "other sections": "[docker]\ntimeout_s = 5\n[limits]\nmax_pids = 5000\n",
    "paths without socket": '[paths]\nstate_dir = "/srv/crab"\n',
    "socket": '[paths]\nsocket = "/srv/crab/crabd.sock"\n',
    "relative socket": '[paths]\nsocket = "crabd.sock"\n',
}


@pytest.mark.parametrize("text", list(VALID.values()), ids=list(VALID))
def test_socket_path_is_the_socket_load_config_reads(text: str, tmp_path: Path) -> None:
    f = tmp_path / "crabd.toml"
    f.write_text(text)
    assert socket_path(f) == load_config(f).paths.socket


def test_no_file_at_the_default_location_means_the_default_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRAB_CONFIG", str(tmp_path / "absent.toml"))
    assert config_path() == tmp_path / "absent.toml"
    assert socket_path() == DEFAULT_SOCKET == load_config().paths.socket


def test_a_missing_explicit_file_and_a_bad_one_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as missing:
        socket_path(tmp_path / "absent.toml")
    assert missing.value.hint == "Create it or drop --config."
    f = tmp_path / "crabd.toml"
    for text, match in [
        ("[paths\n", "cannot read"),
        ("paths = 1\n", "paths: not a table"),
        ("[paths]\nsocket = 1\n", "paths.socket: not a path"),
    ]:
        f.write_text(text)
        with pytest.raises(ConfigError, match=match):
            socket_path(f)
        with pytest.raises(ConfigError):  # crabd refuses the same file
            load_config(f)


def test_default_socket_prefers_the_environment_then_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "crabd.toml"
    f.write_text('[paths]\nsocket = "/srv/crab/crabd.sock"\n')
    monkeypatch.setenv("CRAB_CONFIG", str(f))
    monkeypatch.delenv("CRAB_SOCKET", raising=False)
    assert default_socket() == Path("/srv/crab/crabd.sock")
    monkeypatch.setenv("CRAB_SOCKET", "/elsewhere.sock")
    assert default_socket() == Path("/elsewhere.sock")
    # An unreadable file is crabd's to report; a client falls back to the default socket.
    monkeypatch.delenv("CRAB_SOCKET")
    f.write_text("[paths\n")
    assert default_socket() == DEFAULT_SOCKET
