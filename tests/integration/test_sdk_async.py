"""The asyncio SDK against the real daemon, many sandboxes at once."""

from __future__ import annotations

import asyncio

import pytest

from crabd.errors import SandboxNotFound
from crabd.sdk import AsyncClient, EmbeddedDaemon, ExecResult, OutputChunk


def test_async_client_end_to_end(daemon: EmbeddedDaemon) -> None:
    async def go() -> None:
        async with AsyncClient(daemon.socket) as client:
            sandboxes = await asyncio.gather(*(client.create("bookworm", name=f"async-{i}") for i in range(3)))
            try:

                async def work(i: int) -> bytes:
                    sb = sandboxes[i]
                    async with sb.turn():
                        await sb.session.run(f"export I={i}; cd /tmp")
                    r = await sb.session.run("echo $I $PWD")
                    return r.stdout

                assert await asyncio.gather(*(work(i) for i in range(3))) == [b"0 /tmp\n", b"1 /tmp\n", b"2 /tmp\n"]
                items = [item async for item in sandboxes[0].stream(["sh", "-c", "echo a; sleep 0.1; echo b"])]
                assert isinstance(items[-1], ExecResult) and items[-1].stdout == b"a\nb\n"
                assert any(isinstance(i, OutputChunk) for i in items)
                assert (await sandboxes[0].session.state())["cwd"] == "/tmp"
                assert [t.number for t in await sandboxes[1].turns()] == [1, 2]
                with pytest.raises(SandboxNotFound):
                    await client.get("missing")
                st = await client.status()
                assert st.caller_uid == 0
            finally:
                await asyncio.gather(*(sb.remove() for sb in sandboxes))
            assert not [s for s in await client.list() if s.name.startswith("async-")]

    asyncio.run(go())
