"""Constraints such as ``>=1.2.0``, ``<2.0.0`` or ``^1.4.0``, comma-separated (all must hold)."""

from __future__ import annotations

from vertools.semver import Version, compare, parse

_OPS = {
    ">=": lambda c: c >= 0,
    "<=": lambda c: c <= 0,
    ">": lambda c: c > 0,
    "<": lambda c: c < 0,
    "=": lambda c: c == 0,
}


def _caret_upper(v: Version) -> Version:
    if v.major:
        return Version(v.major + 1, 0, 0)
    if v.minor:
        return Version(0, v.minor + 1, 0)
    return Version(0, 0, v.patch + 1)


def satisfies(version: str | Version, constraint: str) -> bool:
    v = version if isinstance(version, Version) else parse(version)
    for part in (p.strip() for p in constraint.split(",") if p.strip()):
        if part.startswith("^"):
            low = parse(part[1:])
            if not (compare(v, low) >= 0 and compare(v, _caret_upper(low)) < 0):
                return False
            continue
        for op in sorted(_OPS, key=len, reverse=True):
            if part.startswith(op):
                if not _OPS[op](compare(v, parse(part[len(op) :]))):
                    return False
                break
        else:
            if compare(v, parse(part)) != 0:
                return False
    return True
