"""The command requests' edge: exec, session commands, named sessions and session state.

Each request's contents are checked first (``command_requests.py``, the
``[limits]``), then its sandbox goes through :class:`~crabd.service.access.Access`,
then it runs: alone, after the last turn end's checkpoint is durable, or as
a turn of its own (``turn_end``; ``coordinator/turnflow.py``).  A reply's
output is bounded to fit a gRPC message (``limits.fit_output``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from crabd.config import CrabConfig
from crabd.coordinator.commands import Commands
from crabd.coordinator.oneshot import ChunkSink
from crabd.coordinator.sandboxes import SandboxManager
from crabd.coordinator.turnflow import TurnFlow
from crabd.models import Caller, ExecOutcome, SandboxRecord, SessionInfo, TurnEnd, TurnRecord
from crabd.runtime.session_state import SessionState
from crabd.service import command_requests
from crabd.service.access import Access
from crabd.service.limits import RequestLimits, fit_output

#: A command's outcome and, when it ran as a turn of its own, that turn (:meth:`CommandEdge.exec`).
Ran = tuple[ExecOutcome, TurnRecord | None]


class CommandEdge:
    def __init__(
        self,
        cfg: CrabConfig,
        sandboxes: SandboxManager,
        commands: Commands,
        flow: TurnFlow,
        access: Access,
        limits: RequestLimits,
    ) -> None:
        self.cfg = cfg
        self.sandboxes = sandboxes
        self.commands = commands
        self.flow = flow
        self.access = access
        self.limits = limits

    async def exec(
        self,
        caller: Caller,
        ref: str,
        argv: list[str],
        *,
        env: dict[str, str],
        workdir: str,
        stdin: bytes,
        timeout_s: float,
        max_output: int,
        user: str,
        sink: ChunkSink | None,
        turn_end: str = "",
    ) -> Ran:
        """Run ``argv``; with ``turn_end``, as a turn of its own (:meth:`_command`)."""
        uid, gid = command_requests.check_exec(self.cfg.limits, argv, env, stdin, workdir, user)
        end = TurnEnd.parse(turn_end) if turn_end else None
        timeout = self.limits.timeout(timeout_s)
        limit = command_requests.max_output(self.cfg.limits, max_output)
        rec = await self.access.lookup(caller, ref)

        async def run() -> ExecOutcome:
            return await self.commands.exec(
                rec,
                argv,
                env=env,
                workdir=workdir,
                stdin=stdin,
                timeout_s=timeout,
                max_output=limit,
                uid=uid,
                gid=gid,
                sink=sink,
            )

        return await self._command(rec, end, run)

    async def session_run(
        self,
        caller: Caller,
        ref: str,
        command: str,
        *,
        timeout_s: float,
        max_output: int,
        sink: ChunkSink | None,
        turn_end: str = "",
        session: str = "",
    ) -> Ran:
        """Run ``command`` in a session ("": the default one); with ``turn_end``, as a turn of its own
        (:meth:`_command`)."""
        command_requests.check_session_command(self.cfg.limits, command)
        command_requests.check_session_name(session)
        end = TurnEnd.parse(turn_end) if turn_end else None
        timeout = self.limits.timeout(timeout_s)
        limit = command_requests.max_output(self.cfg.limits, max_output)
        rec = await self.access.lookup(caller, ref)
        return await self._command(
            rec,
            end,
            lambda: self.commands.session_run(
                rec, command, timeout_s=timeout, max_output=limit, sink=sink, session_name=session
            ),
        )

    async def open_session(
        self,
        caller: Caller,
        ref: str,
        name: str,
        *,
        env: dict[str, str],
        empty_env: bool,
        workdir: str,
        user: str,
        pty: tuple[int, int] | None = None,
    ) -> tuple[str, SessionInfo]:
        """Start named session ``name``'s bash (its environment, directory, user and terminal as given)."""
        uid, gid = command_requests.check_open_session(self.cfg.limits, name, env, workdir, user)
        size = command_requests.check_pty_size(pty)
        rec = await self.access.lookup(caller, ref)
        async with self.sandboxes.init_lost_means_dead(rec):
            info = await self.commands.sessions.open(
                rec, name, env=env, inherit_env=not empty_env, workdir=workdir, uid=uid, gid=gid, pty=size
            )
        return rec.id, info

    async def list_sessions(self, caller: Caller, ref: str) -> tuple[str, list[SessionInfo]]:
        rec = await self.access.lookup(caller, ref)
        async with self.sandboxes.init_lost_means_dead(rec):
            return rec.id, await self.commands.sessions.list(rec)

    async def close_session(self, caller: Caller, ref: str, name: str) -> tuple[str, SessionInfo]:
        """End a session's bash (a named one is gone; the default one starts afresh at its next command)."""
        command_requests.check_session_name(name)
        rec = await self.access.lookup(caller, ref)
        async with self.sandboxes.init_lost_means_dead(rec):
            await self.commands.sessions.close(rec, name)
        return rec.id, SessionInfo(name, 0, False)

    async def _command(self, rec: SandboxRecord, end: TurnEnd | None, run: Callable[[], Awaitable[ExecOutcome]]) -> Ran:
        """A command alone (once the last turn end's checkpoint is durable), or begun, run and ended as one turn."""
        turn: TurnRecord | None = None
        if end is None:
            await self.flow.before_action(rec)
            outcome = await run()
        else:
            outcome, turn = await self.flow.command_turn(rec, end, run)
        return fit_output(outcome, self.cfg.limits.max_reply_output_bytes), turn

    async def session_state(self, caller: Caller, ref: str) -> tuple[str, SessionState | None]:
        rec = await self.access.lookup(caller, ref)
        return rec.id, await self.sandboxes.session_state(rec)

    async def restart_session(self, caller: Caller, ref: str, state_json: str) -> tuple[str, SessionState | None]:
        command_requests.check_session_state(self.cfg.limits, state_json)  # before touching anything
        rec = await self.access.lookup(caller, ref)
        await self.flow.before_action(rec)
        return rec.id, await self.commands.restart_session(rec, state_json)
