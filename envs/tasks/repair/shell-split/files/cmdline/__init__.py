"""Splitting and joining POSIX-shell-like command lines (no expansions)."""

from cmdline.command import Command, expand_alias, parse_command
from cmdline.lexer import join, quote, split

__all__ = ["Command", "expand_alias", "join", "parse_command", "quote", "split"]
