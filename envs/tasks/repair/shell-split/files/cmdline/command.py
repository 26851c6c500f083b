"""Commands: leading ``NAME=value`` assignments, then the argument vector."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from cmdline.lexer import join, split

_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Command:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        assignments = [f"{k}={v}" for k, v in self.env.items()]
        return join(assignments + self.argv)


def parse_command(line: str) -> Command:
    """``LANG=C sort -u "my file"`` -> Command(["sort", "-u", "my file"], {"LANG": "C"})."""
    words = split(line)
    env: dict[str, str] = {}
    while words and _ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if not words:
        raise ValueError("no command, only assignments" if env else "empty command line")
    return Command(words, env)


def expand_alias(line: str, aliases: Mapping[str, str]) -> Command:
    """Replace the command name by its alias (once; aliases do not recurse)."""
    cmd = parse_command(line)
    if cmd.argv[0] in aliases:
        cmd.argv[:1] = split(aliases[cmd.argv[0]])
    return cmd
