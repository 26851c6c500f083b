"""Shared pieces of `crabctl`: the app, global options, output helpers.

Human tables by default, ``--json`` for machines.  A :class:`CrabError`
ends the command with its message and hint on stderr and exit code 1
(under ``--json`` as one JSON object); tracebacks appear only with
``--debug``.

Startup time is part of the interface (a shell-driven agent pays it per
command): this module and the command modules import only typer at
import time.  rich, the SDK and the configuration load inside the
commands that use them, so ``crabctl --help`` and a usage error never
load them (``tests/unit/test_cli_conventions.py`` checks it).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from crabd import __version__
from crabd.cli.core import CONTEXT, CrabGroup

if TYPE_CHECKING:
    from rich.console import Console

    from crabd.errors import CrabError
    from crabd.sdk.client import Client

app = typer.Typer(
    cls=CrabGroup,
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings=CONTEXT,
    help="Operate crab: sandboxes, checkpoints, the host.",
)


def sub_app(help_text: str) -> typer.Typer:
    """A command group of crabctl (``crabctl checkpoint ...``), with crabctl's help and conventions."""
    return typer.Typer(
        cls=CrabGroup, no_args_is_help=True, rich_markup_mode=None, context_settings=CONTEXT, help=help_text
    )


class _LazyConsole:
    """A rich Console made on first use: importing rich costs more than most commands' own work."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=self._stderr)
        return getattr(self._console, name)


out = cast("Console", _LazyConsole(stderr=False))
err = cast("Console", _LazyConsole(stderr=True))


class _State:
    debug = False
    config: str | None = None
    socket: str | None = None
    #: The Ray cluster's GCS address for `crabctl cluster ...` (None: not given).
    cluster: str | None = None
    #: --json was given: errors are reported as JSON too (set by crabd.cli.main.run).
    json = False


state = _State()


def _json(value: bool) -> bool:
    # Once parsed, the flag decides how errors print (before: crabd.cli.main.run's look at argv).
    state.json = value
    return value


JsonOpt = Annotated[
    bool, typer.Option("--json", callback=_json, help="Print machine-readable JSON (errors too, on stderr).")
]
NoTruncOpt = Annotated[bool, typer.Option("--no-trunc", help="Print whole ids (default: short unique prefixes).")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"crabctl {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    config: Annotated[str | None, typer.Option("--config", metavar="FILE", help="crabd.toml to use.")] = None,
    socket: Annotated[
        str | None, typer.Option("--socket", envvar="CRAB_SOCKET", metavar="PATH", help="crabd's socket.")
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(
            "--cluster",
            envvar="CRAB_CLUSTER",
            metavar="ADDR",
            help="The Ray cluster's GCS address (host:port, or auto) for `crabctl cluster` commands.",
        ),
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_version, help="Print crabctl's version and exit.")
    ] = False,
) -> None:
    state.debug = debug
    state.config = config
    state.socket = socket
    state.cluster = cluster


def client() -> Client:
    """A client for the daemon named by --socket / $CRAB_SOCKET / the config."""
    from crabd.sdk.client import Client

    if state.socket:
        return Client(state.socket)
    # The socket path only: tomllib, not the whole pydantic config (~90 ms of every call).
    from crabd.config_file import socket_path

    return Client(socket_path(state.config))


def fmt_time(ts: float | None) -> str:
    return "-" if not ts else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def plural(n: int, noun: str, nouns: str = "") -> str:
    """``n`` and the noun that agrees with it: "1 sandbox", "2 sandboxes", "0 blobs"."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


class Columns:
    """A table as docker prints one: upper-case headers, columns three spaces apart, nothing cut.

    Plain text (no rich): a listing prints as fast as Python starts, a wide
    row runs past the terminal's edge rather than lose part of an id, and
    ``cut``/``awk`` read it as they read ``docker ps``.
    """

    def __init__(self, *headers: str, header: bool = True) -> None:
        self.headers = headers
        self.header = header
        self.rows: list[tuple[str, ...]] = []

    def add_row(self, *cells: str) -> None:
        # One line per row: a cell's own line breaks would break the columns.
        self.rows.append(tuple(c.replace("\n", " ") for c in cells))

    def render(self) -> str:
        rows = ([tuple(h.upper() for h in self.headers)] if self.header else []) + self.rows
        if not rows:
            return ""
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.headers))]
        return "".join("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n" for r in rows)


def table(*headers: str, header: bool = True) -> Columns:
    return Columns(*headers, header=header)


def show(t: Columns) -> None:
    """Print ``t`` on stdout."""
    sys.stdout.write(t.render())
    sys.stdout.flush()


def escape(text: str) -> str:
    """``text`` shown as itself by rich: square brackets (``[remote]``) are not taken for markup."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def error_json(kind: str, message: str, hint: str | None) -> None:
    """An error as crabctl reports it under --json: one object on stderr."""
    sys.stderr.write(json.dumps({"error": {"type": kind, "message": message, "hint": hint or ""}}) + "\n")


def show_error(exc: CrabError) -> None:
    """``exc`` as crabctl reports every CrabError: its message, then its hint, on stderr (JSON under --json)."""
    if state.json:
        error_json(type(exc).__name__, exc.message, exc.hint)
        return
    err.print(f"[red]error:[/red] {escape(exc.message)}", highlight=False)
    if exc.hint:
        err.print(f"[dim]hint:[/dim] {escape(exc.hint)}", highlight=False)


#: Hex digits of an id a table shows at least (docker shows 12 of 64; crab's ids have 12).
SHORT_ID_HEX = 8


def _hex_part(ident: str) -> tuple[str, str]:
    """``("ck-", "0123456789ab")`` for a checkpoint id; ``("", ident)`` for a sandbox id."""
    kind, sep, rest = ident.partition("-")
    return (kind + sep, rest) if sep and len(kind) == 2 else ("", ident)


def short_ids(ids: list[str], no_trunc: bool = False) -> Callable[[str], str]:
    """How a table shows ids: the shortest common prefix length (at least :data:`SHORT_ID_HEX` hex
    digits) at which ``ids`` stay distinct, as docker shows a short id; whole with ``no_trunc``.

    crabctl accepts such a prefix wherever it takes an id (the daemon resolves it among the
    caller's own sandboxes and checkpoints).
    """
    if no_trunc:
        return lambda ident: ident
    uniq = {_hex_part(i)[1] for i in ids if i}
    n = SHORT_ID_HEX
    while n < max((len(u) for u in uniq), default=0) and len({u[:n] for u in uniq}) < len(uniq):
        n += 1

    def short(ident: str) -> str:
        kind, rest = _hex_part(ident)
        return kind + rest[:n] if ident else ident

    return short
