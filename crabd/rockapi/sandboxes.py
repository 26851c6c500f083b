"""What the ROCK server does for each route, on crab sandboxes, through crab's async SDK.

The server is a crab client like any other: it runs as its user and calls
crabd on that user's behalf, so crabd's authorization (ownership, quotas)
applies to everything it does, and it reaches nothing crabd would not give
that user.  Mapping:

* a ROCK sandbox is a crab sandbox; ROCK's ``sandbox_id`` is the crab
  sandbox's *name* (``rock-<hex>`` unless the client chose one), so
  ``start_async`` can answer before crabd has made it, and ``crabctl``,
  the SDK, checkpoints, restore and fork name the same sandbox;
* a ROCK session is a crab named session (``default`` included: ROCK's
  default session is a named one here, so crab's own default session stays
  free for crab's SDK users of the same sandbox);
* every action (``run_in_session``, ``execute``, ``write_file``,
  ``upload``, ``read_file``) is a crab turn of its own, ended ``deferred``:
  the reply comes back once the turn is closed, and the inspector decides
  and checkpoints it while the agent waits for its LLM;
* ``stop`` removes the crab sandbox but keeps its checkpoints (restore or
  fork them later by id);
* crab's own operations sit next to ROCK's under ``/crab/``: checkpoint,
  restore, fork (the forks are ROCK sandboxes too).

Sessions: ROCK's client runs one command per session at a time only by
convention, and crab refuses a second one (``SandboxBusy``), so commands of
one session queue here.  ``arun()`` without a session opens a temporary
session ``bash-<time_ns>`` for every call and never closes it: those idle
longer than ``temp_idle_s`` are closed in the background, and when crab's
``[quota] max_sessions`` refuses a new session the longest-idle temporary
ones are closed to make room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from crabd.errors import CrabError, InvalidRequest, NotFound, QuotaExceeded
from crabd.rockapi import wire
from crabd.sdk import AsyncClient, AsyncSandbox, shell
from crabd.sdk.models import ExecResult

log = logging.getLogger("crabd.rockapi")

#: A ROCK sandbox id the client chose: what a crab sandbox name may be.
SANDBOX_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
#: Every action is a turn of its own, decided in the background (the agent's LLM time).
TURN = "deferred"
#: Largest file ``read_file`` returns (bytes).
MAX_READ = 64 << 20


@dataclass
class _Session:
    temp: bool
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    used: float = field(default_factory=time.monotonic)


@dataclass
class _Starting:
    task: asyncio.Task[None]
    error: str = ""


class RockSandboxes:
    """The ROCK server's sandboxes and sessions, all of them crab's, reached as this process's user."""

    def __init__(self, client: AsyncClient, *, aliases: dict[str, str] | None = None, temp_idle_s: float = 600.0):
        self.client = client
        #: ROCK image name -> what crab starts instead (e.g. python:3.11 -> crab-env/bookworm).
        self.aliases = dict(aliases or {})
        self.temp_idle_s = temp_idle_s
        self._starting: dict[str, _Starting] = {}
        self._sessions: dict[str, dict[str, _Session]] = {}

    # --- sandboxes --------------------------------------------------------------

    async def start(self, req: wire.StartRequest) -> dict[str, Any]:
        """Begin making a sandbox; ROCK's client then polls ``status`` until it is alive."""
        sid = req.sandbox_id or f"rock-{secrets.token_hex(6)}"
        if not SANDBOX_NAME.fullmatch(sid):
            raise InvalidRequest(f"sandbox_id {sid[:80]!r} is not a valid crab sandbox name")
        if sid in self._starting and not self._starting[sid].error:
            raise InvalidRequest(f"sandbox {sid} is already being started")
        image = self.aliases.get(req.image, req.image) or "crab-env/bookworm"
        options: dict[str, Any] = {"image": image, "name": sid}
        if req.memory:
            options["memory"] = req.memory
        if req.cpus:
            options["cpus"] = float(req.cpus)
        starting = _Starting(asyncio.create_task(self._create(sid, options)))
        self._starting[sid] = starting
        return {"sandbox_id": sid, "host_name": "crab", "host_ip": "127.0.0.1", "code": int(wire.Code.OK)}

    async def _create(self, sid: str, options: dict[str, Any]) -> None:
        try:
            await self.client.create(**options)
        except CrabError as exc:
            self._starting[sid].error = exc.message + (f" ({exc.hint})" if exc.hint else "")
            log.warning("sandbox not made", extra={"sandbox": sid, "error": exc.message})

    async def status(self, sid: str) -> dict[str, Any]:
        starting = self._starting.get(sid)
        if starting is not None and (starting.error or not starting.task.done()):
            alive, phases, state = wire.status_of("", False, starting.error)
            return {"sandbox_id": sid, "is_alive": alive, "status": phases, "state": state}
        sb = await self._sandbox(sid)
        alive, phases, state = wire.status_of(sb.info.state, True, "")
        return {
            "sandbox_id": sid,
            "is_alive": alive,
            "status": phases,
            "state": state,
            "host_name": "crab",
            "host_ip": "127.0.0.1",
            "image": sb.info.image,
            "cpus": sb.info.cpus,
            "memory": str(sb.info.memory_bytes),
        }

    async def stop(self, sid: str) -> str:
        """Remove the sandbox, keeping its checkpoints (they can still be restored or forked by id)."""
        starting = self._starting.pop(sid, None)
        if starting is not None and not starting.task.done():
            with contextlib.suppress(BaseException):
                await starting.task
        self._sessions.pop(sid, None)
        sb = await self._sandbox(sid)
        await sb.remove(force=True, keep_checkpoints=True)
        return f"{sid} stopped"

    async def _sandbox(self, sid: str) -> AsyncSandbox:
        starting = self._starting.get(sid)
        if starting is not None and starting.error:
            raise NotFound(f"sandbox {sid} was not made: {starting.error}")
        if starting is not None and not starting.task.done():
            raise InvalidRequest(f"sandbox {sid} is still starting", hint="Wait until get_status says it is alive.")
        return await self.client.get(sid)

    # --- sessions -----------------------------------------------------------------

    async def create_session(self, req: wire.CreateSessionRequest) -> dict[str, Any]:
        sb = await self._sandbox(req.sandbox_id)
        sessions = self._sessions.setdefault(req.sandbox_id, {})
        if req.session in sessions:
            return {"output": "", "session_type": "bash"}  # as ROCK: an existing session is left as it is
        user = await self._user_ids(sb, req.remote_user) if req.remote_user else ""
        env = dict(req.env or {})
        try:
            await self._open(sb, req.session, env=env, empty_env=not req.env_enable, user=user)
        except InvalidRequest as exc:
            if "already has a session" not in exc.message:
                raise
        sessions[req.session] = _Session(temp=bool(wire.TEMP_SESSION.fullmatch(req.session)))
        output = ""
        for path in req.startup_source:
            r = await sb.session(req.session).run(shell.sourced(path), timeout=30)
            output += r.text
        return {"output": output.strip(), "session_type": "bash"}

    async def _open(self, sb: AsyncSandbox, name: str, *, env: dict[str, str], empty_env: bool, user: str) -> None:
        """Open crab session ``name``; past crab's session quota, close idle temporary sessions and retry once."""
        try:
            await sb.session(name).open(env=env, empty_env=empty_env, user=user)
        except QuotaExceeded:
            if not await self._close_idle_temps(sb, keep=0.0):
                raise
            await sb.session(name).open(env=env, empty_env=empty_env, user=user)

    async def _user_ids(self, sb: AsyncSandbox, user: str) -> str:
        """``remote_user`` (a name in the sandbox) as "uid:gid", which crab's sessions take."""
        r = await sb.run(["id", "-u", "--", user])
        g = await sb.run(["id", "-g", "--", user])
        if r.exit_code != 0 or g.exit_code != 0:
            raise InvalidRequest(f"no user {user!r} in the sandbox: {r.stderr.decode(errors='replace').strip()}")
        return f"{r.text.strip()}:{g.text.strip()}"

    async def run_in_session(self, req: wire.RunRequest) -> tuple[dict[str, Any] | None, str]:
        """The command's observation, or (None, why) for ROCK's Failed reply (``check="raise"`` and a bad exit)."""
        sb = await self._sandbox(req.sandbox_id)
        entry = await self._session(sb, req.sandbox_id, req.session)
        async with entry.lock:  # ROCK's clients may send one session two commands at once; crab runs one
            entry.used = time.monotonic()
            timeout = req.timeout or 300.0
            r = await sb.session(req.session).run(shell.merged(req.command), timeout=timeout, turn=TURN)
            entry.used = time.monotonic()
        output = r.stdout.decode("utf-8", "replace").strip()
        if r.timed_out:
            # crab killed the session's bash (a non-interactive bash cannot be interrupted cleanly).
            self._sessions.get(req.sandbox_id, {}).pop(req.session, None)
            return None, f"command timed out after {timeout:g} s; session {req.session!r} was closed"
        if req.check == "raise" and r.exit_code != 0:
            return None, f"Command {req.command!r} failed with exit code {r.exit_code}. Here is the output:\n{output!r}"
        code = None if req.check == "ignore" else r.exit_code
        return {
            "session_type": "bash",
            "output": output,
            "exit_code": code,
            "failure_reason": "",
            "expect_string": "",
        }, ""

    async def _session(self, sb: AsyncSandbox, sid: str, name: str) -> _Session:
        sessions = self._sessions.setdefault(sid, {})
        entry = sessions.get(name)
        if entry is None:
            # Made by an earlier server, or brought back by a crab restore or fork: crab's listing says.
            if name not in {s.name for s in await sb.sessions()}:
                raise NotFound(f"session {name!r} does not exist in sandbox {sid}", hint="create_session first.")
            entry = sessions.setdefault(name, _Session(temp=bool(wire.TEMP_SESSION.fullmatch(name))))
        return entry

    async def close_session(self, req: wire.CloseSessionRequest) -> None:
        sb = await self._sandbox(req.sandbox_id)
        entry = self._sessions.get(req.sandbox_id, {}).pop(req.session, None)
        if entry is None and req.session not in {s.name for s in await sb.sessions()}:
            return  # as ROCK: closing a session that does not exist is not an error
        if entry is not None:
            async with entry.lock:
                await sb.session(req.session).aclose()
        else:
            await sb.session(req.session).aclose()

    async def _close_idle_temps(self, sb: AsyncSandbox, *, keep: float) -> int:
        """Close the sandbox's temporary sessions idle for ``keep`` seconds or more; how many were closed."""
        now = time.monotonic()
        sessions = self._sessions.get(sb.info.name, {})
        idle = sorted(
            (e.used, name) for name, e in sessions.items() if e.temp and not e.lock.locked() and now - e.used >= keep
        )
        closed = 0
        for _, name in idle:
            entry = sessions.pop(name)
            async with entry.lock:
                with contextlib.suppress(CrabError):
                    await sb.session(name).aclose()
                    closed += 1
        return closed

    async def sweep(self) -> None:
        """Close temporary sessions idle longer than ``temp_idle_s``, in every sandbox (the background task's step)."""
        for sid in list(self._sessions):
            with contextlib.suppress(CrabError):
                await self._close_idle_temps(await self.client.get(sid), keep=self.temp_idle_s)

    # --- commands and files -------------------------------------------------------

    async def execute(self, req: wire.CommandRequest) -> dict[str, Any]:
        sb = await self._sandbox(req.sandbox_id)
        # ROCK runs it without a shell: a string is one program name, as subprocess.run(["ls -l"]) would be.
        argv = [req.command] if isinstance(req.command, str) else list(req.command)
        r = await sb.run(argv, timeout=req.timeout or 0.0, workdir=req.cwd or "", env=req.env or None, turn=TURN)
        return {"stdout": r.text, "stderr": r.stderr.decode("utf-8", "replace"), "exit_code": _code(r)}

    async def read_file(self, req: wire.ReadFileRequest) -> str:
        sb = await self._sandbox(req.sandbox_id)
        r = await sb.run(["cat", "--", req.path], max_output=MAX_READ, turn=TURN)
        if r.exit_code != 0:
            raise NotFound(f"cannot read {req.path}: {r.stderr.decode('utf-8', 'replace').strip()}")
        if r.stdout_dropped:
            raise InvalidRequest(f"{req.path} is larger than {MAX_READ} bytes")
        try:
            return r.stdout.decode(req.encoding or "utf-8", req.errors or "strict")
        except (LookupError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"cannot decode {req.path}: {exc}") from exc

    async def write_file(self, sid: str, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` in the sandbox, making its directory (as ROCK's write_file and upload do)."""
        if not path.startswith("/") or "\0" in path:
            raise InvalidRequest(f"path {path[:200]!r} must be absolute")
        sb = await self._sandbox(sid)
        r = await sb.run(shell.write_file_argv(path), stdin=data, turn=TURN)
        if r.exit_code != 0:
            raise InvalidRequest(f"cannot write {path}: {r.stderr.decode('utf-8', 'replace').strip()}")

    # --- crab's own operations ----------------------------------------------------

    async def checkpoint(self, req: wire.CheckpointRequest) -> dict[str, Any]:
        sb = await self._sandbox(req.sandbox_id)
        ck = await sb.checkpoint(req.label)
        return {"checkpoint": ck.id, "kind": ck.kind, "turn": ck.turn}

    async def restore(self, req: wire.RestoreRequest) -> dict[str, Any]:
        sb = await self._sandbox(req.sandbox_id)
        info = await sb.restore(req.checkpoint or None, turn=req.turn)
        self._sessions.pop(req.sandbox_id, None)  # its sessions are the checkpoint's now (crab's listing says)
        return {"sandbox_id": req.sandbox_id, "head": info.head, "not_restored": list(info.not_restored)}

    async def fork(self, req: wire.ForkRequest) -> dict[str, Any]:
        sb = await self._sandbox(req.sandbox_id)
        forks = await sb.fork(req.n, req.checkpoint or None, turn=req.turn, name_prefix=f"{req.sandbox_id}-f")
        return {"sandbox_ids": [f.info.name for f in forks]}


def _code(r: ExecResult) -> int:
    return 124 if r.timed_out else r.exit_code
