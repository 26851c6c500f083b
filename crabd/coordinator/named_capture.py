"""Named sessions' semantic state at a turn end, and bringing them back from it at a restore or fork.

A named session is captured like the default one (``runtime/session_state.py``,
"Named sessions") when it is idle at the turn end, crabd started its bash
(so it knows its user and terminal: ``Session.spawn_known``) and the bash
holds no descriptor beyond 0-2 (a descriptor cannot be re-created exactly
from outside: such a bash stays a process of the process image, as a busy
one does).  The inspector then leaves the bash out of the sandbox's
processes, so a turn in a named session costs a capture (a few ms) and,
when it changed no process, a files-only checkpoint, instead of a process
image.

At a restore or fork from a checkpoint whose process image is not of that
very moment (a files-only checkpoint, paired with an older image or with
none), each captured session is brought back from its capture
(:func:`bring_back`): a bash of that name the image brought back gets the
state applied in place (its jobs live on), a missing one is started afresh
with it, and a bash the image holds that was captured then but is not in
this checkpoint's capture (closed since) is ended.  What could not be
given back is listed in ``not_restored``.
"""

from __future__ import annotations

import asyncio
import logging

from crabd.backends.sandbox import ContainerStatus
from crabd.coordinator.oneshot import Connector
from crabd.coordinator.runner import NAMED_PREFIX, Session
from crabd.coordinator.sandboxes import SandboxManager, env_dict
from crabd.coordinator.sessions import named_handle
from crabd.errors import CrabError, SessionProcessError
from crabd.models import SandboxRecord
from crabd.runtime import session_os
from crabd.runtime.session_state import NamedCapture, SessionState

log = logging.getLogger("crabd.sessions")

#: How long one named session's capture may take at a turn end; a slower one stays a process.
CAPTURE_TIMEOUT_S = 5.0
#: How recent the pid a capture saw must be to be recorded with it.
CAPTURED_PID_S = 60.0


async def capture(sandboxes: SandboxManager, rec: SandboxRecord) -> dict[str, NamedCapture]:
    """The named sessions that may be captured now (the module's docstring), captured at once."""
    handles = [s for s in sandboxes.named_sessions(rec).values() if s.spawn_known and not s.busy]
    if not handles:
        return {}
    got = await asyncio.gather(*(_capture_one(s, rec.id) for s in handles))
    return {c[0]: c[1] for c in got if c is not None}


async def _capture_one(session: Session, sandbox_id: str) -> tuple[str, NamedCapture] | None:
    if session.busy:  # a command began since the list was made
        return None
    try:
        state = await session.capture_state(timeout_s=CAPTURE_TIMEOUT_S)
    except (CrabError, TimeoutError) as exc:
        log.warning(
            "named session not captured; it is checkpointed as a process",
            extra={"sandbox": sandbox_id, "session": session.name, "error": str(exc)},
        )
        return None
    seen = session.captured_pid(CAPTURED_PID_S)
    if state is None or state.fds is None or state.fds or seen is None or seen[0] is None:
        return None
    uid, gid = session.user
    return session.name, NamedCapture(state, seen[0], session.pty, uid, gid)


def merged(text: str | None, captures: dict[str, NamedCapture]) -> str | None:
    """``text`` (the default session's stored state) with ``captures`` as its named sessions."""
    if text is None:
        return None
    if not captures and '"named"' not in text:
        return text  # the common case, without parsing the state
    return SessionState.from_json(text).with_named(captures).to_json()


async def bring_back(
    sandboxes: SandboxManager,
    rec: SandboxRecord,
    container_id: str,
    st: ContainerStatus,
    connect: Connector,
    session_json: str | None,
    *,
    image_exact: bool,
    image_named: frozenset[str],
) -> tuple[dict[str, Session], frozenset[int], list[str]]:
    """The captured named sessions of a just-started container: handles on them, their bashes' pids, and
    what could not be given back.

    ``image_exact``: the container's process image is of the checkpoint's own
    moment (a full checkpoint), so it holds each captured bash as it was:
    only handles are made.  Else each is brought back from its capture;
    ``image_named``: the named sessions the image's own checkpoint captured
    (those of them not captured now were closed since: they are ended).
    """
    captures = SessionState.from_json(session_json).named_captures() if session_json else {}
    if not captures and image_exact:
        return {}, frozenset(), []
    async with await connect() as conn:
        listed = await conn.list()
    alive = {p.name[len(NAMED_PREFIX) :]: p.pid for p in listed if p.alive and p.name.startswith(NAMED_PREFIX)}
    if image_exact:
        # The image holds each captured bash under its pid; one that is not there as recorded (a stored
        # state is input) stays what the image says it is: a process the inspector counts.
        held = {name: c for name, c in captures.items() if alive.get(name) == c.pid}
        handles = {name: _handle(sandboxes, rec, container_id, st, connect, name, c) for name, c in held.items()}
        return handles, frozenset(c.pid for c in held.values()), []
    handles = {name: _handle(sandboxes, rec, container_id, st, connect, name, c) for name, c in captures.items()}
    for name in sorted(set(alive) - set(captures)):
        if name in image_named:
            await _handle(sandboxes, rec, container_id, st, connect, name, None).close()
    lost: list[str] = []
    pids: set[int] = set()
    for name, c in captures.items():
        session = handles[name]
        try:
            if name in alive:
                await session.apply(c.state)
            else:
                await session.restart(c.state)
            nspid = await session.pid()
            if nspid is None:
                raise SessionProcessError(f"session {name!r}'s bash did not start", sandbox=rec.id)
            pids.add(nspid)
            if c.state.limits is not None:
                diffs = await asyncio.to_thread(session_os.restore, container_id, nspid, c.state.limits, [])
                lost += [f"session {name!r}: {d}" for d in diffs]
        except CrabError as exc:
            handles.pop(name)
            lost.append(f"session {name!r}: {exc.message}")
    return handles, frozenset(pids), lost


def _handle(
    sandboxes: SandboxManager,
    rec: SandboxRecord,
    container_id: str,
    st: ContainerStatus,
    connect: Connector,
    name: str,
    c: NamedCapture | None,
) -> Session:
    """A handle on named session ``name`` of the new container, started as ``c`` says (None: only to end it)."""
    env, workdir = env_dict(st.env), rec.spec.workdir
    if c is None:
        return named_handle(sandboxes, rec, container_id, connect, name, env, workdir, known=False)
    return named_handle(sandboxes, rec, container_id, connect, name, env, workdir, uid=c.uid, gid=c.gid, pty=c.pty)
