"""An OpenAI-compatible stand-in for a vLLM server, for tests and benchmarks.

It answers ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``
(also under any prefix, e.g. ``/sandboxes/{id}/v1/...``) with filler or
scripted text, paced by ``crabd.llm.latency.LatencyModel``.  Tokens are
whitespace-separated words; ``logprobs`` (and vLLM's
``return_tokens_as_token_ids``) are answered with stable made-up values.  See docs/llm.md.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from crabd.config import is_loopback
from crabd.llm.latency import (
    LatencyModel,
    RequestPlan,
    ScriptEntry,
    load_latency,
    load_script,
    plan_request,
    request_rng,
    routing_key,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL = "crab-standin-small"
SANDBOX_HEADER = "X-Crab-Sandbox"
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 422: "UnprocessableEntityError", 429: "RateLimitError"}  # fmt: skip


@dataclass(frozen=True)
class ServedRequest:
    """One accepted completion request (past validation) and what was planned for it."""

    route: str
    key: str
    index: int
    prompt_tokens: int
    plan: RequestPlan


class _ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.kind = kind or _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}
        return web.json_response(body, status=self.status)


@dataclass(frozen=True)
class _Call:
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    user: str | None
    #: OpenAI's request ``seed``: when given, it replaces the per-key request counter.
    seed: int | None = None
    #: The request asked for logprobs (chat: ``logprobs: true``; completions: ``logprobs: N``).
    logprobs: bool = False
    #: vLLM's ``return_tokens_as_token_ids``: each logprob entry's token reads ``token_id:<n>``.
    token_ids: bool = False


def _count_tokens(value: Any) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, int) and not isinstance(value, bool):
        return 1  # a token id
    if isinstance(value, list):
        return sum(_count_tokens(v) for v in value)
    if isinstance(value, dict) and value.get("type") == "text":
        return _count_tokens(value.get("text", ""))
    return 0


def _parse(raw: bytes, chat: bool, model: str) -> _Call:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise _ApiError(400, "request body must be a JSON object")
    if (body.get("model") or model) != model:
        raise _ApiError(404, f"The model `{body['model']}` does not exist.")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise _ApiError(400, "'messages' must be a non-empty list of message objects")
        prompt_tokens = sum(_count_tokens(m.get("content")) for m in messages)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list):
            raise _ApiError(400, "'prompt' is required (a string or a list)")
        prompt_tokens = _count_tokens(prompt)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise _ApiError(400, "'max_tokens' must be a positive integer")
    if body.get("n", 1) != 1:
        raise _ApiError(400, "the stand-in supports only n=1")
    stream, options, user = body.get("stream", False), body.get("stream_options") or {}, body.get("user")
    if not isinstance(stream, bool) or not isinstance(options, dict) or not isinstance(user, str | None):
        raise _ApiError(400, "'stream' must be a boolean, 'stream_options' an object and 'user' a string")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise _ApiError(400, "'seed' must be an integer")
    logprobs, as_ids = body.get("logprobs"), body.get("return_tokens_as_token_ids", False)
    if logprobs is not None and not isinstance(logprobs, bool | int):
        raise _ApiError(400, "'logprobs' must be a boolean (chat) or an integer (completions)")
    if not isinstance(as_ids, bool):
        raise _ApiError(400, "'return_tokens_as_token_ids' must be a boolean")
    want = logprobs is not None and logprobs is not False
    return _Call(prompt_tokens, max_tokens, stream, bool(options.get("include_usage")), user, seed, want, as_ids)


def token_id(piece: str) -> int:
    """The stand-in's token id of one output token (stable across runs; 100 and up, as ids below are special)."""
    return 100 + int.from_bytes(hashlib.sha256(piece.encode()).digest()[:4], "big") % 50_000


def _logprobs(plan: RequestPlan, call: _Call, chat: bool, start: int = 0, stop: int | None = None) -> Any:
    """Logprobs of the answer's tokens ``start:stop``, as chat or (legacy) completions spell them.

    Values are derived from the response id and position, so a seeded request gets the same ones again.
    """
    if not call.logprobs:
        return None
    pieces = plan.pieces[start:stop]
    tokens = [f"token_id:{token_id(p)}" if call.token_ids else p for p in pieces]
    values = [
        -(int.from_bytes(hashlib.sha256(f"{plan.response_id}/{start + i}".encode()).digest()[:2], "big") % 4000) / 1000
        for i in range(len(pieces))
    ]
    if chat:
        return {
            "content": [
                {"token": t, "logprob": v, "bytes": list(p.encode()), "top_logprobs": []}
                for t, v, p in zip(tokens, values, pieces, strict=True)
            ]
        }
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": []}


def _tool_calls(plan: RequestPlan) -> list[dict[str, Any]]:
    """The scripted tool calls of a chat answer, as OpenAI spells them (ids from the response's)."""
    return [
        {
            "id": f"call_{plan.response_id[:16]}_{i}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for i, c in enumerate(plan.entry.tool_calls)
    ]


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _sleep_until(deadline: float) -> None:
    # Pacing against absolute deadlines keeps sleep overshoot from adding up over many tokens.
    delay = deadline - asyncio.get_running_loop().time()
    if delay > 0:
        await asyncio.sleep(delay)


def _drop_connection(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()


class StandinServer:
    """The stand-in server: ``with StandinServer() as srv`` (own thread) or ``async with`` (current loop)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = DEFAULT_MODEL,
        seed: int = 0,
        time_scale: float | None = None,
        latency: LatencyModel | None = None,
        script: str | Path | Sequence[ScriptEntry] | None = None,
        allow_remote: bool = False,
    ) -> None:
        if not allow_remote and not _is_loopback(host):
            raise ValueError(f"refusing to listen on non-loopback {host!r}: a test tool (--allow-remote overrides)")
        if not 0 <= port <= 65535:
            raise ValueError(f"port out of range: {port}")
        latency = latency or LatencyModel()
        if time_scale is not None:
            latency = LatencyModel.model_validate({**latency.model_dump(), "time_scale": time_scale})
        self.host, self.model, self.seed, self.latency = host, model, seed, latency
        self.script = load_script(script) if isinstance(script, str | Path) else tuple(script or ())
        self._want_port, self._port = port, 0
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._served: list[ServedRequest] = []
        self._indexes: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("the server is not running")
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def requests(self) -> dict[str, int]:
        """Requests received per route: ``models``, ``chat``, ``completions``."""
        with self._lock:
            return dict(self._requests)

    @property
    def served(self) -> list[ServedRequest]:
        """Completion requests that passed validation, in arrival order."""
        with self._lock:
            return list(self._served)

    async def astart(self) -> None:
        """Listen from the running event loop; ``aclose()`` stops it."""
        if self._runner is not None or self._thread is not None:
            raise RuntimeError("the server is already running")
        await self._open()

    async def _open(self) -> None:
        app = web.Application()
        tail = "/{prefix:(?:.*/)?}v1"
        app.router.add_get(f"{tail}/models", self._models)
        app.router.add_post(f"{tail}/chat/completions", functools.partial(self._complete, chat=True))
        app.router.add_post(f"{tail}/completions", functools.partial(self._complete, chat=False))
        # handler_cancellation: a client that gives up ends its request, as in vLLM.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self._want_port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._port = runner, int(runner.addresses[0][1])

    async def aclose(self) -> None:
        """Stop listening and end open requests (after a 0.5 s grace)."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("the server runs in its own thread: stop it with close()")
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self._port = 0

    async def __aenter__(self) -> StandinServer:
        await self.astart()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def start(self) -> None:
        """Listen from a new thread with its own event loop; ``close()`` stops it and joins the thread."""
        if self._runner is not None or self._thread is not None:
            raise RuntimeError("the server is already running")
        ready, failure = threading.Event(), list[BaseException]()

        def run() -> None:
            try:
                asyncio.run(self._thread_main(ready))
            except BaseException as e:
                failure.append(e)
            finally:
                ready.set()

        self._thread = threading.Thread(target=run, name="crab-llm-standin", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = self._loop = self._stop = None
            raise failure[0]

    def close(self) -> None:
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            if self._runner is not None:
                raise RuntimeError("the server runs in an event loop: stop it with aclose()")
            return
        if loop is not None and stop is not None and thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
        thread.join()
        self._thread = self._loop = self._stop = None

    async def _thread_main(self, ready: threading.Event) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        await self._open()
        ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.aclose()

    def __enter__(self) -> StandinServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, route: str) -> None:
        with self._lock:
            self._requests[route] += 1

    async def _models(self, request: web.Request) -> web.Response:
        self._count("models")
        card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "crab-standin"}
        return web.json_response({"object": "list", "data": [card]})

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        route = "chat" if chat else "completions"
        self._count(route)
        try:
            call = _parse(await request.read(), chat, self.model)
        except _ApiError as e:
            return e.response()
        key = routing_key(call.user, request.headers.get(SANDBOX_HEADER), request.match_info["prefix"])
        if call.seed is not None:
            # A seeded request gets the same latency and text whenever it is
            # sent: side-by-side benchmark arms then see identical LLM time.
            index = call.seed
        else:
            index, self._indexes[key] = self._indexes[key], self._indexes[key] + 1
        rng = request_rng(self.seed, key, index)
        plan = plan_request(self.latency, self.script, rng, index, call.prompt_tokens, call.max_tokens)
        self._record(ServedRequest(route, key, index, call.prompt_tokens, plan))
        entry, pace = plan.entry, plan.latency
        if entry.delay_s:
            await asyncio.sleep(entry.delay_s)
        if pace is None:
            return _ApiError(entry.status or 500, entry.error or "scripted error", entry.error_type).response()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{plan.response_id}"
        head: dict[str, Any] = {"id": rid, "created": int(time.time()), "model": self.model}
        usage = {"prompt_tokens": call.prompt_tokens, "completion_tokens": plan.output_tokens}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        start = asyncio.get_running_loop().time()
        if call.stream:
            return await self._stream(request, call, chat, head, plan, usage if call.include_usage else None)
        if entry.disconnect:
            await _sleep_until(start + pace.total_s / 2)
            _drop_connection(request)
            return web.Response(status=499)  # never reaches the client
        await _sleep_until(start + pace.total_s)
        calls = _tool_calls(plan) if chat else []
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": plan.text or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
            choice: dict[str, Any] = {"index": 0, "message": message}
        else:
            choice = {"index": 0, "text": plan.text}
        choice.update(logprobs=_logprobs(plan, call, chat), finish_reason="tool_calls" if calls else plan.finish_reason)
        obj = "chat.completion" if chat else "text_completion"
        return web.json_response({**head, "object": obj, "choices": [choice], "usage": usage})

    async def _stream(
        self,
        request: web.Request,
        call: _Call,
        chat: bool,
        head: dict[str, Any],
        plan: RequestPlan,
        usage: dict[str, int] | None,
    ) -> web.StreamResponse:
        assert plan.latency is not None
        pace, pieces, disconnect = plan.latency, plan.pieces, plan.entry.disconnect
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(piece: str | None, first: bool, reason: str | None, i: int = -1) -> dict[str, Any]:
            lp = _logprobs(plan, call, chat, i, i + 1) if i >= 0 else None
            if chat:
                delta = {} if piece is None else {"content": piece}
                if first:
                    delta = {"role": "assistant", **delta}
                body: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                body = {"index": 0, "text": piece or ""}
            return {**head, "choices": [{**body, "logprobs": lp, "finish_reason": reason}]}

        due = asyncio.get_running_loop().time() + pace.ttft_s
        cut = len(pieces) // 2 if disconnect else -1
        for i, piece in enumerate(pieces):
            if i:
                due += pace.gaps_s[i - 1]
            await _sleep_until(due)
            if i == cut:
                _drop_connection(request)
                return resp
            await resp.write(_sse(chunk(piece, i == 0, None, i)))
        await _sleep_until(due)
        if disconnect:  # no tokens to cut after
            _drop_connection(request)
            return resp
        calls = _tool_calls(plan) if chat else []
        if calls:
            # One delta carries each call whole (servers may also split the arguments).
            delta: dict[str, Any] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
            if not pieces:
                delta = {"role": "assistant", **delta}
            body = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            await resp.write(_sse({**head, "choices": [body]}))
            await resp.write(_sse(chunk(None, False, "tool_calls")))
        else:
            await resp.write(_sse(chunk(None, not pieces, plan.finish_reason)))
        if usage is not None:
            await resp.write(_sse({**head, "choices": [], "usage": usage}))
        await resp.write(_sse("[DONE]"))
        await resp.write_eof()
        return resp

    def _record(self, served: ServedRequest) -> None:
        with self._lock:
            self._served.append(served)


def _is_loopback(host: str) -> bool:
    # Unlike crabd's proxy, a test tool may take "localhost" on trust.
    return host == "localhost" or is_loopback(host)


async def _serve(server: StandinServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        scale = server.latency.time_scale
        log.info("stand-in: model %r at %s/v1 (seed %d, time_scale %g)", server.model, server.url, server.seed, scale)
        await stop.wait()
        log.info("stopping")


def main(argv: Sequence[str] | None = None) -> int:
    """``crab-llm-standin``: serve the stand-in until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="crab-llm-standin", description="OpenAI-compatible stand-in LLM server.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback only unless --allow-remote)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: pick a free one)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name served at /v1/models")
    parser.add_argument("--seed", type=int, default=0, help="seed of the latency and text streams")
    parser.add_argument("--time-scale", type=float, help="multiplier on all waits (1.0: real time)")
    parser.add_argument("--script", type=Path, help="JSON Lines file of scripted answers")
    parser.add_argument("--latency", type=Path, help="TOML file of LatencyModel fields")
    parser.add_argument("--allow-remote", action="store_true", help="allow binding a non-loopback address")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        latency = load_latency(args.latency) if args.latency else None
    except (ValueError, OSError) as e:  # ValidationError and TOMLDecodeError are ValueErrors
        parser.error(f"--latency {args.latency}: {e}")
    try:
        server = StandinServer(
            host=args.host,
            port=args.port,
            model=args.model,
            seed=args.seed,
            time_scale=args.time_scale,
            latency=latency,
            script=args.script,
            allow_remote=args.allow_remote,
        )
    except (ValueError, OSError) as e:
        parser.error(str(e))
    try:
        asyncio.run(_serve(server))
    except OSError as e:  # e.g. the port is taken
        parser.exit(1, f"crab-llm-standin: cannot listen on {args.host}:{args.port}: {e}\n")
    return 0
