"""A small state machine for the quoting rules of a POSIX shell.

* Outside quotes, blanks separate words and a backslash makes the next
  character literal.
* Inside single quotes every character is literal.
* Inside double quotes a backslash escapes only ``"`` and ``\\``; before any
  other character it stays a literal backslash (``"C:\\temp"`` keeps it).
* Quoted and unquoted parts next to each other make one word, and ``""`` is
  an empty word.

This follows ``shlex.split`` (POSIX mode, no comments), without needing it.
"""

from __future__ import annotations

import re

BLANKS = " \t\r\n"
NORMAL, SINGLE, DOUBLE, ESCAPE = "normal", "single-quoted", "double-quoted", "escape"
_SAFE = re.compile(r"[\w@%+=:,./-]+", re.ASCII)


def split(line: str) -> list[str]:
    words: list[str] = []
    buf: list[str] = []
    in_word = False
    state = NORMAL
    escaped_from = NORMAL  # the state a backslash was met in
    for ch in line:
        if state == NORMAL:
            if ch in BLANKS:
                if in_word:
                    words.append("".join(buf))
                    buf, in_word = [], False
            elif ch == "'":
                state, in_word = SINGLE, True
            elif ch == '"':
                state, in_word = DOUBLE, True
            elif ch == "\\":
                escaped_from, state, in_word = NORMAL, ESCAPE, True
            else:
                buf.append(ch)
                in_word = True
        elif state == SINGLE:
            if ch == "'":
                state = NORMAL
            else:
                buf.append(ch)
        elif state == DOUBLE:
            if ch == '"':
                state = NORMAL
            elif ch == "\\":
                escaped_from, state = DOUBLE, ESCAPE
            else:
                buf.append(ch)
        else:  # ESCAPE: ch is the character after a backslash
            if escaped_from == DOUBLE and ch not in '"\\':
                buf.append("\\")
            buf.append(ch)
            state = NORMAL
    if state == ESCAPE:
        raise ValueError("no character after the final backslash")
    if state != NORMAL:
        raise ValueError(f"unterminated {state} string")
    if in_word:
        words.append("".join(buf))
    return words


def quote(word: str) -> str:
    """``word`` quoted so that ``split`` gives it back unchanged."""
    if word and _SAFE.fullmatch(word):
        return word
    return "'" + word.replace("'", "'\"'\"'") + "'"


def join(words: list[str]) -> str:
    return " ".join(quote(w) for w in words)
