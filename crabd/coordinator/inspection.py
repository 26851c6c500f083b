"""Turn ends under the "auto" policy: ask the inspector, take what it calls for, record why.

The inspector (``crabd/inspector``) keeps, per sandbox, a *baseline*: the
process state its head checkpoint stands for.  This module keeps that
baseline in step with the sandbox's life:

* a new, restored, forked or recovered container is :meth:`watch` -ed as
  soon as it runs (its processes are then what its checkpoint's image holds);
* a checkpoint's publication moves the baseline (``Checkpointer`` calls the
  inspector's ``at_dump``/``published`` hooks itself, inside the freeze);
* after a crabd restart the baseline is unknown, so the first decision of an
  adopted sandbox is conservative (:meth:`adopted`).

At a turn end :meth:`plan` asks for a decision, and :meth:`execute` (run
later by the host engine, see ``turnflow.py``) takes the checkpoint it
names: none (skip), a filesystem delta (fs), or a CRIU dump plus a delta
(full).  An fs decision while live processes are unchanged since the head's
process image *pairs* the new checkpoint with that image, so a restore still
brings the processes back; the pairing is re-checked inside the checkpoint's
freeze, and if a process ran in between, the checkpoint is taken full.
Every decision is stored with its turn (``crabctl inspect``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from crabd.backends.fsdelta import FsDelta, Tree
from crabd.coordinator.checkpoints import Checkpointer
from crabd.coordinator.sandboxes import SandboxManager
from crabd.errors import CrabError, StalePairing
from crabd.inspector.decide import Inspector, TurnEnd
from crabd.inspector.model import FS, FULL, SKIP, Decision
from crabd.models import CheckpointKind, CheckpointPolicy, CheckpointRecord, DecisionKind, SandboxRecord, SandboxState
from crabd.runtime import session_os
from crabd.store.catalog import Catalog

log = logging.getLogger("crabd.inspector")

#: A decision right after the turn end's session capture takes the bash pid that capture saw.
CAPTURED_PID_S = 1.0


@dataclass(frozen=True)
class Plan:
    """What one turn end needs: ``kind`` skip, fs or full; ``decision`` under the "auto" policy.

    ``basis``: the head checkpoint the decision compared the sandbox with; for
    a skip, the checkpoint whose state the turn ended in (recorded with the
    turn, so that its number keeps naming that state after the head moves).
    """

    kind: DecisionKind
    decision: Decision | None
    basis: str | None = None


def _keep_session_descriptors(d: Decision, session_json: str | None, head_session_json: str | None) -> None:
    """A turn end whose session bash holds descriptors a files-only checkpoint would lose is taken full.

    A files-only checkpoint restores the session as a fresh bash with its
    semantic state re-applied, and descriptors cannot be re-created exactly
    from outside the process: a re-opened file has another offset (and
    ``>`` would truncate it), and a pipe, socket or eventfd cannot be
    re-opened at all.  CRIU's image holds the bash exactly, offsets and
    peers included, and sessions holding descriptors are rare (``exec
    7>file``), so this is both exact and cheap.  Resource limits need no
    process image: a restore re-applies them exactly (``runtime/session_os.py``).

    What each decision would restore the session's descriptors from:
    an fs checkpoint without pairing, a fresh bash (none beyond 0-2), so it
    is taken full if the session holds any; a paired one, the head image's
    bash, and a skip, the head itself, so either is taken full if they
    differ from the head's.
    """
    if d.kind == FULL:
        return
    if d.kind == FS and not d.paired_with:
        held = session_os.held_descriptors(session_json)
        change = "the session holds open descriptors (fd " + ", ".join(map(str, held[:8])) + ")" if held else ""
    else:
        change = session_os.descriptors_changed(session_json, head_session_json)
    if change:
        d.kind = FULL
        d.paired_with = d.paired_image = None
        d.reasons.append(f"{change}: only a process checkpoint brings them back")


class TurnInspection:
    def __init__(
        self, inspector: Inspector, checkpointer: Checkpointer, sandboxes: SandboxManager, catalog: Catalog, fs: FsDelta
    ) -> None:
        self.inspector = inspector
        self.ck = checkpointer
        self.sandboxes = sandboxes
        self.catalog = catalog
        self.fs = fs
        # Decoded head indexes and session states, by blob: the head rarely
        # changes between two turn ends, and decoding a big index costs more
        # than the whole decision otherwise.
        self._trees: dict[str, tuple[str, Tree]] = {}
        self._sessions: dict[str, tuple[str, str | None]] = {}

    @property
    def name(self) -> str:
        return self.inspector.name

    @property
    def why(self) -> str:
        return self.inspector.why

    @property
    def pending(self) -> bool:
        return self.inspector.pending

    def process_reads(self) -> dict[str, int]:
        """Turn ends that read the sandbox's processes from /proc, and those the probes vouched for."""
        return self.inspector.vouched.snapshot()

    def prometheus(self) -> str:
        return self.inspector.vouched.prometheus()

    # --- the sandbox's life ------------------------------------------------------------

    async def watch(
        self, rec: SandboxRecord, ckpt: CheckpointRecord | None, named: frozenset[int] = frozenset()
    ) -> None:
        """``rec``'s container was just started from ``ckpt`` (None: from its image, nothing restored);
        ``named``: the pids of its named sessions' bashes whose state that checkpoint holds."""
        try:
            st = await self.sandboxes.running(rec)
            session_pids = await self.sandboxes.session_pids(rec, st, named=named)
            await asyncio.to_thread(
                self.inspector.started,
                rec.id,
                rec.container_id,
                st.pid,
                session_pids,
                ckpt.process_blob if ckpt else None,
                ckpt.id if ckpt else None,
                restored=ckpt is not None,
                owner=str(rec.owner_uid),
            )
        except CrabError as exc:
            # Without a baseline the next decision is conservative (never skip).
            log.warning("inspector could not watch sandbox", extra={"sandbox": rec.id, "error": str(exc)})
            self.inspector.forget(rec.id)

    async def adopted(self, rec: SandboxRecord) -> None:
        """A sandbox crabd found running at start-up: events count from now, the baseline is unknown."""
        if rec.state is not SandboxState.RUNNING or not rec.container_id:
            return
        try:
            await asyncio.to_thread(self.inspector.adopt, rec.id, rec.container_id)
        except CrabError as exc:
            log.warning("inspector could not watch adopted sandbox", extra={"sandbox": rec.id, "error": str(exc)})

    async def baseline_complete(self, sandbox_id: str) -> None:
        """Until the baseline's pending job is done (inspector/digests.py): a start's memory digests, a
        full checkpoint's settling.

        Before the sandbox's next action: a command could otherwise change an
        idle process's memory before its digest is read (a short-lived process
        writing it with ``process_vm_writev``), and the digest would vouch for
        the changed memory.
        """
        if self.inspector.baseline_pending(sandbox_id):
            await asyncio.to_thread(self.inspector.wait_baseline, sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        self.inspector.forget(sandbox_id)
        self._trees.pop(sandbox_id, None)
        self._sessions.pop(sandbox_id, None)

    # --- deciding ------------------------------------------------------------------------

    def _head_tree(self, sandbox_id: str, index_blob: str) -> Tree:
        cached = self._trees.get(sandbox_id)
        if cached is not None and cached[0] == index_blob:
            return cached[1]
        tree = self.fs.load(index_blob)
        self._trees[sandbox_id] = (index_blob, tree)
        return tree

    def _head_session(self, sandbox_id: str, ckpt: CheckpointRecord) -> str | None:
        cached = self._sessions.get(sandbox_id)
        if cached is not None and cached[0] == ckpt.id:
            return cached[1]
        text = self.ck.session_json(ckpt)
        self._sessions[sandbox_id] = (ckpt.id, text)
        return text

    async def decide(self, rec: SandboxRecord, session_json: str | None) -> Decision:
        """What the sandbox's state now needs, compared with its head checkpoint."""
        return (await self._decide(rec, session_json))[0]

    async def _decide(self, rec: SandboxRecord, session_json: str | None) -> tuple[Decision, str | None]:
        """:meth:`decide`, and the id of the head checkpoint it compared with."""
        st = await self.sandboxes.running(rec)
        session_pids = await self.sandboxes.session_pids(
            rec, st, captured_within_s=CAPTURED_PID_S, session_json=session_json
        )
        upper = Path(st.upper_dir or await asyncio.to_thread(self.sandboxes.backend.upper_dir, rec.container_id))

        def go() -> tuple[Decision, str | None]:
            # Read under the op lock: no restore or checkpoint moves the head while it is compared with.
            head = self.catalog.head(rec.id)
            tree = self._head_tree(rec.id, head.index_blob) if head else None
            head_session = self._head_session(rec.id, head.checkpoint) if head and head.checkpoint else None
            d = self.inspector.decide(
                TurnEnd(
                    sandbox_id=rec.id,
                    container_id=rec.container_id,
                    init_host_pid=st.pid,
                    upper=upper,
                    lowers=[Path(p) for p in st.lower_dirs],
                    head_tree=tree,
                    head_racy_ns=head.racy_ns if head else 0,
                    head_checkpoint=head.checkpoint.id if head and head.checkpoint else None,
                    session_pids=session_pids,
                    session_json=session_json,
                    head_session_json=head_session,
                )
            )
            _keep_session_descriptors(d, session_json, head_session)
            return d, head.checkpoint.id if head and head.checkpoint else None

        async with self.sandboxes.op_lock(rec.id):
            return await asyncio.to_thread(go)

    async def _take(
        self,
        rec: SandboxRecord,
        d: Decision,
        *,
        turn: int | None,
        label: str,
        session_json: str | None,
        on_phase: Callable[[str], None] | None = None,
    ) -> CheckpointRecord:
        capture = session_json is None
        if d.kind == FS and d.paired_image and d.paired_with:
            try:
                return await self.ck.take(
                    rec,
                    kind=CheckpointKind.FS,
                    turn=turn,
                    label=label,
                    session_json=session_json,
                    capture_session=capture,
                    pair=(d.paired_with, d.paired_image),
                    on_phase=on_phase,
                )
            except StalePairing as exc:
                d.reasons.append(f"then {exc.message}: took a full checkpoint instead")
                d.kind = FULL
        return await self.ck.take(
            rec,
            kind=d.kind.checkpoint_kind(),
            turn=turn,
            label=label,
            session_json=session_json,
            capture_session=capture,
            on_phase=on_phase,
        )

    async def plan(self, rec: SandboxRecord, turn: int, session_json: str | None) -> Plan | None:
        """What a turn end needs under the sandbox's policy (None: policy "none", nothing ever).

        Under "auto" this asks the inspector now, at the turn end, and
        records its decision with the turn; the checkpoint itself is taken
        later by :meth:`execute` (the host engine runs it).
        """
        policy = rec.spec.checkpoints
        if policy is CheckpointPolicy.NONE:
            return None
        if policy is not CheckpointPolicy.AUTO:
            return Plan(FULL if policy is CheckpointPolicy.FULL else FS, None)
        d, basis = await self._decide(rec, session_json)
        # Group-committed (store/db.py): written on the event loop, a thread hop cost more than the write.
        self.sandboxes.registry.set_decision(rec.id, turn, d.to_json(), None)
        # Skips are the common case (every read-only turn of every sandbox): at DEBUG, so that a
        # host with a thousand sandboxes does not write a log line per skip (`crabctl inspect SB` has them).
        log.log(
            logging.DEBUG if d.kind == SKIP else logging.INFO,
            "turn decided",
            extra={
                "sandbox": rec.id,
                "turn": turn,
                "decision": d.kind,
                "inspector": d.inspector,
                "decide_ms": round(d.seconds * 1000, 2),
                "reasons": d.reasons[:4],
            },
        )
        return Plan(d.kind, d, basis)

    async def execute(
        self,
        rec: SandboxRecord,
        plan: Plan,
        *,
        turn: int,
        session_json: str | None,
        on_phase: Callable[[str], None] | None = None,
    ) -> CheckpointRecord | None:
        """Take the checkpoint ``plan`` calls for (None for skip), and record it with the turn."""
        if plan.kind == SKIP:
            return None
        d = plan.decision
        if d is None:
            return await self.ck.take(
                rec,
                kind=plan.kind.checkpoint_kind(),
                turn=turn,
                session_json=session_json,
                capture_session=False,
                on_phase=on_phase,
            )
        ckpt = None
        try:
            ckpt = await self._take(rec, d, turn=turn, label="", session_json=session_json, on_phase=on_phase)
        finally:
            # The decision may have changed on the way (a stale pairing is taken full).
            self.sandboxes.registry.set_decision(rec.id, turn, d.to_json(), ckpt.id if ckpt else None)
        return ckpt

    async def checkpoint(self, rec: SandboxRecord, *, kind: CheckpointKind | None, label: str) -> CheckpointRecord:
        """An explicit checkpoint.  Without a kind, under "auto", the inspector picks fs or full."""
        if kind is not None or rec.spec.checkpoints is not CheckpointPolicy.AUTO:
            return await self.ck.take(rec, kind=kind, label=label)
        d = await self.decide(rec, None)
        if d.kind == SKIP:
            d.kind = FS  # asked for: a new checkpoint of unchanged files costs next to nothing
        return await self._take(rec, d, turn=None, label=label, session_json=None)
