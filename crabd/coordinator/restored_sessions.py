"""A restored or forked container's sessions, brought back as its checkpoint holds them.

Step 4 of a restore or fork (``coordinator/restore.py``): once the new
container's init answers, its default session is started with the
checkpoint's session state re-applied, then its named sessions are brought
back from their captures (``coordinator/named_capture.py``).  What could not
be given back (resource limits or descriptors that differ, a named session
that did not start) is listed in ``not_restored``, never dropped silently.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from crabd.backends.sandbox import ContainerStatus
from crabd.coordinator import named_capture
from crabd.coordinator.checkpoints import Checkpointer
from crabd.coordinator.runner import Session
from crabd.coordinator.sandboxes import SandboxManager, env_dict
from crabd.errors import SessionProcessError
from crabd.models import CheckpointKind, CheckpointRecord, SandboxRecord
from crabd.runtime import session_os
from crabd.runtime.initproto import InitConnection
from crabd.runtime.session_state import SessionState
from crabd.store.catalog import Catalog
from crabd.util.netns import Netns


@dataclass
class RestoredSessions:
    """A restored or forked container's sessions (:func:`bring_back`)."""

    default: Session
    #: Its named sessions whose state the checkpoint captured (the others: processes of its image).
    named: dict[str, Session]
    #: Their bashes' pids in the sandbox (the inspector leaves them out).
    named_pids: frozenset[int]
    not_restored: list[str]


def state_to_apply(ckpt: CheckpointRecord, session_json: str | None) -> str | None:
    """The session state to re-apply after the container started.

    A full checkpoint's image holds the session's bash itself.  An fs
    checkpoint paired with an older image (see coordinator/inspection.py)
    brings back that older bash, so its own session state is applied to
    it (replacing the bash would end the jobs it started).
    """
    return None if ckpt.process_blob and ckpt.kind is CheckpointKind.FULL else session_json


async def image_named(catalog: Catalog, ck: Checkpointer, ckpt: CheckpointRecord) -> frozenset[str]:
    """The named sessions captured by the checkpoint whose process image ``ckpt`` reuses, if ``ckpt`` is
    files-only with one (read once per restore or fork, for all its clones)."""
    if not ckpt.process_blob or ckpt.kind is CheckpointKind.FULL:
        return frozenset()

    def find() -> frozenset[str]:
        for c in reversed(catalog.lineage(ckpt.id)):
            if c.kind is CheckpointKind.FULL and c.process_blob == ckpt.process_blob:
                text = ck.session_json(c)
                return frozenset(SessionState.from_json(text).named) if text else frozenset()
        return frozenset()

    return await asyncio.to_thread(find)


async def bring_back(
    sandboxes: SandboxManager,
    rec: SandboxRecord,
    ckpt: CheckpointRecord,
    container_id: str,
    st: ContainerStatus,
    session_json: str | None,
    named_in_image: frozenset[str],
) -> RestoredSessions:
    """Every session of a just-started container brought back as ``ckpt`` holds them, and what they lack.

    The default one (:func:`fresh_session`), then the named ones whose
    state was captured (``coordinator/named_capture.py``; ``named_in_image``:
    :func:`image_named`).
    """
    session, lost = await fresh_session(
        sandboxes, rec, container_id, st, state_to_apply(ckpt, session_json), keep_bash=bool(ckpt.process_blob)
    )
    exact = bool(ckpt.process_blob) and ckpt.kind is CheckpointKind.FULL
    named, pids, named_lost = await named_capture.bring_back(
        sandboxes,
        rec,
        container_id,
        st,
        session.connector,
        session_json,
        image_exact=exact,
        image_named=named_in_image,
    )
    return RestoredSessions(session, named, pids, lost + named_lost)


async def fresh_session(
    sandboxes: SandboxManager,
    rec: SandboxRecord,
    container_id: str,
    st: ContainerStatus,
    state_json: str | None,
    *,
    keep_bash: bool,
) -> tuple[Session, list[str]]:
    """A session on a just-started container, with ``state_json`` re-applied; and what it lacks of it.

    ``keep_bash``: a process image brought the session's bash back; apply
    the state to it rather than replace it, so its background jobs live on.
    The bash's resource limits are set from the host, then its limits and
    descriptors are read back and compared with the state's: what differs
    is returned, for the caller to report (``runtime/session_os.py``).
    """

    async def connect() -> InitConnection:
        return await InitConnection.open(netns=Netns(st.pid, container_id))

    session = Session(connect, env_dict(st.env), rec.spec.workdir, sandboxes.capture_counts)
    session.probe = sandboxes.session_probe(container_id, rec.id)
    if not state_json:
        return session, []
    state = SessionState.from_json(state_json)
    if keep_bash:
        await session.apply(state)
    else:
        await session.restart(state)
    if state.limits is None and state.fds is None:
        return session, []  # a capture from before crab recorded them: nothing known to compare
    nspid = await session.pid()
    try:
        if nspid is None:
            raise SessionProcessError("the session's bash did not start", sandbox=rec.id)
        return session, await asyncio.to_thread(session_os.restore, container_id, nspid, state.limits, state.fds)
    except SessionProcessError as exc:
        return session, [f"the session's resource limits and open descriptors: {exc.message}"]
