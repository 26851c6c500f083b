"""logfmt: space-separated ``key=value`` pairs; a value with spaces is double-quoted,
and inside quotes ``\\"`` stands for a quote and ``\\\\`` for a backslash.
A bare key (no ``=``) means ``key=true``.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

_PAIR = re.compile(
    r"""
    (?P<key>[A-Za-z_][\w.\-]*)
    (?:=
        (?:
            "(?P<quoted>.*)"     # a double-quoted value, with \" escapes
          | (?P<bare>[^\s"]*)    # or a bare word (possibly empty)
        )
    )?
    (?=\s|$)
    """,
    re.VERBOSE,
)

_UNESCAPE = re.compile(r"\\(.)")


def _unescape(text: str) -> str:
    return _UNESCAPE.sub(lambda m: m.group(1), text)


def parse_line(line: str) -> dict[str, str]:
    """The pairs of one log line, in order; later duplicates win.

    Raises ValueError on text that is not logfmt (e.g. an unterminated quote).
    """
    out: dict[str, str] = {}
    pos, line = 0, line.rstrip("\n")
    while pos < len(line):
        if line[pos].isspace():
            pos += 1
            continue
        m = _PAIR.match(line, pos)
        if m is None:
            raise ValueError(f"not logfmt at column {pos + 1}: {line[pos:pos + 20]!r}")
        if m.group("quoted") is not None:
            value = _unescape(m.group("quoted"))
        elif m.group("bare") is not None:
            value = m.group("bare")
        else:
            value = "true"
        out[m.group("key")] = value
        pos = m.end()
    return out


def parse_lines(lines: Iterable[str]) -> Iterator[dict[str, str]]:
    """Parse each non-blank line; a bad line raises ValueError with its number."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield parse_line(line)
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
