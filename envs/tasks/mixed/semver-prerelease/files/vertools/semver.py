"""Semantic Versioning 2.0.0: parsing and precedence (docs/versioning.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_VERSION = re.compile(
    r"^v?(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
)


class VersionError(ValueError):
    pass


@dataclass(frozen=True)
class Version:
    major: int
    minor: int
    patch: int
    pre: tuple[str, ...] = ()
    build: tuple[str, ...] = field(default=(), compare=False)

    @property
    def is_prerelease(self) -> bool:
        return bool(self.pre)

    def key(self) -> tuple[object, ...]:
        """What versions are ordered by (build metadata left out)."""
        return (self.major, self.minor, self.patch, self.pre)

    def __lt__(self, other: Version) -> bool:
        return self.key() < other.key()

    def __le__(self, other: Version) -> bool:
        return self.key() <= other.key()

    def __str__(self) -> str:
        s = f"{self.major}.{self.minor}.{self.patch}"
        if self.pre:
            s += "-" + ".".join(self.pre)
        if self.build:
            s += "+" + ".".join(self.build)
        return s


def parse(text: str) -> Version:
    m = _VERSION.match(text.strip())
    if m is None:
        raise VersionError(f"not a semantic version: {text!r}")
    major, minor, patch, pre, build = m.groups()
    return Version(int(major), int(minor), int(patch), tuple(pre.split(".")) if pre else (),
                   tuple(build.split(".")) if build else ())


def compare(a: str | Version, b: str | Version) -> int:
    """-1, 0 or 1 as ``a`` is lower than, equal to (build ignored) or higher than ``b``."""
    ka = (a if isinstance(a, Version) else parse(a)).key()
    kb = (b if isinstance(b, Version) else parse(b)).key()
    return (ka > kb) - (ka < kb)
