"""``with sb.fork(n) as branches`` removes the forks at exit, on a real crabd (sync and async)."""

from __future__ import annotations

import asyncio

import pytest

from crabd.errors import SandboxNotFound
from crabd.sdk import AsyncClient, Client, EmbeddedDaemon


def test_with_fork_leaves_no_sandbox_behind(client: Client) -> None:
    with client.create("busybox") as sb:
        sb.run(["sh", "-c", "echo v1 > /tmp/notes"])  # busybox: no bash, so no session
        ck = sb.checkpoint()
        with sb.fork(3, ck) as branches:
            assert len(branches) == 3
            ids = [b.id for b in branches]
            assert {b.run(["cat", "/tmp/notes"]).text for b in branches} == {"v1\n"}
            branches[0].remove()  # one removed early is fine at exit
        assert [s.id for s in client.list()] == [sb.id]
        with pytest.raises(SandboxNotFound):
            client.get(ids[1])
        with pytest.raises(RuntimeError), sb.fork(2):
            raise RuntimeError("the body fails")
        assert [s.id for s in client.list()] == [sb.id]
    assert client.list() == []


def test_async_with_fork_leaves_no_sandbox_behind(daemon: EmbeddedDaemon) -> None:
    async def main() -> None:
        async with AsyncClient(daemon.socket) as client, await client.create("busybox") as sb:
            async with await sb.fork(2) as branches:
                assert len(branches) == 2
            assert [s.id for s in await client.list()] == [sb.id]
            async with await client.fork((await sb.checkpoints())[-1], 2):
                pass
            assert [s.id for s in await client.list()] == [sb.id]

    asyncio.run(main())
    with Client(daemon.socket) as c:
        assert c.list() == []
