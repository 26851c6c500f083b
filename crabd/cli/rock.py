"""``crabctl rock serve``: crab behind ROCK's own client (docs/rock.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from crabd.cli.common import JsonOpt, app, state, sub_app

rock_app = sub_app("ROCK's sandbox API on crab: point rl-rock's client at it (ROCK_BASE_URL).")
app.add_typer(rock_app, name="rock", rich_help_panel="Host")


@rock_app.command("serve")
def serve(
    listen: Annotated[
        str,
        typer.Option("--listen", "-l", metavar="ADDR", help="127.0.0.1:PORT, [::1]:PORT or unix:/path (no other)."),
    ] = "127.0.0.1:8080",
    alias: Annotated[
        list[str] | None,
        typer.Option(
            "--image-alias", metavar="ROCK=CRAB", help="Start CRAB when ROCK asks for that image (repeatable)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Serve ROCK's sandbox API as you, on crab sandboxes, until interrupted (only you may call it).

    Prints where it listens once it does (with --json: {"url": ...}).
    """
    import asyncio

    from crabd.errors import InvalidRequest
    from crabd.rockapi import serve as run

    aliases: dict[str, str] = {}
    for item in alias or []:
        rock, sep, crab = item.partition("=")
        if not sep or not rock or not crab:
            raise InvalidRequest(f"--image-alias {item!r}: give ROCK=CRAB, e.g. python:3.11=crab-env/bookworm")
        aliases[rock] = crab
    if state.socket:
        socket = state.socket
    else:
        from crabd.config_file import socket_path

        socket = str(socket_path(state.config))
    asyncio.run(run(listen, socket=socket, aliases=aliases, as_json=as_json))
