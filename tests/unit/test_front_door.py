"""The public socket's relay (api/peercred.py), on real unix sockets in a temporary directory."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from crabd.api.peercred import CallerTable, FrontDoor


def test_a_stop_with_a_connection_open_logs_no_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every crabd stop logged asyncio's "Exception in callback" for each open client connection:
    the relay ended cancelled, and asyncio's connection callback asks a cancelled task for its exception."""

    async def go() -> None:
        private = tmp_path / "private.sock"

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(100):
                writer.write(data)
                await writer.drain()
            writer.close()

        inner = await asyncio.start_unix_server(echo, path=str(private))
        door = FrontDoor(tmp_path / "public.sock", private, CallerTable())
        await door.start()
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "public.sock"))
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.read(4), 5) == b"ping"  # relayed both ways
        await door.close()
        await asyncio.sleep(0.05)  # asyncio's callback runs on the next turns of the loop
        assert await asyncio.wait_for(reader.read(4), 5) == b""  # the client sees the relay end
        writer.close()
        inner.close()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(go())
    assert [r.getMessage()[:60] for r in caplog.records if r.levelno >= logging.ERROR] == []
