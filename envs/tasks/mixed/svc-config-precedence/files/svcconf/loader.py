"""Settings from the defaults, an INI file and the environment (see docs/configuration.md)."""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from svcconf.coerce import coerce
from svcconf.defaults import DEFAULTS

SECTION = "service"
ENV_PREFIX = "SVC_"


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    values: Mapping[str, object]

    def __getattr__(self, name: str) -> object:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def _from_file(path: Path) -> dict[str, object]:
    parser = configparser.ConfigParser()
    if not parser.read(path, encoding="utf-8"):
        raise ConfigError(f"{path}: cannot read")
    if not parser.has_section(SECTION):
        return {}
    out: dict[str, object] = {}
    for name, text in parser.items(SECTION):
        if name not in DEFAULTS:
            raise ConfigError(f"{path}: unknown setting {name!r}")
        out[name] = _converted(name, text)
    return out


def _from_env(environ: Mapping[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, text in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name in DEFAULTS:
            out[name] = _converted(name, text)
    return out


def _converted(name: str, text: str) -> object:
    try:
        return coerce(name, text, DEFAULTS[name])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def load(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """The effective settings: the defaults, overridden by the file, overridden by the environment."""
    file_values = _from_file(Path(path)) if path is not None else {}
    env_values = _from_env(os.environ if environ is None else environ)
    merged = dict(DEFAULTS, **env_values)
    merged.update(file_values)
    return Settings(merged)
