"""The OpenAI proxy over real loopback sockets: a tiny upstream, a fake turn gate, real peer lookup."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import ipaddress
import json
import os
import pwd
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import ValidationError

from crabd.config import ProxyConfig, load_config
from crabd.errors import ConfigError, PermissionDenied, SandboxDead, SandboxNotFound
from crabd.models import Caller
from crabd.proxy import OpenAIProxy, identify_peer
from crabd.proxy.server import is_member
from crabd.util.loopback_peer import find_client_socket, parse_hex_endpoint, parse_tcp_line


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))


# --- the fake upstream -------------------------------------------------------


@dataclass
class Seen:
    method: str
    path_qs: str
    headers: dict[str, str]
    body: bytes


class Upstream:
    """An OpenAI-ish server whose behaviour is picked by the request's "model"."""

    def __init__(self, chunk_gap_s: float = 0.3) -> None:
        self.seen: list[Seen] = []
        self.arrived = asyncio.Event()
        self.stream_cut = asyncio.Event()  # a streaming handler lost its client (the proxy)
        self.chunk_gap_s = chunk_gap_s
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), body))
        self.arrived.set()
        model = json.loads(body).get("model", "json") if body else "json"
        if model == "stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for i in range(4):
                    await resp.write(f"data: {i}\n\n".encode())
                    await asyncio.sleep(self.chunk_gap_s)
            except (asyncio.CancelledError, ConnectionError):
                self.stream_cut.set()
                raise
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if model == "die":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: one\n\n")
            await asyncio.sleep(0.1)
            assert request.transport is not None
            request.transport.close()  # no terminating chunk: a broken stream
            return resp
        if model == "slow":
            await asyncio.sleep(3)
        if model == "error":
            return web.json_response({"error": {"message": "overloaded"}}, status=429, headers={"X-Up": "yes"})
        return web.json_response({"object": "reply", "path": request.path, "model": model})


# --- the fake gate -----------------------------------------------------------


class FakeHeld:
    def __init__(self, gate: FakeGate, sandbox_id: str) -> None:
        self.gate = gate
        self.sandbox_id = sandbox_id

    async def release(self) -> float:
        self.gate.releasing.set()
        await self.gate.opened.wait()
        self.gate.released.append(self.sandbox_id)
        if self.gate.release_error is not None:
            raise self.gate.release_error
        return 0.25

    def abandon(self) -> None:
        self.gate.abandoned.append(self.sandbox_id)
        self.gate.abandon_event.set()


@dataclass
class FakeGate:
    owners: dict[str, int] = field(default_factory=lambda: {"sb1": os.getuid(), "other": os.getuid() + 1})
    callers: list[Caller] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)
    release_error: Exception | None = None
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    releasing: asyncio.Event = field(default_factory=asyncio.Event)
    abandon_event: asyncio.Event = field(default_factory=asyncio.Event)

    def authorize(self, caller: Caller, sandbox_ref: str) -> str:
        self.callers.append(caller)
        if sandbox_ref not in self.owners:
            raise SandboxNotFound(f"no sandbox {sandbox_ref}", sandbox=sandbox_ref)
        if self.owners[sandbox_ref] != caller.uid:
            raise PermissionDenied(f"not yours: {sandbox_ref}", uid=caller.uid, sandbox=sandbox_ref)
        return f"id-{sandbox_ref}"

    def end_turn(self, sandbox_id: str) -> FakeHeld:
        self.ended.append(sandbox_id)
        return FakeHeld(self, sandbox_id)


@dataclass
class Rig:
    proxy: OpenAIProxy
    upstream: Upstream
    gate: FakeGate
    client: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def rig(
    *,
    hold: bool = False,
    upstream_url: str | None = None,
    timeout_s: float = 600,
    max_request_bytes: int = 1 << 20,
    members: frozenset[int] | None = None,
    **limits: int,
) -> AsyncIterator[Rig]:
    allowed = frozenset({os.getuid()}) if members is None else members
    up = Upstream()
    await up.start()
    gate = FakeGate()
    if not hold:
        gate.opened.set()
    cfg = ProxyConfig(
        listen="127.0.0.1:0",
        upstream=upstream_url or up.url,
        upstream_timeout_s=timeout_s,
        max_request_bytes=max_request_bytes,
        **limits,
    )
    try:
        async with (
            OpenAIProxy(cfg, gate, lambda: "crab_test_metric 1\n", may_use=lambda c: c.uid in allowed) as proxy,
            aiohttp.ClientSession() as client,
        ):
            yield Rig(proxy, up, gate, client)
    finally:
        await up.close()


def chat(model: str = "json") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def raw_post(port: int, path: str, body: dict[str, Any]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    return reader, writer


async def within(aw: Awaitable[Any], seconds: float = 2.0) -> Any:
    return await asyncio.wait_for(aw, seconds)


# --- turns -------------------------------------------------------------------


def test_llm_requests_end_the_turn_other_routes_do_not() -> None:
    async def main() -> None:
        async with rig() as r:
            base = f"{r.proxy.url}/sandboxes/sb1/v1"
            hdrs = {"Authorization": "Bearer k", "X-Crab-Sandbox": "ignored"}
            async with r.client.post(f"{base}/chat/completions?x=1", json=chat(), headers=hdrs) as resp:
                assert resp.status == 200
                assert (await resp.json())["path"] == "/v1/chat/completions"
            async with r.client.post(f"{base}/completions", json={"model": "json", "prompt": "p"}) as resp:
                assert resp.status == 200
            async with r.client.get(f"{base}/models") as resp:
                assert resp.status == 200
            assert r.gate.ended == ["id-sb1", "id-sb1"]
            assert r.gate.released == ["id-sb1", "id-sb1"]
            assert [c.uid for c in r.gate.callers] == [os.getuid()] * 3
            first = r.upstream.seen[0]
            assert first.path_qs == "/v1/chat/completions?x=1"
            assert json.loads(first.body) == chat()
            assert first.headers["Authorization"] == "Bearer k"
            assert "X-Crab-Sandbox" not in first.headers
            assert [s.path_qs for s in r.upstream.seen[1:]] == ["/v1/completions", "/v1/models"]

    run(main())


def test_routing_by_header_and_plain_passthrough() -> None:
    async def main() -> None:
        async with rig() as r:
            url = f"{r.proxy.url}/v1/chat/completions"
            async with r.client.post(url, json=chat(), headers={"X-Crab-Sandbox": "sb1"}) as resp:
                assert resp.status == 200
            assert r.gate.ended == ["id-sb1"]
            async with r.client.post(url, json=chat()) as resp:
                assert resp.status == 200
            assert r.gate.ended == ["id-sb1"]  # no sandbox: no turn
            assert len(r.gate.callers) == 1
            assert all("X-Crab-Sandbox" not in s.headers for s in r.upstream.seen)

    run(main())


def test_forwarded_at_once_but_held_until_release() -> None:
    async def main() -> None:
        async with rig(hold=True) as r:
            reader, writer = await raw_post(r.proxy.port, "/sandboxes/sb1/v1/chat/completions", chat())
            await within(r.upstream.arrived.wait())  # upstream saw it while the gate holds
            await within(r.gate.releasing.wait())
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.3)  # not one byte while held
            assert r.gate.released == []
            r.gate.opened.set()
            raw = await within(reader.read())
            writer.close()
            assert raw.startswith(b"HTTP/1.1 200")
            assert b'"object": "reply"' in raw
            assert r.gate.released == ["id-sb1"]

    run(main())


def test_stream_passes_chunk_by_chunk_after_release() -> None:
    async def main() -> None:
        async with rig(hold=True) as r:
            url = f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions"

            async def client() -> tuple[float, list[tuple[float, bytes]]]:
                async with r.client.post(url, json=chat("stream")) as resp:
                    got_headers = time.monotonic()
                    assert resp.headers["Content-Type"] == "text/event-stream"
                    return got_headers, [(time.monotonic(), c) async for c in resp.content.iter_any()]

            task = asyncio.create_task(client())
            await within(r.gate.releasing.wait())
            await asyncio.sleep(0.4)  # upstream has produced part of the stream meanwhile
            assert not task.done()
            released_at = time.monotonic()
            r.gate.opened.set()
            got_headers, chunks = await within(task, 5)
            assert got_headers >= released_at
            assert b"".join(c for _, c in chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"
            # Later chunks arrive as the upstream produces them, not all at the end.
            assert len(chunks) >= 3
            assert chunks[-1][0] - chunks[0][0] >= 0.4

    run(main())


def test_client_disconnect_while_held_abandons() -> None:
    async def main() -> None:
        async with rig(hold=True) as r:
            _, writer = await raw_post(r.proxy.port, "/sandboxes/sb1/v1/chat/completions", chat())
            await within(r.gate.releasing.wait())
            writer.close()
            await within(r.gate.abandon_event.wait())
            assert r.gate.abandoned == ["id-sb1"]
            assert r.gate.released == []

    run(main())


def test_client_disconnect_midstream_closes_upstream() -> None:
    async def main() -> None:
        async with rig() as r:
            url = f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions"
            async with r.client.post(url, json=chat("stream")) as resp:
                assert await resp.content.readany() == b"data: 0\n\n"
                resp.close()  # the client goes away mid-stream
            await within(r.upstream.stream_cut.wait())
            for _ in range(100):
                if r.proxy.metrics.in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            assert r.proxy.metrics.requests[("chat.completions", "client_gone")] == 1

    run(main())


# --- errors --------------------------------------------------------------------


def test_authorization_failures_forward_nothing() -> None:
    async def main() -> None:
        async with rig() as r:
            async with r.client.post(f"{r.proxy.url}/sandboxes/nope/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 404
                err = (await resp.json())["error"]
                assert err["code"] == "SandboxNotFound" and err["type"] == "crab_error" and err["hint"]
            async with r.client.post(
                f"{r.proxy.url}/v1/chat/completions", json=chat(), headers={"X-Crab-Sandbox": "other"}
            ) as resp:
                assert resp.status == 403
                assert (await resp.json())["error"]["code"] == "PermissionDenied"
            async with r.client.get(f"{r.proxy.url}/sandboxes/other/v1/models") as resp:
                assert resp.status == 403
            assert r.upstream.seen == []
            assert r.gate.ended == []

    run(main())


def test_upstream_error_status_passes_through_held() -> None:
    async def main() -> None:
        async with rig() as r:
            async with r.client.post(f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions", json=chat("error")) as resp:
                assert resp.status == 429
                assert resp.headers["X-Up"] == "yes"
                assert await resp.json() == {"error": {"message": "overloaded"}}
            assert r.gate.released == ["id-sb1"]

    run(main())


def test_turn_end_failure_is_reported() -> None:
    async def main() -> None:
        async with rig() as r:
            r.gate.release_error = SandboxDead("sandbox sb1 is dead", sandbox="sb1")
            async with r.client.post(f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 409
                assert (await resp.json())["error"]["code"] == "SandboxDead"

    run(main())


def test_unreachable_upstream_is_502_and_abandons() -> None:
    async def main() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        async with rig(upstream_url=dead) as r:
            async with r.client.post(f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 502
                err = (await resp.json())["error"]
                assert err["code"] == "upstream_unreachable" and dead in err["message"] and err["hint"]
            assert r.gate.abandoned == ["id-sb1"]
            assert r.proxy.metrics.upstream_errors["unreachable"] == 1

    run(main())


def test_upstream_timeout_is_504() -> None:
    async def main() -> None:
        async with rig(timeout_s=0.5) as r:
            async with r.client.post(f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions", json=chat("slow")) as resp:
                assert resp.status == 504
                err = (await resp.json())["error"]
                assert err["code"] == "upstream_timeout" and "upstream_timeout_s = 0.5" in err["message"]
            assert r.gate.abandoned == ["id-sb1"]

    run(main())


def test_upstream_death_midstream_truncates_the_response() -> None:
    async def main() -> None:
        async with rig() as r:
            got = b""
            async with r.client.post(f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions", json=chat("die")) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    async for chunk in resp.content.iter_any():
                        got += chunk
            assert got == b"data: one\n\n"
            assert r.proxy.metrics.upstream_errors["midstream"] == 1

    run(main())


def test_request_too_large_is_413() -> None:
    async def main() -> None:
        async with rig(max_request_bytes=100) as r:
            url = f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions"
            async with r.client.post(url, data=b"x" * 1000) as resp:
                assert resp.status == 413
                assert (await resp.json())["error"]["code"] == "RequestTooLarge"
            assert r.upstream.seen == [] and r.gate.ended == []

    run(main())


def test_non_members_are_refused_everywhere_but_healthz() -> None:
    async def main() -> None:
        async with rig(members=frozenset()) as r:
            for url, hdrs in (
                (f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions", {}),
                (f"{r.proxy.url}/v1/chat/completions", {"X-Crab-Sandbox": "sb1"}),
                (f"{r.proxy.url}/v1/chat/completions", {}),  # the plain pass-through too
            ):
                async with r.client.post(url, json=chat(), headers=hdrs) as resp:
                    assert resp.status == 403
                    err = (await resp.json())["error"]
                    assert err["code"] == "PermissionDenied" and "group 'crab'" in err["message"]
            async with r.client.get(f"{r.proxy.url}/metrics") as resp:
                assert resp.status == 403
                assert "crab_proxy" not in await resp.text()
            async with r.client.get(f"{r.proxy.url}/healthz") as resp:
                assert resp.status == 200
            assert r.upstream.seen == [] and r.gate.ended == [] and r.gate.callers == []

    run(main())


def test_is_member_reads_the_group_database() -> None:
    me = pwd.getpwuid(os.getuid())
    primary = grp.getgrgid(me.pw_gid).gr_name
    assert is_member(os.getuid(), primary)
    assert is_member(0, "no-such-group-crab")  # root always
    assert not is_member(os.getuid() or 65534, "no-such-group-crab")
    assert not is_member(2**31 - 7, primary)  # no passwd entry


def test_over_concurrency_is_429_at_once() -> None:
    async def main() -> None:
        async with rig(hold=True, max_concurrent_requests=1) as r:
            url = f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions"
            first = asyncio.create_task(r.client.post(url, json=chat()))
            await within(r.gate.releasing.wait())  # the first is held, in flight
            async with r.client.post(url, json=chat()) as resp:
                assert resp.status == 429
                assert resp.headers["Retry-After"] == "1"
                err = (await resp.json())["error"]
                assert err["code"] == "proxy_busy" and "max_concurrent_requests = 1" in err["message"]
            assert len(r.upstream.seen) == 1 and r.gate.ended == ["id-sb1"]
            r.gate.opened.set()
            resp = await within(first)
            assert resp.status == 200  # the held one is answered as before
            await resp.read()
            resp.release()
            async with r.client.post(url, json=chat()) as again:
                assert again.status == 200
            assert r.proxy.metrics.requests[("chat.completions", "429")] == 1

    run(main())


def test_buffered_bytes_are_capped_across_requests() -> None:
    async def main() -> None:
        async with rig(hold=True, max_buffered_bytes=1000) as r:
            url = f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions"
            big = {**chat(), "pad": "x" * 700}
            first = asyncio.create_task(r.client.post(url, json=big))
            await within(r.gate.releasing.wait())
            assert r.proxy.buffered > 700
            async with r.client.post(url, json=big) as resp:  # 700 more would pass 1000
                assert resp.status == 429
                err = (await resp.json())["error"]
                assert "max_buffered_bytes = 1000" in err["message"]

            # Without a declared length the bytes are counted as they arrive.
            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(8):
                    yield b"y" * 100

            async with r.client.post(url, data=chunks()) as resp:
                assert resp.status == 429
            assert len(r.upstream.seen) == 1
            r.gate.opened.set()
            resp = await within(first)
            assert resp.status == 200
            await resp.read()
            resp.release()
            assert r.proxy.buffered == 0  # released when the answer was relayed
            async with r.client.post(url, json=big) as again:
                assert again.status == 200
            assert r.proxy.buffered == 0

    run(main())


def test_metrics_and_healthz() -> None:
    async def main() -> None:
        async with rig() as r:
            async with r.client.post(f"{r.proxy.url}/sandboxes/sb1/v1/chat/completions", json=chat()) as resp:
                await resp.read()
            async with r.client.get(f"{r.proxy.url}/sandboxes/nope/v1/models") as resp:
                await resp.read()
            async with r.client.get(f"{r.proxy.url}/metrics") as resp:
                assert resp.status == 200
                text = await resp.text()
            async with r.client.get(f"{r.proxy.url}/healthz") as resp:
                assert resp.status == 200
        assert "# TYPE crab_proxy_requests_total counter" in text
        assert 'crab_proxy_requests_total{route="chat.completions",status="200"} 1' in text
        assert 'crab_proxy_requests_total{route="other",status="404"} 1' in text
        assert "crab_proxy_held_seconds_count 1" in text
        assert "crab_proxy_held_seconds_sum 0.250000" in text
        assert "crab_proxy_in_flight 0" in text
        assert "crab_test_metric 1" in text

    run(main())


# --- configuration -----------------------------------------------------------


def test_listen_must_be_loopback(tmp_path: Path) -> None:
    for bad in ("0.0.0.0:8731", "10.0.0.1:80", "localhost:80", "::1:80", "127.0.0.1", "127.0.0.1:99999"):
        with pytest.raises(ValidationError):
            ProxyConfig(listen=bad)
    assert ProxyConfig(listen="[::1]:0").listen_address == ("::1", 0)
    f = tmp_path / "crabd.toml"
    f.write_text('[proxy]\nlisten = "0.0.0.0:8731"\n')
    with pytest.raises(ConfigError, match=r"proxy\.listen"):
        load_config(f)

    async def main() -> None:
        proxy = OpenAIProxy(ProxyConfig.model_construct(listen="0.0.0.0:0"), FakeGate())
        with pytest.raises(ConfigError, match="loopback"):
            await proxy.start()
        await proxy.close()

    run(main())


def test_upstream_must_be_http_host_port() -> None:
    assert ProxyConfig(upstream="https://llm.local:443/").upstream == "https://llm.local:443"
    for bad in ("ftp://h:1", "http://h", "http://h:1/v1", "h:1", "http://u:p@h:1"):
        with pytest.raises(ValidationError):
            ProxyConfig(upstream=bad)


# --- who is calling --------------------------------------------------------------


def _pair(family: socket.AddressFamily, listen: str, connect: str) -> tuple[socket.socket, ...]:
    srv = socket.socket(family if listen != "127.0.0.1" else socket.AF_INET)
    srv.bind((listen, 0))
    srv.listen()
    cli = socket.socket(family)
    cli.connect((connect, srv.getsockname()[1]))
    conn, _ = srv.accept()
    return srv, cli, conn


@pytest.mark.parametrize(
    ("family", "listen", "connect"),
    [
        (socket.AF_INET, "127.0.0.1", "127.0.0.1"),
        (socket.AF_INET6, "::1", "::1"),
        (socket.AF_INET6, "127.0.0.1", "::ffff:127.0.0.1"),  # v4-mapped client socket, listed in tcp6
    ],
)
def test_peer_uid_of_a_real_loopback_connection(family: socket.AddressFamily, listen: str, connect: str) -> None:
    try:
        socks = _pair(family, listen, connect)
    except OSError as exc:
        pytest.skip(f"no {connect} loopback here: {exc}")
    conn = socks[2]
    peer, ours = conn.getpeername(), conn.getsockname()
    try:
        caller = identify_peer(peer, ours)
        assert caller.uid == os.getuid() and caller.pid == 0
    finally:
        for s in socks:
            s.close()
    with pytest.raises(PermissionDenied, match="cannot identify"):  # the client's socket is gone
        identify_peer(peer, ours)


def test_peer_off_loopback_is_refused() -> None:
    with pytest.raises(PermissionDenied, match="not on loopback"):
        identify_peer(("10.1.2.3", 5000), ("127.0.0.1", 8731))


_HEADER4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
_TAIL = "00000000:00000000 00:00000000 00000000"


def _row(n: int, local: str, remote: str, state: str, uid: int, inode: int) -> str:
    return f"   {n}: {local} {remote} {state} {_TAIL} {uid:5d}        0 {inode} 1 0000000000000000 100 0 0 10 0\n"


def test_proc_net_tcp_parser_on_canned_tables(tmp_path: Path) -> None:
    lo = ipaddress.ip_address("127.0.0.1")
    assert parse_hex_endpoint("0100007F:221B", byteorder="little") == (lo, 8731)
    assert parse_hex_endpoint("7F000001:0050", byteorder="big") == (lo, 80)
    assert parse_hex_endpoint("0302010A:0050", byteorder="little") == (ipaddress.ip_address("10.1.2.3"), 80)
    v6 = "B80D0120000000000000000001000000:0050"
    assert parse_hex_endpoint(v6, byteorder="little") == (ipaddress.ip_address("2001:db8::1"), 80)
    mapped = "0000000000000000FFFF00000100007F:0050"
    assert parse_hex_endpoint(mapped, byteorder="little") == (lo, 80)  # v4-mapped folds to IPv4
    assert parse_tcp_line(_HEADER4) is None
    assert parse_tcp_line("   0: garbage\n") is None

    tcp = tmp_path / "tcp"
    tcp.write_text(
        _HEADER4
        + _row(0, "0100007F:221B", "00000000:0000", "0A", 0, 1001)  # our listener
        + _row(1, "0100007F:D431", "0100007F:221B", "01", 1000, 1002)  # the client's socket
        + _row(2, "0100007F:221B", "0100007F:D431", "01", 0, 1003)  # our accepted end
        + _row(3, "0100007F:D432", "0100007F:221B", "06", 0, 0)  # TIME_WAIT: nobody's
    )
    tcp6 = tmp_path / "tcp6"
    tcp6.write_text(
        _HEADER4
        + _row(0, "00000000000000000000000001000000:D433", "00000000000000000000000001000000:221B", "01", 1001, 2001)
        + _row(1, "0000000000000000FFFF00000100007F:D434", "0000000000000000FFFF00000100007F:221B", "01", 1002, 2002)
    )

    def owner(peer: str, port: int, ours: str = "127.0.0.1") -> int | None:
        entry = find_client_socket(
            (ipaddress.ip_address(peer), port),
            (ipaddress.ip_address(ours), 8731),
            tables=(tcp, tcp6),
            byteorder="little",
        )
        return None if entry is None else entry.uid

    assert owner("127.0.0.1", 0xD431) == 1000
    assert owner("127.0.0.1", 0xD432) is None
    assert owner("::1", 0xD433, "::1") == 1001
    assert owner("127.0.0.1", 0xD434) == 1002
    assert owner("127.0.0.1", 0xD435) is None
    # A missing table (no IPv6) is skipped; the line bound stops the scan.
    assert find_client_socket((lo, 0xD431), (lo, 8731), tables=(tmp_path / "absent", tcp), byteorder="little")
    assert find_client_socket((lo, 0xD431), (lo, 8731), tables=(tcp,), byteorder="little", max_lines=2) is None
