"""Where crabd's configuration file is, and the one setting a client needs from it, without pydantic.

:mod:`crabd.config` is the configuration's one definition (pydantic models,
``extra="forbid"``).  Building those models costs more than a whole
``crabctl ps`` may take (pydantic's import alone is ~35 ms), and a client
needs one setting only: the socket.  So the file's location, the socket's
default and :func:`socket_path` live here; :mod:`crabd.config` takes its
defaults from this module, and ``tests/unit/test_config_file.py`` checks
that :func:`socket_path` agrees with ``load_config(...).paths.socket``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from crabd.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/crab/crabd.toml")
DEFAULT_SOCKET = Path("/run/crab/crabd.sock")


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The config file in force: ``explicit``, else ``$CRAB_CONFIG``, else the default."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get("CRAB_CONFIG")
    return Path(env) if env else DEFAULT_CONFIG_PATH


def read_toml(path: str | os.PathLike[str] | None = None) -> tuple[Path, dict[str, Any]]:
    """The config file in force and its parsed TOML (``{}`` when a default location has no file).

    A file named explicitly (``--config``) must exist.
    """
    p = config_path(path)
    if not p.exists():
        if path is not None:
            raise ConfigError(f"config file {p} does not exist", path=str(p), hint="Create it or drop --config.")
        return p, {}
    # tomllib is imported here: a host without a config file never pays for it.
    import tomllib

    try:
        with p.open("rb") as fh:
            return p, tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {p}: {exc}", path=str(p)) from exc


def socket_path(path: str | os.PathLike[str] | None = None) -> Path:
    """crabd's socket as the config file in force sets it (``[paths] socket``), else the default.

    Only that one value is read and checked; crabd itself validates the whole
    file at start-up (:func:`crabd.config.load_config`).
    """
    p, data = read_toml(path)
    paths = data.get("paths", {})
    if not isinstance(paths, dict):
        raise ConfigError(f"invalid configuration in {p}: paths: not a table", path=str(p))
    value = paths.get("socket", DEFAULT_SOCKET)
    if not isinstance(value, str | Path):
        raise ConfigError(f"invalid configuration in {p}: paths.socket: not a path: {value!r}", path=str(p))
    return Path(value)
