"""The OpenAI-compatible reverse proxy: an LLM request ends its sandbox's turn.

An agent's LLM request (``POST /v1/chat/completions`` or ``/v1/completions``
for a sandbox) is forwarded upstream at once, so generation overlaps the
turn's checkpoint, and the response is *held*: nothing of it reaches the
agent until the turn's checkpoint is durable or was skipped.  Then status,
headers and body pass through unchanged, chunk by chunk as they arrive
(SSE streams too).  While held, the upstream body is not read: aiohttp's
stream reader stops reading the socket at its high-water mark, so a held
response costs a bounded buffer, not the whole answer.

Routing: ``/sandboxes/{sandbox}/v1/...`` names the sandbox in the URL (point
the agent's ``base_url`` there); plain ``/v1/...`` takes it from the
``X-Crab-Sandbox`` header, and without one is a plain pass-through.  For a
sandbox the caller is identified by the kernel (``util/loopback_peer.py``) and authorized
before anything is forwarded.  See docs/proxy.md.

Limits (``[proxy]``): every route but ``/healthz`` (``/metrics`` and the
plain pass-through included) is for root and members of ``group`` only, as
crabd's own socket is (403 otherwise); at most ``max_concurrent_requests``
are served at once (one more gets 429 at once, before its body is read),
and request bodies held in memory, all requests together, stay under
``max_buffered_bytes`` (a request that would pass it gets 429; one body over
``max_request_bytes`` gets 413).  Errors are JSON in OpenAI's shape
(``{"error": {"message", "type", "param", "code", "hint"}}``).
"""

from __future__ import annotations

import asyncio
import grp
import logging
import pwd
from collections.abc import Callable
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from crabd.config import ProxyConfig, is_loopback
from crabd.errors import (
    ConfigError,
    CrabError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    RequestTooLarge,
)
from crabd.models import Caller
from crabd.proxy.gate import HeldTurn, ProxyMetrics, TurnGate
from crabd.util.loopback_peer import identify_peer

log = logging.getLogger("crabd.proxy")

SANDBOX_HEADER = "X-Crab-Sandbox"
#: On a turn-ending response: seconds it was held for the checkpoint.
HELD_HEADER = "X-Crab-Held-Seconds"
#: POST to these (under /v1/) ends the sandbox's turn.
TURN_ENDPOINTS = {"chat/completions": "chat.completions", "completions": "completions"}

# Hop-by-hop headers (RFC 9110 §7.6.1) describe one connection, not the
# message; Host and Content-Length are recomputed for the upstream request,
# Expect was already dealt with (the body is read in full), and the sandbox
# header is crab's own.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "TE",
        "Trailer",
        "Upgrade",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
    )
)
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length", "expect", SANDBOX_HEADER.lower()}
# aiohttp would add these when absent; the upstream must see what the client sent.
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_SHUTDOWN_S = 2.0
#: Request key: how a response ended when its status does not say (metrics).
_OUTCOME = web.RequestKey("crab.proxy.outcome", str)


def _strip(headers: CIMultiDictProxy[str], drop: frozenset[str] | set[str]) -> CIMultiDict[str]:
    # Headers named in Connection are hop-by-hop too.
    named = {t.strip().lower() for v in headers.getall("Connection", []) for t in v.split(",")}
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        if key.lower() not in drop and key.lower() not in named and not key.lower().startswith("proxy-"):
            out.add(key, value)
    return out


def _error(status: int, message: str, code: str, hint: str | None = None) -> web.Response:
    """An OpenAI-style error response (clients show ``error.message``)."""
    err: dict[str, Any] = {"message": message, "type": "crab_error", "param": None, "code": code}
    if hint:
        err["hint"] = hint
    return web.json_response({"error": err}, status=status)


def is_member(uid: int, group: str) -> bool:
    """Whether ``uid`` is root or in ``group`` (as its primary group or listed in /etc/group).

    The group database, not the calling process's own groups: the proxy
    knows only the socket's owner (``peer.py``).  So a user removed from
    the group loses access at once, without logging out.  Blocking (NSS).
    """
    if uid == 0:
        return True
    try:
        entry = grp.getgrnam(group)
        user = pwd.getpwuid(uid)
    except KeyError:
        return False
    return user.pw_gid == entry.gr_gid or user.pw_name in entry.gr_mem


def _busy(message: str) -> web.Response:
    resp = _error(
        429,
        message,
        "proxy_busy",
        "Retry after a moment; the host's admin can raise the limit in crabd.toml's [proxy] section.",
    )
    resp.headers["Retry-After"] = "1"
    return resp


def _crab_status(exc: CrabError) -> int:
    if isinstance(exc, RequestTooLarge):
        return 413
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, PermissionDenied):
        return 403
    if isinstance(exc, InvalidRequest):
        return 400
    return {"FAILED_PRECONDITION": 409, "ABORTED": 409, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}.get(
        exc.grpc_code, 500
    )


def _crab_error(exc: CrabError) -> web.Response:
    return _error(_crab_status(exc), exc.message, type(exc).__name__, exc.hint)


class OpenAIProxy:
    """The proxy server; ``async with OpenAIProxy(cfg, gate, metrics_text) as proxy: ... proxy.url``."""

    def __init__(
        self,
        cfg: ProxyConfig,
        gate: TurnGate,
        metrics_text: Callable[[], str] | None = None,
        *,
        may_use: Callable[[Caller], bool] | None = None,
    ) -> None:
        """``may_use`` decides who may call (default: root and members of ``[proxy] group``)."""
        self.cfg = cfg
        self.gate = gate
        self.metrics = ProxyMetrics()
        self._metrics_text = metrics_text
        self._may_use = may_use or (lambda caller: is_member(caller.uid, cfg.group))
        #: Request body bytes held right now, all requests together.
        self.buffered = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._host = ""
        self._port = 0

    @property
    def port(self) -> int:
        if self._runner is None:
            raise RuntimeError("the proxy is not started")
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    async def __aenter__(self) -> OpenAIProxy:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Listen; raises ``ConfigError`` for a non-loopback or unusable ``listen`` address."""
        try:
            host, port = self.cfg.listen_address
        except ValueError as exc:
            raise ConfigError(f"[proxy] listen: {exc}") from exc
        if not is_loopback(host):
            # peer.py identifies callers from the loopback socket table; see there.
            raise ConfigError(
                f"[proxy] listen = {self.cfg.listen!r} is not a loopback address",
                hint="Set [proxy] listen to 127.0.0.1:PORT or [::1]:PORT.",
            )
        # No pool limit: each upstream connection serves one client request,
        # and clients are bounded by the agents.  Bytes pass verbatim
        # (no decompression), and environment proxies do not apply.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s),
            auto_decompress=False,
            trust_env=False,
        )
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/sandboxes/{sandbox}/v1/{path:.*}", self._handle)
        app.router.add_route("*", "/v1/{path:.*}", self._handle)
        # handler_cancellation: a client that disconnects cancels its handler,
        # which is how a held request learns that nobody waits for it.
        runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_S
        )
        try:
            await runner.setup()
            site = web.TCPSite(runner, host, port)
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            await self._session.close()
            self._session = None
            raise ConfigError(
                f"the proxy cannot listen on {self.cfg.listen}: {exc}",
                hint="Pick a free port for [proxy] listen.",
            ) from exc
        self._runner = runner
        self._host, self._port = host, int(runner.addresses[0][1])
        log.info("OpenAI proxy listening", extra={"url": self.url, "upstream": self.cfg.upstream})

    async def close(self) -> None:
        """Stop listening, end requests in flight (after a short grace) and close upstream connections."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # --- small routes -----------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            await self._member(request)
        except CrabError as exc:
            return _crab_error(exc)
        text = self.metrics.render()
        if self._metrics_text is not None:
            text += self._metrics_text()
        return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # --- /v1/ -------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"].strip("/")
        route = TURN_ENDPOINTS.get(path, "other") if request.method == "POST" else "other"
        status: int | str = "client_gone"
        if self.metrics.in_flight >= self.cfg.max_concurrent_requests:
            # Refused before anything is read or looked up: a flood costs little.
            self.metrics.count_request(route, 429)
            return _busy(
                f"crab proxy: {self.metrics.in_flight} requests in flight, "
                f"[proxy] max_concurrent_requests = {self.cfg.max_concurrent_requests}"
            )
        self.metrics.in_flight += 1
        try:
            resp = await self._serve(request, route)
            status = request.get(_OUTCOME, resp.status)
            return resp
        finally:
            self.metrics.in_flight -= 1
            self.metrics.count_request(route, status)

    async def _serve(self, request: web.Request, route: str) -> web.StreamResponse:
        ref = request.match_info.get("sandbox") or request.headers.get(SANDBOX_HEADER) or None
        sandbox_id: str | None = None
        reserved = [0]  # body bytes counted in self.buffered for this request
        try:
            try:
                # Identify and authorize before anything is read or goes upstream.
                caller = await self._member(request)
                if ref is not None:
                    sandbox_id = self.gate.authorize(caller, ref)
                body = await self._read_body(request, reserved)
            except CrabError as exc:
                return _crab_error(exc)
            if isinstance(body, web.Response):
                return body
            held: HeldTurn | None = None
            if sandbox_id is not None and route != "other":
                try:
                    held = self.gate.end_turn(sandbox_id)
                except CrabError as exc:
                    return _crab_error(exc)
            return await self._forward(request, body, held)
        finally:
            # The body is referenced until the answer is relayed: count it until then.
            self.buffered -= reserved[0]

    async def _member(self, request: web.Request) -> Caller:
        """The caller, if root or in ``[proxy] group``; PermissionDenied otherwise."""
        caller = await self._caller(request)
        if not await asyncio.to_thread(self._may_use, caller):
            raise PermissionDenied(
                f"uid {caller.uid} may not use the crab proxy: not root and not in group {self.cfg.group!r}",
                uid=caller.uid,
                sandbox="",
                hint=f"Ask the host's admin to add you to group {self.cfg.group!r} (as for crabd's socket).",
            )
        return caller

    async def _caller(self, request: web.Request) -> Caller:
        transport = request.transport
        peername = transport.get_extra_info("peername") if transport is not None else None
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        if not peername or not sockname:
            raise PermissionDenied("the proxy's caller went away before it could be identified", uid=-1, sandbox="")
        # Reading /proc/net/tcp can take milliseconds on a busy host.
        return await asyncio.to_thread(identify_peer, tuple(peername), tuple(sockname))

    def _reserve(self, n: int, reserved: list[int]) -> web.Response | None:
        """Count ``n`` more body bytes against ``max_buffered_bytes``; a 429 if that passes it."""
        cap = self.cfg.max_buffered_bytes
        if self.buffered + n > cap:
            return _busy(
                f"crab proxy: request bodies in memory would pass [proxy] max_buffered_bytes = {cap} "
                f"({self.buffered} held by requests in flight)"
            )
        self.buffered += n
        reserved[0] += n
        return None

    async def _read_body(self, request: web.Request, reserved: list[int]) -> bytes | web.Response:
        limit = self.cfg.max_request_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            raise RequestTooLarge(
                f"request body of {declared} bytes exceeds [proxy] max_request_bytes = {limit}",
                limit=limit,
                size=declared,
            )
        # A declared length is reserved before reading, so a client that
        # announces a big body is refused without sending it.
        if declared and (busy := self._reserve(declared, reserved)) is not None:
            return busy
        buf = bytearray()
        while chunk := await request.content.readany():
            buf += chunk
            if len(buf) > limit:
                raise RequestTooLarge(
                    f"request body exceeds [proxy] max_request_bytes = {limit}", limit=limit, size=len(buf)
                )
            if len(buf) > reserved[0] and (busy := self._reserve(len(buf) - reserved[0], reserved)) is not None:
                return busy
        return bytes(buf)

    def _upstream_url(self, request: web.Request) -> URL:
        # Forward the path as the client encoded it (no decode/re-encode round trip).
        raw = request.rel_url.raw_path
        if "sandbox" in request.match_info:
            raw = "/" + raw.split("/", 3)[3]  # drop "/sandboxes/<ref>"
        query = request.rel_url.raw_query_string
        return URL(self.cfg.upstream + raw + (f"?{query}" if query else ""), encoded=True)

    async def _forward(self, request: web.Request, body: bytes, held: HeldTurn | None) -> web.StreamResponse:
        assert self._session is not None, "the proxy is not started"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.upstream_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                up = await self._session.request(
                    request.method,
                    self._upstream_url(request),
                    headers=_strip(request.headers, _REQUEST_DROP),
                    data=body if body or request.method in ("POST", "PUT", "PATCH") else None,
                    skip_auto_headers=_NO_AUTO_HEADERS,
                    allow_redirects=False,
                )
        except BaseException as exc:
            # No response yet.  An error is answered at once rather than held:
            # it carries no LLM output, and the sandbox's next action waits for
            # the turn's checkpoint in crabd anyway (the turn end and its
            # checkpoint go on regardless).  Holding it would only make the
            # agent wait to learn that it must retry, and the retry (no action
            # in between) is held on the same checkpoint.
            if held is not None:
                held.abandon()
            if isinstance(exc, TimeoutError):
                self.metrics.count_upstream_error("timeout")
                return self._upstream_failed(504, "upstream_timeout", exc)
            if isinstance(exc, aiohttp.ClientError):
                self.metrics.count_upstream_error("unreachable")
                return self._upstream_failed(502, "upstream_unreachable", exc)
            raise
        # The time held does not count against the upstream's timeout: the
        # upstream was not waited on meanwhile.
        remaining = max(0.0, deadline - loop.time())
        seconds: float | None = None
        try:
            if held is not None:
                try:
                    seconds = await held.release()
                except asyncio.CancelledError:
                    held.abandon()  # the client went away while held
                    raise
                except CrabError as exc:
                    log.warning("LLM response dropped: turn end failed", extra={"error": exc.message})
                    return _crab_error(exc)
                self.metrics.observe_held(seconds)
            return await self._relay(request, up, loop.time() + remaining, seconds)
        finally:
            # After a complete body this is a no-op (the connection is back in
            # the pool); otherwise it drops the upstream connection.
            up.close()

    def _upstream_failed(self, status: int, code: str, exc: BaseException) -> web.Response:
        detail = str(exc) or type(exc).__name__
        log.warning("upstream request failed", extra={"upstream": self.cfg.upstream, "error": detail})
        if status == 504:
            if isinstance(exc, aiohttp.ConnectionTimeoutError):
                what = f"accepted no connection within [proxy] connect_timeout_s = {self.cfg.connect_timeout_s}"
            else:
                what = f"sent no response within [proxy] upstream_timeout_s = {self.cfg.upstream_timeout_s}"
            hint = (
                "Check that the LLM server is healthy and not overloaded; raise [proxy] upstream_timeout_s "
                "(or connect_timeout_s) in crabd.toml for long generations."
            )
        else:
            what = f"cannot be reached ({detail})"
            hint = "Start the LLM server, or point [proxy] upstream in crabd.toml at it."
        return _error(status, f"crab proxy: upstream {self.cfg.upstream} {what}", code, hint)

    async def _relay(
        self, request: web.Request, up: aiohttp.ClientResponse, deadline: float, held_s: float | None
    ) -> web.StreamResponse:
        # Content-Length stays when the upstream sent one (the same bytes pass);
        # otherwise aiohttp chunks the response itself.
        out = web.StreamResponse(status=up.status, reason=up.reason, headers=_strip(up.headers, _HOP_BY_HOP))
        if held_s is not None:
            # How long this answer waited for the turn's checkpoint: the delay
            # crab added for this agent (0 when the checkpoint was hidden).
            out.headers[HELD_HEADER] = f"{held_s:.6f}"
        broke: str | None = None
        try:
            async with asyncio.timeout_at(deadline):
                await out.prepare(request)
                while True:
                    # Read errors are the upstream's; write errors (below) the client's.
                    try:
                        chunk = await up.content.readany()
                    except aiohttp.ClientError as exc:
                        broke = f"midstream: {exc or type(exc).__name__}"
                        break
                    if not chunk:
                        break
                    await out.write(chunk)
                if broke is None:
                    await out.write_eof()
        except TimeoutError:
            broke = f"timeout: the response took longer than [proxy] upstream_timeout_s = {self.cfg.upstream_timeout_s}"
        except ConnectionError:
            # The client went away; the caller closes the upstream response.
            request[_OUTCOME] = "client_gone"
        if broke is not None:
            # Status and part of the body are out: the only honest signal
            # left is to close the connection without the terminating chunk
            # (or short of Content-Length), so the client sees a truncated
            # response, not a clean end.
            kind = broke.split(":", 1)[0]
            self.metrics.count_upstream_error(kind)
            log.warning("upstream response broke off", extra={"upstream": self.cfg.upstream, "error": broke})
            request[_OUTCOME] = "aborted"
            if request.transport is not None:
                request.transport.close()  # flushes what was written, then closes
        return out
