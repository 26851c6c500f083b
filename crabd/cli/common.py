"""Shared pieces of `crabctl`: the app, global options, output helpers.

Human tables by default, ``--json`` for machines.  A :class:`CrabError`
ends the command with its message and hint on stderr and exit code 1;
tracebacks appear only with ``--debug``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any

import typer
from rich.console import Console

from crabd.config import load_config
from crabd.errors import CrabError
from crabd.sdk.client import Client

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Operate crab: sandboxes, checkpoints, the host.")

out = Console()
err = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


class _State:
    debug = False
    config: str | None = None
    socket: str | None = None
    #: The Ray cluster's GCS address for `crabctl cluster ...` (None: not given).
    cluster: str | None = None


state = _State()


@app.callback()
def _global(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    config: Annotated[str | None, typer.Option("--config", help="crabd.toml to use.")] = None,
    socket: Annotated[str | None, typer.Option("--socket", envvar="CRAB_SOCKET", help="crabd's socket.")] = None,
    cluster: Annotated[
        str | None,
        typer.Option(
            "--cluster",
            envvar="CRAB_CLUSTER",
            metavar="ADDR",
            help="The Ray cluster's GCS address (host:port, or auto) for `crabctl cluster` commands.",
        ),
    ] = None,
) -> None:
    state.debug = debug
    state.config = config
    state.socket = socket
    state.cluster = cluster


def client() -> Client:
    """A client for the daemon named by --socket / $CRAB_SOCKET / the config."""
    if state.socket:
        return Client(state.socket)
    return Client(load_config(state.config).paths.socket)


def fmt_time(ts: float | None) -> str:
    return "-" if not ts else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def show_error(exc: CrabError) -> None:
    """``exc`` as crabctl reports every CrabError: its message, then its hint, on stderr."""
    err.print(f"[red]error:[/red] {exc.message}", highlight=False)
    if exc.hint:
        err.print(f"[dim]hint:[/dim] {exc.hint}", highlight=False)
