"""The HTTP server that speaks ROCK's sandbox API (``/apis/envs/sandbox/v1/...``) on crab sandboxes.

Who may call it: the server runs as one user and acts as that user toward
crabd (``sandboxes.py``), so only that user may call it; anyone else gets
403 before a body is read.  It listens only where the caller can be known:

* a Unix socket (``unix:/path``): made with mode 0600, and each
  connection's peer checked with ``SO_PEERCRED``;
* a loopback TCP address (``127.0.0.1:8080``, ``[::1]:8080``; what ROCK's
  client, which speaks TCP only, needs): each connection's owner read from
  the kernel's socket table (``util/loopback_peer.py``, as crabd's LLM
  proxy does).  A sandbox cannot reach it: each has its own network
  namespace, and with it its own loopback.

Any other address is refused: there is no unauthenticated door.  Request
bodies are bounded (``max_body``); every reply is ROCK's envelope with HTTP
200 (``wire.py``), a crab error becoming a Failed reply that says what
failed and what crab said.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, web

from crabd.errors import ConfigError, CrabError, InvalidRequest, PermissionDenied
from crabd.rockapi import wire
from crabd.rockapi.sandboxes import RockSandboxes
from crabd.util.loopback_peer import identify_peer

log = logging.getLogger("crabd.rockapi")

#: Largest request body (an upload's file included).
MAX_BODY = 64 << 20
#: How often idle temporary sessions are looked for.
SWEEP_S = 60.0
#: How long a stopping server lets requests in flight finish.  A request can wait on a long command
#: (a ROCK ``arun`` of ``sleep 300`` whose client is gone), and aiohttp's own default waits 60 s; the
#: command itself goes on in its sandbox, which is crabd's, not this server's.
SHUTDOWN_GRACE_S = 3.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def parse_listen(text: str) -> tuple[str, str, int]:
    """``unix:/path`` or ``HOST:PORT`` (loopback only) -> ("unix", path, 0) or ("tcp", host, port)."""
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if not path.startswith("/"):
            raise ConfigError(f"--listen {text!r}: a Unix socket path must be absolute")
        return "unix", path, 0
    host, sep, port_s = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not port_s.isdigit() or not 0 <= int(port_s) < 65536:
        raise ConfigError(f"--listen {text!r}: give HOST:PORT (loopback) or unix:/path")
    if host not in ("127.0.0.1", "::1", "localhost"):
        raise ConfigError(
            f"--listen {text!r}: only loopback (127.0.0.1, ::1) or a Unix socket, where each caller can be known"
        )
    return "tcp", "127.0.0.1" if host == "localhost" else host, int(port_s)


def _peer_uid(request: web.Request) -> int:
    """The uid of the process on the other end of ``request``'s connection (PermissionDenied if unknown)."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        raise PermissionDenied("cannot identify the caller: no socket", uid=-1, sandbox="")
    if sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", creds)[1])
    return identify_peer(sock.getpeername(), sock.getsockname()).uid


def _json(body: dict[str, Any]) -> web.Response:
    return web.json_response(body)


@web.middleware
async def _only_our_user(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        uid = await asyncio.to_thread(_peer_uid, request)
    except (PermissionDenied, OSError) as exc:
        log.warning("caller not identified", extra={"error": str(exc)})
        return web.json_response(wire.failed("forbidden", "the caller could not be identified"), status=403)
    if uid != os.getuid():
        log.warning("caller refused", extra={"uid": uid})
        return web.json_response(
            wire.failed("forbidden", f"this ROCK server acts as uid {os.getuid()}; uid {uid} may not use it"),
            status=403,
        )
    return await handler(request)


class RockServer:
    """``async with RockServer(sandboxes, listen)``: serving until the ``with`` ends."""

    def __init__(self, sandboxes: RockSandboxes, listen: str, *, max_body: int = MAX_BODY) -> None:
        self.sandboxes = sandboxes
        self.kind, self.host, self.port = parse_listen(listen)
        self.app = web.Application(client_max_size=max_body, middlewares=[_only_our_user])
        self._routes()
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        """What ``ROCK_BASE_URL`` should be (TCP) or the socket's path (Unix)."""
        if self.kind == "unix":
            return f"unix:{self.host}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _routes(self) -> None:
        s = self.sandboxes
        p = wire.PREFIX
        self.app.add_routes(
            [
                web.post(p + "/start_async", self._route("start sandbox", wire.StartRequest, s.start)),
                web.get(p + "/get_status", self._get_status),
                web.get(p + "/is_alive", self._is_alive),
                web.post(p + "/execute", self._route("execute", wire.CommandRequest, s.execute)),
                web.post(
                    p + "/create_session", self._route("create session", wire.CreateSessionRequest, s.create_session)
                ),
                web.post(p + "/run_in_session", self._run_in_session),
                web.post(p + "/close_session", self._route("close session", wire.CloseSessionRequest, self._close)),
                web.post(p + "/read_file", self._read_file),
                web.post(p + "/write_file", self._route("write file", wire.WriteFileRequest, self._write)),
                web.post(p + "/upload", self._upload),
                web.post(p + "/stop", self._route("stop", wire.SandboxRef, self._stop)),
                web.get(p + "/get_token", self._get_token),
                web.post(p + "/crab/checkpoint", self._route("checkpoint", wire.CheckpointRequest, s.checkpoint)),
                web.post(p + "/crab/restore", self._route("restore", wire.RestoreRequest, s.restore)),
                web.post(p + "/crab/fork", self._route("fork", wire.ForkRequest, s.fork)),
            ]
        )

    # --- the envelope ---------------------------------------------------------------

    @staticmethod
    async def _body(request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"invalid parameter: the body is not JSON ({exc})") from exc

    def _route(self, what: str, model: type[Any], act: Callable[[Any], Awaitable[Any]]) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._answer(what, lambda: self._parsed(request, model, act))

        return handle

    async def _parsed(self, request: web.Request, model: type[Any], act: Callable[[Any], Awaitable[Any]]) -> Any:
        return await act(wire.parse(model, await self._body(request)))

    @staticmethod
    async def _answer(what: str, act: Callable[[], Awaitable[Any]]) -> web.Response:
        """Run ``act``; its result as Success, a crab error as ROCK's Failed reply, anything else logged."""
        try:
            return _json(wire.success(await act()))
        except CrabError as exc:
            return _json(wire.crab_failure(f"failed to {what}", exc))
        except Exception as exc:  # the client must get an envelope whatever went wrong
            log.exception("ROCK request failed", extra={"route": what})
            return _json(
                wire.failed_code(f"failed to {what}", f"internal error: {type(exc).__name__}", wire.Code.SERVER)
            )

    # --- routes that are not one model and one call -------------------------------------

    async def _get_status(self, request: web.Request) -> web.Response:
        sid = request.query.get("sandbox_id", "")
        return await self._answer(
            "get status", lambda: self.sandboxes.status(wire.parse(wire.SandboxRef, {"sandbox_id": sid}).sandbox_id)
        )

    async def _is_alive(self, request: web.Request) -> web.Response:
        async def alive() -> dict[str, Any]:
            status = await self.sandboxes.status(wire.parse(wire.SandboxRef, dict(request.query)).sandbox_id)
            return {"is_alive": status["is_alive"], "message": status["state"]}

        return await self._answer("check sandbox", alive)

    async def _run_in_session(self, request: web.Request) -> web.Response:
        """A command's observation; with ``check="raise"`` a non-zero exit is ROCK's Failed (its client needs that)."""
        try:
            req = wire.parse(wire.RunRequest, await self._body(request))
            observation, why = await self.sandboxes.run_in_session(req)
        except CrabError as exc:
            return _json(wire.crab_failure("failed to run in session", exc))
        except Exception as exc:
            log.exception("ROCK request failed", extra={"route": "run_in_session"})
            return _json(wire.failed("failed to run in session", f"internal error: {type(exc).__name__}"))
        if observation is None:
            return _json(wire.failed("failed to run in session", why))
        return _json(wire.success(observation))

    async def _read_file(self, request: web.Request) -> web.Response:
        """ROCK's client reads ``result["content"]`` without checking the status: a failure still carries one."""
        try:
            req = wire.parse(wire.ReadFileRequest, await self._body(request))
            return _json(wire.success({"content": await self.sandboxes.read_file(req)}))
        except CrabError as exc:
            return _json(wire.failed("failed to read file", exc.message, {"content": ""}))

    async def _write(self, req: wire.WriteFileRequest) -> dict[str, Any]:
        await self.sandboxes.write_file(req.sandbox_id, req.path, req.content.encode())
        return {"success": True, "message": f"wrote {req.path}"}

    async def _upload(self, request: web.Request) -> web.Response:
        async def upload() -> dict[str, Any]:
            fields: dict[str, str] = {}
            data: bytes | None = None
            name = ""
            reader = await request.multipart()
            async for part in reader:
                if not isinstance(part, BodyPartReader):
                    continue  # a nested multipart: ROCK's client sends none
                if part.name == "file":
                    data, name = bytes(await part.read()), part.filename or ""
                elif part.name in ("target_path", "sandbox_id"):
                    fields[part.name] = (await part.text())[:4096]
            if data is None or not fields.get("target_path") or not fields.get("sandbox_id"):
                raise InvalidRequest("invalid parameter: upload needs file, target_path and sandbox_id")
            await self.sandboxes.write_file(fields["sandbox_id"], fields["target_path"], data)
            return {"success": True, "message": f"uploaded {name} to {fields['target_path']}", "file_name": name}

        return await self._answer("upload", upload)

    async def _close(self, req: wire.CloseSessionRequest) -> dict[str, Any]:
        await self.sandboxes.close_session(req)
        return {"session_type": "bash"}

    async def _stop(self, req: wire.SandboxRef) -> str:
        return await self.sandboxes.stop(req.sandbox_id)

    async def _get_token(self, _request: web.Request) -> web.Response:
        # crab has no object store for uploads: every field null makes ROCK's client upload directly.
        keys = (
            "AccessKeyId",
            "AccessKeySecret",
            "SecurityToken",
            "Expiration",
            "Endpoint",
            "Bucket",
            "Region",
            "Prefix",
        )
        return _json(wire.success(dict.fromkeys(keys)))

    # --- serving ----------------------------------------------------------------------

    async def __aenter__(self) -> RockServer:
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        if self.kind == "unix":
            site: web.BaseSite = web.UnixSite(self._runner, self._fresh_socket_path())
            old = os.umask(0o177)  # the socket file is made 0600: only this user may connect
            try:
                await site.start()
            finally:
                os.umask(old)
        else:
            site = web.TCPSite(self._runner, self.host, self.port)
            await site.start()
            if self.port == 0:
                self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._sweeper = asyncio.create_task(self._sweep())
        log.info("ROCK server listening", extra={"url": self.url})
        return self

    def _fresh_socket_path(self) -> str:
        """The Unix socket's path; a stale socket of ours there is replaced, anything else is refused."""
        path = Path(self.host)
        try:
            st = path.lstat()
        except FileNotFoundError:
            return self.host
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
            raise ConfigError(f"{path} exists and is not a socket of this user; not replacing it")
        path.unlink()
        return self.host

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.sandboxes.sweep()
            except Exception:  # the next sweep tries again
                log.exception("closing idle temporary sessions failed")

    async def __aexit__(self, *exc: object) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._runner is not None:
            await self._runner.cleanup()
        if self.kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.host)
