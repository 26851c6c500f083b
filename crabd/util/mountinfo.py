"""``/proc/<pid>/mountinfo`` lines, parsed (proc(5)).

Each line: ``id parent major:minor root mount-point mount-options
[optional fields...] - fstype source super-options``; the paths escape
space, tab, newline and backslash as ``\\ooo`` (octal).  Lines this cannot
read are skipped: the kernel writes none, so such a line names nothing a
caller looks for.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_ESCAPE = re.compile(r"\\([0-7]{3})")
#: The optional fields start here; the ``-`` separator is at this index or later.
_OPTIONAL = 6


@dataclass(frozen=True)
class Mount:
    """One mountinfo line's fields."""

    mount_id: int
    parent: int
    dev: int
    root: str
    point: str
    fstype: str
    #: The super block's options (``rw,mode=755``, a cgroup's controllers).
    super_options: str


def unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order (the last at a point is the one on top)."""
    out = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", _OPTIONAL)
            major, minor = fields[2].split(":")
            out.append(
                Mount(
                    int(fields[0]),
                    int(fields[1]),
                    os.makedev(int(major), int(minor)),
                    unescape(fields[3]),
                    unescape(fields[4]),
                    fields[sep + 1],
                    fields[sep + 3],
                )
            )
        except (ValueError, IndexError):
            continue
    return out
