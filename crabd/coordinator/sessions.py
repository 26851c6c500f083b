"""Named sessions of a sandbox: open, find, list and close them.

A sandbox has its default session (``name`` "", started on first use, as
always) and any number of named ones (``[quota] max_sessions``), each its
own bash, a persistent child of crab's init named ``crab-session:NAME``
(``runner.init_name``).  Init's table is the truth about which exist: it
survives crabd restarts, and a restore or fork from a process image brings
it back with the bashes themselves (CRIU restores init and its children).
The :class:`~crabd.coordinator.runner.Session` objects here are crabd's
handles on them, made again when missing (after a restart of crabd, or
when a restore replaced the container).

How named sessions are checkpointed: an idle one whose bash crabd started
has its semantic state captured at turn ends, like the default session, and
is then no process to the inspector; a busy one, or one found running,
stays a process of the process image (``named_capture.py``).  A named
session whose bash died (a timeout) comes back with its last capture.
"""

from __future__ import annotations

import logging

from crabd.coordinator.oneshot import Connector
from crabd.coordinator.runner import NAMED_PREFIX, SESSION_NAME, Session, init_name
from crabd.coordinator.sandboxes import SandboxManager, env_dict
from crabd.errors import InvalidRequest, QuotaExceeded
from crabd.models import SandboxRecord, SessionInfo
from crabd.runtime.session_state import NamedCapture

log = logging.getLogger("crabd.sessions")


class NamedSessions:
    """The sandboxes' named sessions (the default one stays ``SandboxManager.session_for``'s)."""

    def __init__(self, sandboxes: SandboxManager) -> None:
        self.sandboxes = sandboxes

    async def open(
        self,
        rec: SandboxRecord,
        name: str,
        *,
        env: dict[str, str] | None,
        inherit_env: bool,
        workdir: str,
        uid: int | None,
        gid: int | None,
        pty: tuple[int, int] | None = None,
    ) -> SessionInfo:
        """Start session ``name``'s bash: the container's environment (``inherit_env``) or none, plus ``env``;
        its output a pseudo-terminal of ``pty`` (rows, columns) or two pipes.

        Refused if it exists already, or if the sandbox has ``max_sessions`` of them.
        """
        listed = await self.list(rec)
        if any(s.name == name for s in listed):
            raise InvalidRequest(
                f"sandbox {rec.name} already has a session named {name!r}",
                hint="Use it (session(name).run(...)), or close it first.",
            )
        limit = self.sandboxes.cfg.quota.max_sessions
        used = sum(1 for s in listed if s.name)
        if used >= limit:
            raise QuotaExceeded(
                f"sandbox {rec.name} has {used} named sessions, the most one sandbox may have ([quota] max_sessions)",
                uid=rec.owner_uid,
                quota="max_sessions",
                limit=limit,
                used=used,
                requested=1,
                hint="Close a session you no longer need.",
            )
        st = await self.sandboxes.running(rec)
        base = env_dict(st.env) if inherit_env else {}
        base.update(env or {})
        session = self._make(rec, st.pid, name, base, workdir or rec.spec.workdir, uid, gid, pty)
        pid = await session.start()
        self.sandboxes.named_sessions(rec)[name] = session
        log.info("session opened", extra={"sandbox": rec.id, "session": name})
        return SessionInfo(name, pid, False, pty)

    async def get(self, rec: SandboxRecord, name: str) -> Session:
        """Session ``name``'s handle; opened with the defaults (container environment, root) if it does not exist."""
        session = await self._handle(rec, name)
        named = self.sandboxes.named_sessions(rec)
        if not name or named.get(name) is session:
            return session
        # A handle made for a bash that already runs (crabd restarted; a restore or fork brought it
        # back) only ever attaches to it; if none runs, opening it starts one with the defaults.
        if await session.pid() is None:
            await self.open(rec, name, env=None, inherit_env=True, workdir="", uid=None, gid=None)
            return named[name]
        return named.setdefault(name, session)

    async def list(self, rec: SandboxRecord) -> list[SessionInfo]:
        """The sessions whose bash runs, the default one first, by init's table."""
        default = await self.sandboxes.session_for(rec)
        busy = set(self.sandboxes.busy_sessions(rec.id))
        out: list[SessionInfo] = []
        for p in await default.processes():
            if not p.alive:
                continue
            if p.name == SESSION_NAME:
                out.insert(0, SessionInfo("", p.pid, "" in busy, p.pty))
            elif p.name.startswith(NAMED_PREFIX):
                name = p.name[len(NAMED_PREFIX) :]
                out.append(SessionInfo(name, p.pid, name in busy, p.pty))
        return out

    async def close(self, rec: SandboxRecord, name: str) -> None:
        """End session ``name``: its bash is killed (refused while it runs a command)."""
        session = await self._handle(rec, name)
        if not await session.close():
            raise InvalidRequest(f"sandbox {rec.name} has no session named {name!r}")
        if name:
            self.sandboxes.named_sessions(rec).pop(name, None)
        log.info("session closed", extra={"sandbox": rec.id, "session": name})

    async def revive(self, rec: SandboxRecord, name: str, capture: NamedCapture) -> Session:
        """Session ``name`` started afresh as ``capture`` recorded it (user, terminal) with its state applied."""
        st = await self.sandboxes.running(rec)
        uid, gid = capture.uid, capture.gid
        session = self._make(rec, st.pid, name, env_dict(st.env), rec.spec.workdir, uid, gid, capture.pty)
        await session.restart(capture.state)
        self.sandboxes.named_sessions(rec)[name] = session
        log.info("session revived from its capture", extra={"sandbox": rec.id, "session": name})
        return session

    def forget_dead(self, rec: SandboxRecord, name: str) -> None:
        """A named session's bash ended (exit, timeout): drop its handle; the next command opens a fresh one."""
        if name:
            self.sandboxes.named_sessions(rec).pop(name, None)

    async def _handle(self, rec: SandboxRecord, name: str) -> Session:
        """Session ``name``'s handle: the one met before, or a new one (its bash may or may not run)."""
        default = await self.sandboxes.session_for(rec)  # rebinds every session if the container was restarted
        if not name:
            return default
        known = self.sandboxes.named_sessions(rec).get(name)
        if known is not None:
            return known
        st = await self.sandboxes.running(rec)
        # How a bash found running was started is not known here: it is checkpointed as a process.
        return self._make(rec, st.pid, name, env_dict(st.env), rec.spec.workdir, None, None, known=False)

    def _make(
        self,
        rec: SandboxRecord,
        pid: int,
        name: str,
        env: dict[str, str],
        workdir: str,
        uid: int | None,
        gid: int | None,
        pty: tuple[int, int] | None = None,
        *,
        known: bool = True,
    ) -> Session:
        session = named_handle(
            self.sandboxes,
            rec,
            rec.container_id,
            self.sandboxes.connector(rec, pid),
            name,
            env,
            workdir,
            uid=uid,
            gid=gid,
            pty=pty,
            known=known,
        )
        session.yielding = self.sandboxes.dump_yield(rec)
        return session


def named_handle(
    sandboxes: SandboxManager,
    rec: SandboxRecord,
    container_id: str,
    connect: Connector,
    name: str,
    env: dict[str, str],
    workdir: str,
    *,
    uid: int | None = None,
    gid: int | None = None,
    pty: tuple[int, int] | None = None,
    known: bool = True,
) -> Session:
    """crabd's handle on named session ``name`` of ``rec``'s container ``container_id`` (a restore makes them
    for the new container before it becomes the sandbox's), its bash started as the arguments say."""
    assert init_name(name) != SESSION_NAME
    session = Session(
        connect,
        env,
        workdir,
        sandboxes.capture_counts,
        name=name,
        uid=uid,
        gid=gid,
        pty=pty,
        spawn_known=known,
    )
    session.probe = sandboxes.session_probe(container_id, rec.id)
    return session
