"""crab behind ROCK's own client: a server that speaks ROCK's sandbox API (docs/rock.md).

``crabctl rock serve --listen 127.0.0.1:8080`` (or ``serve()`` here) runs it
as the calling user; point ``rl-rock``'s ``Sandbox`` client at it with
``ROCK_BASE_URL=http://127.0.0.1:8080`` and every ROCK action is a crab turn.
It is an adapter above crab's SDK (``sandboxes.py``), never a way around
crabd's authorization.
"""

from __future__ import annotations

import asyncio
import json
import signal

from crabd.rockapi.sandboxes import RockSandboxes
from crabd.rockapi.server import RockServer

__all__ = ["RockSandboxes", "RockServer", "serve"]


async def serve(
    listen: str,
    *,
    socket: str = "",
    aliases: dict[str, str] | None = None,
    ready: asyncio.Event | None = None,
    as_json: bool = False,
) -> None:
    """Serve ROCK's API on ``listen`` until SIGINT or SIGTERM, calling the crabd at ``socket`` (default: the host's)."""
    from crabd.sdk import AsyncClient

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncClient(socket or None) as client, RockServer(RockSandboxes(client, aliases=aliases), listen) as srv:
        print(json.dumps({"url": srv.url}) if as_json else f"ROCK API for crab at {srv.url}", flush=True)
        if ready is not None:
            ready.set()
        await stop.wait()
