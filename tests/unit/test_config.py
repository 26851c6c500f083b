from __future__ import annotations

from pathlib import Path

import pytest

from crabd.config import CrabConfig, load_config
from crabd.errors import ConfigError


def test_defaults_when_file_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRAB_CONFIG", str(tmp_path / "absent.toml"))
    cfg = load_config()
    assert cfg == CrabConfig()
    assert cfg.paths.socket == Path("/run/crab/crabd.sock")
    assert cfg.paths.state_dir == Path("/var/lib/crab")


def test_file_values_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "crabd.toml"
    f.write_text('[paths]\nstate_dir = "/srv/crab"\n[docker]\ntimeout_s = 5\n')
    cfg = load_config(f, overrides={"paths": {"socket": "/tmp/x.sock"}})
    assert cfg.paths.state_dir == Path("/srv/crab")
    assert cfg.paths.socket == Path("/tmp/x.sock")
    assert cfg.docker.timeout_s == 5


def test_unknown_key_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "crabd.toml"
    f.write_text('[paths]\nstate_dirr = "/srv/crab"\n')
    with pytest.raises(ConfigError, match=r"paths\.state_dirr"):
        load_config(f)


def test_bad_value_and_bad_toml(tmp_path: Path) -> None:
    f = tmp_path / "crabd.toml"
    f.write_text("[docker]\ntimeout_s = -1\n")
    with pytest.raises(ConfigError, match="timeout_s"):
        load_config(f)
    f.write_text("[docker\n")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(f)


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
