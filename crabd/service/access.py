"""Who may act on which sandbox: a request's sandbox reference, resolved for its caller.

The rules (the service layer's, ``service.py``):

* a sandbox belongs to the uid that created it;
* root (uid 0) sees and may act on every sandbox;
* any other caller sees only its own sandboxes; acting on someone else's
  gets PERMISSION_DENIED (its existence is not hidden from a direct lookup,
  but it never appears in that caller's listing).

With several crabd processes (``[daemon] workers``) a sandbox is served by
the one its row names: another answers WrongShard with that one's socket,
after the checks above, and does nothing else.

A sandbox is named by its id, its name, or a unique prefix of the id of
one of the caller's own sandboxes (``refs.py``).  A checkpoint's reader is
checked where checkpoints are found, local or remote
(``remote.readable_checkpoint``).
"""

from __future__ import annotations

from crabd.coordinator.sandboxes import SandboxManager
from crabd.errors import InvalidRequest, PermissionDenied, SandboxNotFound, WrongShard
from crabd.models import Caller, SandboxRecord
from crabd.service import refs


class Access:
    """The gate every request's sandbox goes through (owned by :class:`~crabd.service.service.Service`)."""

    def __init__(self, sandboxes: SandboxManager) -> None:
        self.sandboxes = sandboxes

    def authorize(self, caller: Caller, ref: str) -> str:
        """The id of the sandbox ``ref`` names, if ``caller`` may act on it (else NotFound / PermissionDenied).

        Not waiting for its adoption after a restart (the owner never changes):
        what then acts on the sandbox looks it up through the gate.
        """
        rec = self.sandboxes.row(ref) if ref else None
        if rec is None and ref:
            full = self._sandbox_prefix(caller, ref)
            rec = self.sandboxes.row(full) if full else None
        return self._allowed(caller, ref, rec).id

    async def lookup(self, caller: Caller, ref: str) -> SandboxRecord:
        """The sandbox ``ref`` names (its id, name, or a unique prefix of the id of one of the caller's),
        adopted (``SandboxManager.get``), if ``caller`` may act on it."""
        rec = await self.sandboxes.get(ref) if ref else None
        if rec is None and ref:
            full = self._sandbox_prefix(caller, ref)
            rec = await self.sandboxes.get(full) if full else None
        return self._allowed(caller, ref, rec)

    def _sandbox_prefix(self, caller: Caller, ref: str) -> str | None:
        """The id of the caller's one sandbox whose id begins with ``ref`` (``refs``)."""
        if not refs.maybe_sandbox_prefix(ref):
            return None
        mine = self.sandboxes.sandbox_names(None if caller.is_root else caller.uid)
        return refs.unique(ref, mine, "sandbox", mine)

    def _allowed(self, caller: Caller, ref: str, rec: SandboxRecord | None) -> SandboxRecord:
        if not ref:
            raise InvalidRequest("no sandbox named in the request")
        if rec is None:
            raise SandboxNotFound(f"no sandbox {ref!r}", sandbox=ref)
        if not caller.is_root and rec.owner_uid != caller.uid:
            raise PermissionDenied(
                f"sandbox {ref!r} belongs to uid {rec.owner_uid}, not to you (uid {caller.uid})",
                uid=caller.uid,
                sandbox=ref,
            )
        place = self.sandboxes.place
        if rec.shard != place.index:
            # Only after the owner check: the redirect tells nothing a refusal would not.
            socket = place.sockets[rec.shard] if 0 <= rec.shard < place.count else ""
            raise WrongShard(
                f"sandbox {rec.name!r} is served by crabd's process {rec.shard} at {socket}, not by this one",
                sandbox=rec.id,
                shard=rec.shard,
                socket=socket,
            )
        return rec
