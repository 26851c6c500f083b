"""Request builders shared by the sync and async clients.

Every value is checked here, with the daemon's own rules
(``crabd.util.validate``), before anything is sent: a NaN or infinite
timeout would otherwise turn into a gRPC deadline that expires before the
call leaves, and the caller would see ``DaemonUnavailable`` instead of
``InvalidRequest``.  The daemon checks everything again (and knows its
configured maxima); this is for clear errors, not for safety.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from crabd.api.v1 import crab_pb2 as pb
from crabd.config_file import DEFAULT_SOCKET, socket_path
from crabd.errors import CrabError, InvalidRequest
from crabd.util import validate
from crabd.vocabulary import CheckpointPolicy, RecoveryMode, RetentionPolicy, TurnEnd

if TYPE_CHECKING:
    from crabd.sdk.models import CheckpointFailure

#: Largest values of the wire's integer fields (protobuf raises a bare ValueError past them).
INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1

#: gRPC channel options: bounded messages, and no proxy for a unix socket.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 80 << 20),
    ("grpc.max_send_message_length", 80 << 20),
    ("grpc.enable_http_proxy", 0),
]


def default_socket() -> Path:
    """$CRAB_SOCKET, else the configured socket, else /run/crab/crabd.sock.

    The config file's ``[paths] socket`` is read without building crabd's
    whole configuration (pydantic): see :mod:`crabd.config_file`.
    """
    env = os.environ.get("CRAB_SOCKET")
    if env:
        return Path(env)
    try:
        return socket_path()
    except CrabError:
        return DEFAULT_SOCKET


def parse_memory(value: int | str | None) -> int:
    """Bytes from 123, "512m", "2g", "1.5GiB"."""
    if value is None:
        return 0
    if not isinstance(value, str):
        return validate.integer(value, "memory", maximum=INT64_MAX)
    text = value.strip().lower().removesuffix("ib").removesuffix("b")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    try:
        if text and text[-1] in units:
            number = float(text[:-1]) * units[text[-1]]
            if not math.isfinite(number):  # "infg", "nanm": float() takes them
                raise ValueError(text)
            return validate.integer(int(number), "memory", maximum=INT64_MAX)
        return validate.integer(int(text), "memory", maximum=INT64_MAX)
    except ValueError as exc:
        raise InvalidRequest(f"cannot parse memory size {value!r} (use e.g. 512m or 2g)") from exc


@dataclass(frozen=True)
class CreateOptions:
    """What a new sandbox is made of: ``Client.create``'s parameters, and crabctl create's flags.

    ``checkpoints="auto"`` (the default) checkpoints at creation and, at
    every turn end, what the inspector finds the turn needs (nothing, files,
    or processes and files); ``"fs"`` and ``"full"`` take that kind at every
    turn end; ``"none"`` only when asked.  ``recovery="auto"`` lets crabd
    recreate a dead sandbox from its latest checkpoint by itself.

    ``env`` names one of crab's env images (``crabctl env ls``); ``image``
    instead names any image the host's Docker has (``debian:12``,
    ``name@sha256:...``, an id), or the absolute path (a ``Path`` is made
    absolute) of a ``docker save`` archive or an OCI image layout that crabd
    loads once, reading it with the caller's permissions.  Give one of the two.
    """

    env: str = ""
    _: KW_ONLY
    image: str | os.PathLike[str] = ""
    name: str = ""
    cpus: float = 0.0
    memory: int | str | None = None
    pids: int = 0
    network: bool = False
    env_vars: Mapping[str, str] | None = None
    workdir: str = "/"
    # ``str``: a plain word is accepted too; crabd validates it once, at its edge.
    checkpoints: str = CheckpointPolicy.AUTO
    recovery: str = RecoveryMode.MANUAL
    #: Which checkpoints retention keeps (None: the daemon's ``[retention]`` default).
    retention: RetentionPolicy | None = None
    #: Disk limit (e.g. "2g"; runc+btrfs only; None: the daemon's ``[btrfs] sandbox_disk_bytes``).
    disk: int | str | None = None

    def request(self) -> pb.CreateSandboxRequest:
        """The wire request, every value checked."""
        image = os.path.abspath(self.image) if isinstance(self.image, os.PathLike) else self.image
        return pb.CreateSandboxRequest(
            env=self.env,
            image=validate.image_ref(image) if image else "",
            name=self.name,
            limits=pb.Limits(
                cpus=validate.fraction(self.cpus, "cpus"),
                memory_bytes=parse_memory(self.memory),
                pids=validate.integer(self.pids, "pids", maximum=INT64_MAX),
                disk_bytes=parse_memory(self.disk),
            ),
            network=self.network,
            env_vars=validate.env_vars(self.env_vars or {}),
            workdir=self.workdir,
            checkpoints=self.checkpoints,
            recovery=self.recovery,
            retention=retention_to_pb(self.retention) if self.retention is not None else None,
        )


def retention_to_pb(p: RetentionPolicy) -> pb.Retention:
    return pb.Retention(
        keep_last=p.keep_last, keep_hourly=p.keep_hourly, keep_daily=p.keep_daily, keep_within_s=p.keep_within_s
    )


def retention_request(sandbox: str, policy: RetentionPolicy | None) -> pb.SetRetentionRequest:
    """Set ``policy`` on ``sandbox`` (None: back to the daemon's default)."""
    if policy is None:
        return pb.SetRetentionRequest(sandbox=sandbox, use_default=True)
    return pb.SetRetentionRequest(sandbox=sandbox, retention=retention_to_pb(policy))


@dataclass(frozen=True)
class ExecOptions:
    """One program to run in a sandbox: ``Sandbox.run``'s and ``Sandbox.stream``'s parameters.

    ``cmd`` is an argv list, or a string split like a shell would split it.
    """

    cmd: str | Sequence[str]
    _: KW_ONLY
    env: Mapping[str, str] | None = None
    workdir: str = ""
    timeout: float = 0.0
    max_output: int = 0
    stdin: bytes | str = b""
    user: str = ""
    #: Run as a turn of its own (one call, not begin, run, end): a :class:`TurnEnd` word saying when the
    #: call returns after the turn end; the ended turn is ``ExecResult.ended_turn``.  "": no turn.
    turn: str = ""

    def request(self, sandbox: str, *, stream: bool) -> pb.ExecRequest:
        """The wire request for ``sandbox``, every value checked."""
        cmd, stdin = self.cmd, self.stdin
        return pb.ExecRequest(
            sandbox=sandbox,
            argv=shlex.split(cmd) if isinstance(cmd, str) else list(cmd),
            env=validate.env_vars(self.env or {}),
            workdir=self.workdir,
            timeout_s=validate.seconds(self.timeout, "timeout"),
            max_output_bytes=validate.integer(self.max_output, "max_output", maximum=INT64_MAX),
            stdin=stdin.encode() if isinstance(stdin, str) else stdin,
            stream=stream,
            user=self.user,
            turn_end=turn_end(self.turn),
        )


def session_request(
    sandbox: str,
    command: str,
    *,
    timeout: float = 0.0,
    max_output: int = 0,
    stream: bool = False,
    turn: str = "",
    session: str = "",
) -> pb.SessionRunRequest:
    return pb.SessionRunRequest(
        sandbox=sandbox,
        command=command,
        timeout_s=validate.seconds(timeout, "timeout"),
        max_output_bytes=validate.integer(max_output, "max_output", maximum=INT64_MAX),
        stream=stream,
        turn_end=turn_end(turn),
        session=session,
    )


def open_session_request(
    sandbox: str,
    name: str,
    *,
    env: Mapping[str, str] | None,
    empty_env: bool,
    workdir: str,
    user: str,
    pty: bool | tuple[int, int],
) -> pb.OpenSessionRequest:
    if not isinstance(name, str) or not name:
        raise InvalidRequest("a session to open needs a name (the default session opens by itself)")
    rows, cols = pty_size(pty)
    return pb.OpenSessionRequest(
        sandbox=sandbox,
        name=name,
        env=dict(env or {}),
        empty_env=bool(empty_env),
        workdir=workdir,
        user=user,
        pty=bool(pty),
        rows=rows,
        cols=cols,
    )


def pty_size(pty: bool | tuple[int, int]) -> tuple[int, int]:
    """``pty`` as (rows, columns) to send: True is (0, 0), crabd's default size."""
    if isinstance(pty, bool):
        return (0, 0)
    if not (isinstance(pty, tuple) and len(pty) == 2):
        raise InvalidRequest(f"pty is True, False or (rows, columns), not {pty!r:.80}")
    return (
        validate.integer(pty[0], "pty rows", minimum=1, maximum=0xFFFF),
        validate.integer(pty[1], "pty columns", minimum=1, maximum=0xFFFF),
    )


def turn_end(turn: str) -> str:
    """A command's ``turn`` argument checked before it is sent: "" (no turn) or a :class:`TurnEnd` word."""
    return TurnEnd.parse(turn).value if turn else ""


def client_timeout(timeout: float) -> float:
    """A client's per-call timeout: finite and positive (it becomes every call's gRPC deadline)."""
    t = validate.seconds(timeout, "client timeout")
    if t <= 0:
        raise InvalidRequest("client timeout must be positive")
    return t


def stop_request(sandbox: str, timeout: float) -> pb.StopSandboxRequest:
    return pb.StopSandboxRequest(sandbox=sandbox, timeout_s=validate.seconds(timeout, "stop timeout"))


def fork_count(n: int) -> int:
    """How many sandboxes a fork makes: at least 1, and an int32 on the wire."""
    return validate.integer(n, "n (sandboxes to fork)", minimum=1, maximum=INT32_MAX)


def turns_request(sandbox: str, limit: int) -> pb.ListTurnsRequest:
    return pb.ListTurnsRequest(sandbox=sandbox, limit=validate.integer(limit, "limit", maximum=INT64_MAX))


def checkpoint_id(checkpoint: object) -> str:
    """A checkpoint id from an id string or anything with an ``id`` attribute."""
    if isinstance(checkpoint, str):
        return checkpoint
    ident = getattr(checkpoint, "id", None)
    if not isinstance(ident, str):
        raise InvalidRequest(f"not a checkpoint: {checkpoint!r}")
    return ident


def restore_request(sandbox: str, checkpoint: object | None, turn: int | None) -> pb.RestoreRequest:
    if (checkpoint is None) == (turn is None):
        raise InvalidRequest("restore needs exactly one of: a checkpoint, or turn=N")
    if turn is not None:
        turn = validate.integer(turn, "turn", maximum=INT64_MAX)
    return pb.RestoreRequest(
        sandbox=sandbox,
        checkpoint="" if checkpoint is None else checkpoint_id(checkpoint),
        turn=-1 if turn is None else turn,
    )


def fork_request(
    n: int, *, name_prefix: str, checkpoint: object | None = None, sandbox: str = "", turn: int | None = None
) -> pb.ForkRequest:
    """Fork ``checkpoint``; else ``sandbox``'s latest checkpoint, or (``turn``) its state at the end of that turn."""
    if checkpoint is not None:
        if turn is not None:
            raise InvalidRequest("fork needs at most one of: a checkpoint, or turn=N")
        return pb.ForkRequest(checkpoint=checkpoint_id(checkpoint), n=fork_count(n), name_prefix=name_prefix)
    if turn is not None:
        turn = validate.integer(turn, "turn", maximum=INT64_MAX)
    req = pb.ForkRequest(sandbox=sandbox, n=fork_count(n), name_prefix=name_prefix)
    if turn is not None:
        req.turn = turn
    return req


def failures_from_pb(m: pb.ListFailuresResponse) -> list[CheckpointFailure]:
    from crabd.sdk.models.checkpoint import CheckpointFailure  # on first use: see crabd/sdk/models/__init__.py

    return [CheckpointFailure(f.sandbox_id, f.turn, f.kind, f.at, f.error, f.log_path) for f in m.failures]
