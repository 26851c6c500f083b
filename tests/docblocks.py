"""The code blocks of README.md and docs/*.md, as the docs tests run them.

Every fenced ``python`` or ``sh`` block (``py``, ``bash``, ``shell`` count
too) carries a decision in an HTML comment on the line right above its
fence, invisible once rendered:

    <!-- doctest: run -->
    <!-- doctest: parse-only (needs a vLLM server) -->
    <!-- doctest: skip (output sample) -->

``run``: the docs tests run it (Python standalone, shell command by command)
against a private crabd.  ``parse-only``: it needs what a test host lacks; it
is only checked to parse (``ast.parse``, ``bash -n``).  ``skip``: not meant to
be run as written (an output sample, a fragment).  The reason is required for
the last two.  Blocks in other languages (``text``, ``toml``, ...) are not
code a reader runs and need no decision.

A line may claim what it prints with a trailing comment that starts with a
double-quoted string: ``print(x)  # "test /work"``.  The docs tests assert the
claimed text appears (in order) in the output; ``...`` inside a claim stands
for any text, e.g. ``# "turn 3: done ck-..."``.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

#: Fence languages that are code a reader runs, and the runner each gets.
LANGUAGES = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "shell": "sh"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*doctest:\s*(?P<action>[a-z-]+)\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")
_ANY_MARKER = re.compile(r"<!--\s*doctest\b")
_CLAIMS = re.compile(r'^#\s*(?P<list>"(?:[^"\\]|\\.)+"(?:\s*,\s*"(?:[^"\\]|\\.)+")*)')
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)+)"')


class Action(StrEnum):
    RUN = "run"
    PARSE_ONLY = "parse-only"
    SKIP = "skip"


class MarkerError(ValueError):
    """A doctest marker that does not parse, or that names no reason where one is needed."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its runner (``python`` or ``sh``), its code and its decision."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    decision: Decision | None

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def parse_marker(text: str) -> Decision | None:
    """The decision a marker line states; None if the line is no marker.  Raises MarkerError if it is a bad one."""
    if not _ANY_MARKER.search(text):
        return None
    m = _MARKER.match(text)
    if m is None:
        raise MarkerError(f"malformed doctest marker: {text.strip()!r} (want <!-- doctest: ACTION (REASON) -->)")
    try:
        action = Action(m["action"])
    except ValueError:
        raise MarkerError(
            f"unknown doctest action {m['action']!r} in {text.strip()!r}: one of run, parse-only, skip"
        ) from None
    reason = (m["reason"] or "").strip()
    if action is not Action.RUN and not reason:
        raise MarkerError(f"doctest {action} needs a reason in parentheses: {text.strip()!r}")
    return Decision(action, reason)


def blocks(path: Path, text: str | None = None) -> list[Block]:
    """Every python/sh block in the markdown file ``path`` (or in ``text``, named ``path``)."""
    lines = (path.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        end = i + 1
        while end < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        lang = LANGUAGES.get(info.split()[0].lower() if info else "")
        if lang is not None:
            body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : end]]
            marker = _marker_above(lines, i, path)
            found.append(Block(path, i + 1, lang, "\n".join(body) + "\n", marker))
        i = end + 1
    return found


def _marker_above(lines: list[str], fence: int, path: Path) -> Decision | None:
    """The decision on the line right above the fence (blank lines between are allowed)."""
    j = fence - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0:
        return None
    try:
        return parse_marker(lines[j])
    except MarkerError as exc:
        raise MarkerError(f"{path.name}:{j + 1}: {exc}") from None


def doc_files(repo: Path) -> list[Path]:
    """The markdown a user reads: README.md and docs/*.md."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def all_blocks(repo: Path) -> list[Block]:
    return [b for path in doc_files(repo) for b in blocks(path)]


# --- what a block claims to print ------------------------------------------------------


def _claims_in_comment(comment: str) -> list[str]:
    m = _CLAIMS.match(comment.strip())
    if m is None:
        return []
    return [q.replace('\\"', '"') for q in _QUOTED.findall(m["list"])]


def python_claims(code: str) -> list[str]:
    """The claims of a Python block's comments, in order (a ``#`` inside a string is no comment)."""
    out: list[str] = []
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            out += _claims_in_comment(tok.string)
    return out


def shell_comment(line: str) -> str:
    """The comment that ends one shell line ('' if none): a ``#`` outside quotes, at a word start."""
    quote = ""
    escaped = False
    for k, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[k:]
    return ""


@dataclass(frozen=True)
class Command:
    """One shell command of a block: its text (continuation lines joined), its line in the block, its claims."""

    text: str
    line: int  # 1-based, within the block's code
    claims: list[str]


def shell_commands(code: str) -> list[Command]:
    """A shell block's commands, one per logical line; blank and comment-only lines dropped."""
    out: list[Command] = []
    pending: list[str] = []
    start = 0
    for n, raw in enumerate(code.splitlines(), 1):
        if not pending:
            start = n
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
        if raw.endswith("\\"):
            pending.append(raw)
            continue
        pending.append(raw)
        text = "\n".join(pending)
        out.append(Command(text, start, _claims_in_comment(shell_comment(raw))))
        pending = []
    if pending:
        out.append(Command("\n".join(pending), start, []))
    return out


def claim_pattern(claim: str) -> re.Pattern[str]:
    """The regex a claim stands for: its text, with ``...`` matching any text on one line."""
    return re.compile(".*?".join(re.escape(part) for part in claim.split("...")))


def missing_claims(claims: list[str], output: str) -> list[str]:
    """The claims that do not appear in ``output`` in their order ([] when all do)."""
    pos = 0
    for k, claim in enumerate(claims):
        m = claim_pattern(claim).search(output, pos)
        if m is None:
            return claims[k:]
        pos = m.end()
    return []


# --- running a shell block command by command ------------------------------------------------

#: Frames each command's output; no command prints it (and no line-break character is in it).
_SEP = "@@doctest-f3a9@@"


def shell_script(commands: list[Command]) -> str:
    """One bash script that runs ``commands`` in order in one shell (variables carry over).

    Each command's output (stdout and stderr together) is framed by markers, with its exit
    status; the script stops at the first command that fails (exit 97).
    """
    parts: list[str] = []
    for k, c in enumerate(commands):
        parts.append(f"printf '{_SEP}cmd %d\\n' {k}")
        # The newline before the brace: a trailing comment must not swallow it.
        parts.append(f"{{ {c.text}\n}} 2>&1")
        # A newline first: output that does not end with one must not hide the marker.
        parts.append(f"__rc=$?; printf '\\n{_SEP}rc %d\\n' $__rc; [ $__rc -eq 0 ] || exit 97")
    return "\n".join(parts) + "\n"


@dataclass(frozen=True)
class Ran:
    """What one command of a shell block did: its output, and its exit status (None: it never finished)."""

    output: str
    rc: int | None


def split_output(stdout: str, n: int) -> list[Ran]:
    """The per-command outputs of :func:`shell_script`'s run (the commands that started, in order)."""
    runs: list[Ran] = []
    current: list[str] | None = None
    for line in stdout.split("\n"):
        if line.startswith(f"{_SEP}cmd "):
            current = []
        elif line.startswith(f"{_SEP}rc ") and current is not None:
            runs.append(Ran("".join(current), int(line.split()[-1])))
            current = None
        elif current is not None:
            current.append(line + "\n")
    if current is not None:
        runs.append(Ran("".join(current), None))
    assert len(runs) <= n
    return runs
