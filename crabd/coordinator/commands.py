"""Commands and turns of a sandbox: one-shot exec, the persistent session, begin/end turn.

Every command is spawned by crab's init inside the sandbox (never ``docker
exec``; see ``runner.py``) and recorded in the sandbox's current turn.  A
command outside ``begin_turn``/``end_turn`` opens an *implicit* turn, which
the next ``begin_turn`` ends.  At a turn end the session's semantic state is
captured and stored with the turn.
"""

from __future__ import annotations

import logging
import time

from crabd.coordinator import named_capture
from crabd.coordinator.oneshot import ChunkSink, run_exec
from crabd.coordinator.runner import Session, SessionFoundDead
from crabd.coordinator.sandboxes import SandboxManager, env_dict
from crabd.coordinator.sessions import NamedSessions
from crabd.coordinator.turns import check_session_state
from crabd.errors import CrabError, InitUnavailable, InvalidRequest
from crabd.models import ExecOutcome, SandboxRecord, TurnRecord
from crabd.runtime import session_state
from crabd.runtime.initproto import SpawnSpec
from crabd.runtime.session_state import SessionState

log = logging.getLogger("crabd.commands")


class Commands:
    def __init__(self, sandboxes: SandboxManager) -> None:
        self.sandboxes = sandboxes
        self.sessions = NamedSessions(sandboxes)

    async def exec(
        self,
        rec: SandboxRecord,
        argv: list[str],
        *,
        env: dict[str, str],
        workdir: str,
        stdin: bytes,
        timeout_s: float,
        max_output: int,
        uid: int | None,
        gid: int | None,
        sink: ChunkSink | None,
    ) -> ExecOutcome:
        st = await self.sandboxes.running(rec)
        full_env = env_dict(st.env)
        full_env.update(env)
        spec = SpawnSpec(
            argv=list(argv), env=full_env, cwd=workdir or rec.spec.workdir, uid=uid, gid=gid, stdin_null=not stdin
        )
        turn = self.sandboxes.turns.ensure_open(rec.id)
        started_wall = time.time()
        async with self.sandboxes.init_lost_means_dead(rec):
            outcome = await run_exec(
                self.sandboxes.connector(rec, st.pid),
                spec,
                stdin=stdin,
                timeout_s=timeout_s,
                max_output=max_output,
                sink=sink,
            )
        return self.sandboxes.turns.record(rec.id, turn, "exec", " ".join(argv), outcome, started_wall)

    async def session_run(
        self,
        rec: SandboxRecord,
        command: str,
        *,
        timeout_s: float,
        max_output: int,
        sink: ChunkSink | None,
        session_name: str = "",
    ) -> ExecOutcome:
        """Run ``command`` in a session ("": the default one; a named one is opened if it does not exist)."""
        session = await self.sessions.get(rec, session_name)
        turn = self.sandboxes.turns.ensure_open(rec.id)
        started_wall = time.time()
        async with self.sandboxes.init_lost_means_dead(rec):
            try:
                outcome = await session.run(command, timeout_s=timeout_s, max_output=max_output, sink=sink)
            except SessionFoundDead:
                # Killed from inside the sandbox between commands; the command never ran.
                log.warning(
                    "the session's bash had exited; reviving it", extra={"sandbox": rec.id, "session": session_name}
                )
                session = await self._revive(rec, session)
                try:
                    outcome = await session.run(command, timeout_s=timeout_s, max_output=max_output, sink=sink)
                except SessionFoundDead as exc:  # the fresh bash died at once too
                    raise InitUnavailable(f"the session could not be revived: {exc}", sandbox=rec.id) from exc
        if outcome.session_ended:
            await self._revive(rec, session)
        kind = "session" if not session_name else f"session:{session_name}"
        return self.sandboxes.turns.record(rec.id, turn, kind, command, outcome, started_wall)

    async def _revive(self, rec: SandboxRecord, session: Session) -> Session:
        """After a session's bash died: a fresh bash with the session's last captured state (a named one
        without a capture: the container's defaults)."""
        if not session.name:
            await self._revive_session(rec, session)
            return session
        self.sessions.forget_dead(rec, session.name)
        stored = self.sandboxes.registry.latest_session_state(rec.id)
        try:
            capture = SessionState.from_json(stored).named_captures().get(session.name) if stored else None
            if capture is not None:
                return await self.sessions.revive(rec, session.name, capture)
        except CrabError as exc:
            log.warning(
                "named session revival failed; it opens afresh",
                extra={"sandbox": rec.id, "session": session.name, "error": str(exc)},
            )
        return await self.sessions.get(rec, session.name)

    async def _revive_session(self, rec: SandboxRecord, session: Session) -> None:
        """After the session died (exit, timeout): a fresh bash with the last captured state."""
        stored = self.sandboxes.registry.latest_session_state(rec.id)
        state = session_state.SessionState.from_json(stored) if stored else None
        try:
            await session.restart(state)
        except CrabError as exc:
            log.warning("session revival failed", extra={"sandbox": rec.id, "error": str(exc)})

    async def restart_session(self, rec: SandboxRecord, state_json: str) -> SessionState | None:
        session = await self.sandboxes.session_for(rec)
        state = session_state.SessionState.from_json(state_json) if state_json else None
        await session.restart(state)
        return await session.capture_state()

    # --- turns -------------------------------------------------------------------

    async def end_turn(self, rec: SandboxRecord) -> TurnRecord:
        """Close the open turn and store the session's state (the checkpoint is ``turnflow``'s business)."""
        current = self.sandboxes.turns.current(rec.id)
        if current is None:
            raise InvalidRequest(
                f"sandbox {rec.name} has no open turn",
                hint=f"Begin one first: begin_turn() in the SDK, `crabctl turn begin {rec.name}` in a shell.",
            )
        session = await self.sandboxes.session_for(rec)
        if session.busy:
            # A command still runs in it (sessions run at the same time, and a turn is the sandbox's):
            # its bash is checkpointed as a process, mid-command; its state stays the last one captured.
            text = self.sandboxes.registry.latest_session_state(rec.id)
        else:
            async with self.sandboxes.init_lost_means_dead(rec):
                text = await session.capture_json()
        # Idle named sessions too (coordinator/named_capture.py): their bashes are then no processes to dump.
        text = named_capture.merged(text, await named_capture.capture(self.sandboxes, rec))
        limit = self.sandboxes.cfg.quota.max_session_state_bytes
        check_session_state(text, limit, uid=rec.owner_uid, sandbox=rec.name)
        return self.sandboxes.turns.end(rec.id, current.number, text)
