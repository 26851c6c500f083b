"""Before a process dump: crab-init holds no connection from crabd.

CRIU refuses to dump a unix socket whose peer lives outside the dumped tree
("External socket is used"), and every crabd connection into a sandbox is
such a socket at init's end.  ``SandboxManager.quiesced`` stops new
connections and waits for crabd's open ones to close; a close, though, only
*asks* init to close its end (``InitConnection.aclose``), and a child crabd
forked at that moment can hold crabd's end open for a while.  So the last
step asks init itself: one more connection, a ``HELLO`` whose reply counts
init's open connections, repeated until it counts only itself; then that
one is closed, and the close returns once init closed its end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from crabd.errors import SandboxBusy
from crabd.runtime.initproto import InitConnection

#: How long init may take to close the ends crabd closed (its poll loop runs in microseconds;
#: a forked child of crabd that holds a copy of a socket lives milliseconds).
INIT_ALONE_WAIT_S = 2.0
#: Pause between counts.
RECOUNT_S = 0.005


async def until_init_alone(
    connect: Callable[[], Awaitable[InitConnection]], sandbox: str, sandbox_id: str, wait_s: float = INIT_ALONE_WAIT_S
) -> int:
    """Return once init holds no connection from crabd; how many times it was asked.

    An init built before ``HELLO_OK`` counted connections is asked once and
    believed.  SandboxBusy if other connections stay open past ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    conn = await connect()
    asked = 0
    try:
        while True:
            hello = await conn.hello()
            asked += 1
            if hello.connections is None or hello.connections <= 1:
                return asked
            if time.monotonic() >= deadline:
                raise SandboxBusy(
                    f"crab's init in sandbox {sandbox} still holds {hello.connections - 1} connection(s) "
                    f"{wait_s:g} s after crabd closed its own; a process dump would fail on them",
                    sandbox=sandbox_id,
                    hint="Retry the checkpoint; if this repeats, report it with crabd's log.",
                )
            await asyncio.sleep(RECOUNT_S)
    finally:
        await conn.aclose(until_init_closed=True)
