"""Typed access to settings.

A setting that is absent falls back to the default given by the caller (or
raises MissingSetting when there is none).  A setting that is present but
malformed is a deployment mistake that must not go unnoticed: it always
raises ConfigError naming the variable, even when a default was given.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, TypeVar

from appconfig.dotenv import parse_dotenv

T = TypeVar("T")
_NO_DEFAULT: object = object()
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A setting is present but its value is malformed."""


class MissingSetting(KeyError):
    """A required setting is absent."""


def _to_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"not a boolean: {raw!r}")


def _to_port(raw: str) -> int:
    port = int(raw)
    if not 0 < port < 65536:
        raise ValueError(f"port out of range: {port}")
    return port


class Settings:
    def __init__(self, env: Mapping[str, str], prefix: str = "") -> None:
        self._env = dict(env)
        self.prefix = prefix

    @classmethod
    def from_environ(cls, prefix: str = "", dotenv_path: str | None = None) -> Settings:
        """Variables from a .env file, overridden by the real environment."""
        env: dict[str, str] = {}
        if dotenv_path and os.path.exists(dotenv_path):
            with open(dotenv_path, encoding="utf-8") as f:
                env.update(parse_dotenv(f.read()))
        env.update(os.environ)
        return cls(env, prefix)

    def _get(self, name: str, default: object, convert: Callable[[str], T]) -> T:
        key = self.prefix + name
        try:
            return convert(self._env[key])
        except (KeyError, ValueError):
            if default is _NO_DEFAULT:
                raise MissingSetting(key) from None
            return default  # type: ignore[return-value]

    def str(self, name: str, default: object = _NO_DEFAULT) -> str:
        return self._get(name, default, lambda raw: raw)

    def int(self, name: str, default: object = _NO_DEFAULT) -> int:
        return self._get(name, default, int)

    def float(self, name: str, default: object = _NO_DEFAULT) -> float:
        return self._get(name, default, float)

    def bool(self, name: str, default: object = _NO_DEFAULT) -> bool:
        return self._get(name, default, _to_bool)

    def port(self, name: str, default: object = _NO_DEFAULT) -> int:
        return self._get(name, default, _to_port)

    def list(self, name: str, default: object = _NO_DEFAULT, sep: str = ",") -> list[str]:
        return self._get(name, default, lambda raw: [p.strip() for p in raw.split(sep) if p.strip()])
