"""crabctl commands for a sandbox's named sessions: ``session ls|open|close``.

A sandbox has its default session and any number of named ones, each its
own bash running at the same time as the others (``crabctl sh SB --session
NAME`` runs in one, opening it if it is new).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer

from crabd.cli.common import JsonOpt, app, client, emit_json, out, sub_app
from crabd.cli.sandboxes import EnvOpt, SbArg, parse_env

session_app = sub_app("A sandbox's sessions: each its own bash, running at the same time as the others.")
app.add_typer(session_app, name="session", rich_help_panel="Sandboxes")

NameArg = Annotated[str, typer.Argument(metavar="NAME", help="The session's name.")]


@session_app.command("ls")
def ls(sandbox: SbArg, as_json: JsonOpt = False) -> None:
    """List the sandbox's sessions whose bash runs (the default one is shown as '-')."""
    with client() as c:
        found = c.get(sandbox).sessions()
    if as_json:
        emit_json([asdict(s) for s in found])
        return
    from rich.table import Table

    table = Table("SESSION", "PID", "BUSY", "OUTPUT", box=None, pad_edge=False)
    for s in found:
        output = f"pty {s.pty[0]}x{s.pty[1]}" if s.pty else "pipes"
        table.add_row(s.name or "-", str(s.pid), "yes" if s.busy else "no", output)
    out.print(table)


@session_app.command("open")
def open_(
    sandbox: SbArg,
    name: NameArg,
    env: EnvOpt = None,
    empty_env: Annotated[
        bool, typer.Option("--empty-env", help="Start from no environment, not the container's.")
    ] = False,
    workdir: Annotated[str, typer.Option("--workdir", "-w", metavar="DIR", help="Its first directory.")] = "",
    user: Annotated[str, typer.Option("--user", "-u", metavar="UID[:GID]", help="Run its bash as this uid.")] = "",
    tty: Annotated[
        bool, typer.Option("--tty", "-t", help="Its output is a pseudo-terminal (one stream; isatty() is true).")
    ] = False,
    size: Annotated[
        str, typer.Option("--size", metavar="ROWSxCOLS", help="The terminal's size with --tty (default 24x80).")
    ] = "",
    as_json: JsonOpt = False,
) -> None:
    """Open a named session (without this, it opens at its first `crabctl sh --session`)."""
    pty = _pty(tty, size)
    with client() as c:
        info = (
            c.get(sandbox)
            .session(name)
            .open(env=parse_env(env), empty_env=empty_env, workdir=workdir, user=user, pty=pty)
        )
    emit_json(asdict(info)) if as_json else out.print(f"{info.name} {info.pid}", markup=False, highlight=False)


def _pty(tty: bool, size: str) -> bool | tuple[int, int]:
    """``--tty`` and ``--size ROWSxCOLS`` as the SDK's ``pty`` argument."""
    if not size:
        return tty
    if not tty:
        raise typer.BadParameter("--size is the terminal's size; give --tty too", param_hint="--size")
    rows, sep, cols = size.lower().partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit():
        raise typer.BadParameter(f"{size!r} is not ROWSxCOLS (e.g. 40x120)", param_hint="--size")
    return int(rows), int(cols)


@session_app.command("close")
def close(sandbox: SbArg, name: NameArg, as_json: JsonOpt = False) -> None:
    """End a session's bash and its jobs (refused while it runs a command)."""
    with client() as c:
        c.get(sandbox).session(name).close()
    if as_json:
        emit_json({"closed": name})
