"""Every `crabctl ...` that crab tells a user to run parses against the real command tree.

The mentions come from crabd's own source (error hints, help texts, messages: anything in
backticks) and from the docs (README.md and docs/*.md: inline code, and the lines of code
blocks that run crabctl).  Each is walked through crabctl's click commands: every command
word must be a command of its group, every option one of its command's, and there must be
no more positional arguments than the command takes.  Placeholders (SB, CK, N, FILE, ...)
stand for arguments; ``...`` ends what is checked.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer import _click
from typer.main import get_command

import crabd.cli.main  # noqa: F401  (mounts every command on the app)
from crabd.cli.common import app
from crabd.cli.core import CrabGroup, ExecCommand

ROOT = Path(__file__).resolve().parents[2]
_TICKED = re.compile(r"`((?:sudo )?crabctl(?: [^`]*)?)`")
_FENCE = re.compile(r"^\s*```")
_RUN_LINE = re.compile(r"^\s*(?:\$ )?(?:sudo )?(crabctl\b.*)$")


def mentions() -> Iterator[tuple[str, str]]:
    """(where, command) for every crabctl command crab's source and docs mention."""
    for path in sorted((ROOT / "crabd").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in _TICKED.finditer(line):
                for cmd in _substituted(m.group(1)):
                    yield f"{path.relative_to(ROOT)}:{n}", cmd
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fenced = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}"
            if _FENCE.match(line):
                fenced = not fenced
                continue
            if fenced:
                run = _RUN_LINE.match(line)
                if run and not _DRAWING.search(line):
                    for part in _commands(run.group(1)):
                        for cmd in _substituted(part):
                            if cmd.startswith("crabctl"):
                                yield where, cmd
                continue
            for m in _TICKED.finditer(line.replace("\\|", "|")):
                for cmd in _substituted(m.group(1)):
                    yield where, cmd


_SUBST = re.compile(r"\$\(([^()]*)\)")


def _substituted(cmd: str) -> Iterator[str]:
    """``cmd`` with each ``$(...)`` as one placeholder argument, then each substituted command itself."""
    yield _SUBST.sub("X", cmd)
    for m in _SUBST.finditer(cmd):
        yield m.group(1).strip()


_DRAWING = re.compile("[\u2500-\u257f]")  # box drawing: a diagram, not a command


def _commands(line: str) -> Iterator[str]:
    """The commands of a shell line: split at ``&&``, ``;`` and ``|`` outside quotes, less a ``# comment``."""
    part, quote, i = "", "", 0
    while i < len(line):
        ch = line[i]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (not part or part[-1].isspace()):
            break
        elif line.startswith("&&", i) or ch in ";|":
            yield part.strip()
            part, i = "", i + (2 if line.startswith("&&", i) else 1)
            continue
        part += ch
        i += 1
    yield part.strip()


def _tokens(text: str) -> list[str]:
    text = re.sub(r"\{[^}]*\}", "X", text.replace("\\|", "|"))  # an f-string's fields: placeholders
    # Optional parts ([--name N], [SB]) are checked as if given.
    text = text.replace("[OPTIONS]", "").replace("[", " ").replace("]", " ")
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    out: list[str] = []
    for w in words:
        if w == "sudo":
            continue
        out.append(w)
    return out[1:]  # less "crabctl"


def _option(cmd: _click.Command, name: str) -> _click.core.Parameter | None:
    if name in ("-h", "--help"):
        return cmd.get_help_option(_click.Context(cmd, help_option_names=["-h", "--help"]))
    for p in cmd.params:
        if name in (*p.opts, *p.secondary_opts) and not p.opts[0].isalpha():
            return p
    return None


def problem(text: str) -> str | None:
    """Why ``text`` does not parse as a crabctl command (None: it does)."""
    cmd: _click.Command = get_command(app)
    path = "crabctl"
    args = 0
    tokens = _tokens(text)
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t == "..." or t == "--":
            return None
        if t.startswith("-") and len(t) > 1:
            name = t.split("=", 1)[0]
            opt = _option(cmd, name)
            if opt is None:
                return f"`{path}` has no option {name}"
            takes_value = not (getattr(opt, "is_flag", False) or getattr(opt, "count", False))
            if takes_value and "=" not in t:
                i += 1
                value = tokens[i] if i < len(tokens) else ""
                if name in ("-e", "--env") and value and "=" not in value and not value.isupper():
                    return f"`{path} {name} {value}`: -e/--env takes KEY=VAL (the env image is positional)"
            i += 1
            continue
        if isinstance(cmd, CrabGroup):
            for alt in re.split(r"[|/]", t) if not t.startswith("/") else [t]:
                if alt and alt != "..." and cmd.get_command(_click.Context(cmd), alt) is None:
                    return f"`{path}` has no command {alt!r}"
            first = re.split(r"[|/]", t)[0]
            if first == "...":
                return None
            sub = cmd.get_command(_click.Context(cmd), first)
            assert sub is not None
            cmd, path, args = sub, f"{path} {first}", 0
            i += 1
            continue
        if isinstance(cmd, ExecCommand) and args >= 1:
            return None  # exec's command begins: its words are its own
        positional = [p for p in cmd.params if type(p).__name__ in ("Argument", "TyperArgument")]
        if not any(p.nargs == -1 for p in positional) and args >= len(positional):
            return f"`{path}` takes {len(positional)} argument(s); {t!r} is one more"
        args += 1
        i += 1
    return None


ALL = list(mentions())


def test_mentions_are_found() -> None:
    where = {w.split(":")[0] for w, _ in ALL}
    assert len(ALL) > 100 and "README.md" in where and any(w.startswith("crabd/") for w in where)


@pytest.mark.parametrize(
    ("text", "wrong"),
    [
        ("crabctl turns SB", True),
        ("crabctl status", True),
        ("crabctl sh SB CMD --turn", True),
        ("crabctl create --env bookworm --name web", True),
        ("crabctl cluster fork CK --prefix g", True),
        ("crabctl rm SB X Y --nope", True),
        ("crabctl restore SB CK extra", True),
        ("crabctl sh SB --as-turn 'make test'", False),
        ("crabctl --cluster ADDR cluster hosts", False),
        ("crabctl turn begin|end SB", False),
        ("crabctl exec SB --timeout 2 -- sleep 10", False),
        ("crabctl create bookworm -e FOO=bar --name web", False),
        ("crabctl checkpoint ...", False),
        ("crabctl doctor [--json]", False),
        ("crabctl create IMAGE [--name N] [-e KEY=VAL ...]", False),
        ("crabctl exec SB ls -l", False),
    ],
)
def test_the_walker_tells_right_from_wrong(text: str, wrong: bool) -> None:
    assert (problem(text) is not None) == wrong, problem(text)


def test_every_mentioned_command_parses() -> None:
    bad = [f"{where}: {text}: {why}" for where, text in ALL if (why := problem(text)) is not None]
    assert not bad, "\n".join(bad)


def test_a_command_substitution_is_one_argument_and_is_checked_itself() -> None:
    assert list(_substituted("crabctl rm --force $(crabctl ps -q)")) == ["crabctl rm --force X", "crabctl ps -q"]
    assert [problem(c) is not None for c in _substituted("crabctl rm $(crabctl ps --nope)")] == [False, True]
