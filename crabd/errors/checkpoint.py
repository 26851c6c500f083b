"""Errors of taking and restoring checkpoints: process dumps (the CRIU domain), the host's
checkpoint engine, and the provenance a process image is restored under."""

from __future__ import annotations

from crabd.errors.base import CrabError


class DumpError(CrabError):
    """A process dump or restore failed: the parent of the CRIU domain (catch it for "any dump trouble")."""

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "No checkpoint was made and the sandbox keeps running; `crabctl doctor` checks the CRIU install."


class CriuError(DumpError):
    """CRIU ran and refused.  Attributes: ``log_path`` (the kept log, None if there was none) and ``log_excerpt``."""

    default_hint = "Read the CRIU log named above; `crabctl doctor` checks the CRIU install."

    def __init__(self, message: str, *, log_path: str | None, log_excerpt: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.log_path = log_path
        self.log_excerpt = log_excerpt


class CriuImageInvalid(DumpError):
    """A CRIU image file does not parse (or is not the image crab expected).  Attribute: ``path``."""

    default_hint = (
        "The dump is unusable and no checkpoint was made; the sandbox keeps running. "
        "Check that crab's CRIU is the version `crabctl doctor` expects."
    )

    def __init__(self, message: str, *, path: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


class IncompleteDump(DumpError):
    """A process dump would leave out processes of the sandbox.  Attribute: ``pids`` (inside the sandbox)."""

    default_hint = (
        "Start long-lived processes from the sandbox's session or with crab's exec (never `docker exec`), "
        "so they descend from the sandbox's init."
    )

    def __init__(self, message: str, *, pids: list[int], hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.pids = pids


class PostureViolation(DumpError):
    """A process image would restore a process holding more than its sandbox grants; nothing was restored.

    Attributes: ``checkpoint``, ``pid`` (inside the sandbox), ``what`` (the
    credential, namespace or mount judged), ``found`` and ``expected``.
    """

    grpc_code = "PERMISSION_DENIED"
    default_hint = (
        "The checkpoint's process image was altered (or made elsewhere): restore another checkpoint, "
        "or fork this one as files only (kind fs). The sandbox keeps running as it was."
    )

    def __init__(
        self, message: str, *, checkpoint: str, pid: int, what: str, found: str, expected: str, hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.checkpoint = checkpoint
        self.pid = pid
        self.what = what
        self.found = found
        self.expected = expected


class StalePairing(CrabError):
    """A filesystem checkpoint was to reuse the head's process image, but a process ran since the decision.

    Internal: the turn end then takes a full checkpoint instead.  Attribute: ``sandbox``.
    """

    grpc_code = "ABORTED"
    default_hint = "Take a full checkpoint (`crabctl checkpoint create --full SB`)."

    def __init__(self, message: str, *, sandbox: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox


class EngineStopped(CrabError):
    """crabd stopped before a queued checkpoint was taken; that turn has no checkpoint."""

    grpc_code = "UNAVAILABLE"
    default_hint = "Restart crabd; the turn's state is in the next checkpoint (or restore to an earlier turn)."


class CheckpointFailed(CrabError):
    """A turn end's checkpoint failed in the background.  Attributes: ``sandbox``, ``turn``, ``cause`` (error kind)."""

    grpc_code = "ABORTED"
    default_hint = "See `crabctl checkpoint failures SB`; the next turn end checkpoints again."

    def __init__(self, message: str, *, sandbox: str, turn: int, cause: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox
        self.turn = turn
        self.cause = cause


class ProvenanceRefused(CrabError):
    """A checkpoint's process image may not be restored: its provenance does not verify under a
    key this host trusts (``crabd/trust/provenance.py``); nothing was restored or changed.

    Attributes: ``checkpoint`` and ``reason`` (why its provenance does not verify).
    """

    grpc_code = "FAILED_PRECONDITION"
    default_hint = (
        "Process images are restored only from checkpoints a trusted host produced; fork or restore a"
        " files-only checkpoint, or ask root to add the producing host's key to <state_dir>/trust/trusted/."
    )

    def __init__(self, message: str, *, checkpoint: str, reason: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.checkpoint = checkpoint
        self.reason = reason
