"""Errors of reaching crabd: the SDK's client, and the hosts of a cluster (the optional Ray layer)."""

from __future__ import annotations

# At the top, not in the functions that use them: a caller that dropped privileges after start-up
# (a test's child that became another uid) may no longer read its interpreter's lib-dynload.
import grp
import os
import pwd
import socket as _socket

from crabd.errors.base import CrabError

# The group whose members may use crabd's socket (0660 root:crab; systemd/crab.sysusers).
from crabd.util.private_dirs import CRAB_GROUP as SOCKET_GROUP


class DaemonUnavailable(CrabError):
    """The SDK cannot reach crabd.  Attribute: ``socket``.

    :func:`unreachable` makes one that says why (no socket, no permission, a stale socket).
    """

    grpc_code = "UNAVAILABLE"
    default_hint = "Check that crabd runs (`systemctl status crabd`) and that you are in group crab."

    def __init__(self, message: str, *, socket: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.socket = socket


def unreachable(socket_path: str, detail: str) -> DaemonUnavailable:
    """The DaemonUnavailable for a failed connection to ``socket_path``, saying why.

    gRPC reports every failed connect as UNAVAILABLE with the OS's reason buried in
    free text; one plain connect() here tells the three cases a user fixes differently
    apart: no socket (crabd is not running), permission denied (not in group crab, or
    added since this login), refused (a stale socket: crabd died without removing it).
    A connect that succeeds means crabd answers and the failure came later (crabd
    restarted in the middle of the call, say).  Runs only after a failure, never per call.
    """
    if not socket_path:
        return DaemonUnavailable(f"cannot reach crabd: {detail}", socket=socket_path)
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(socket_path)
    except (FileNotFoundError, NotADirectoryError):
        return DaemonUnavailable(
            f"cannot reach crabd at {socket_path}: no socket there (crabd is not running)",
            socket=socket_path,
            hint="Start crabd (`systemctl start crabd`), or give the socket it serves (--socket or $CRAB_SOCKET).",
        )
    except PermissionError:
        return DaemonUnavailable(
            f"cannot reach crabd at {socket_path}: permission denied", socket=socket_path, hint=_membership_hint()
        )
    except ConnectionRefusedError:
        return DaemonUnavailable(
            f"cannot reach crabd at {socket_path}: nothing listens on it (a stale socket: crabd is not running)",
            socket=socket_path,
            hint="Start crabd (`systemctl start crabd`); it replaces the stale socket.",
        )
    except OSError as exc:
        return DaemonUnavailable(f"cannot reach crabd at {socket_path}: {exc.strerror or exc}", socket=socket_path)
    finally:
        probe.close()
    return DaemonUnavailable(
        f"cannot reach crabd at {socket_path}: {detail} (it accepts connections: the call itself failed)",
        socket=socket_path,
        hint="crabd may have restarted during the call; retry, and see its log (`journalctl -u crabd`) if it recurs.",
    )


def _membership_hint() -> str:
    """What to do about a refused socket: join group crab, or log in again after joining it."""
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = str(os.getuid())
    try:
        group = grp.getgrnam(SOCKET_GROUP)
    except KeyError:
        return (
            f"crabd's socket is open to group {SOCKET_GROUP}, which this host lacks: "
            "run `make setup` or `crabctl host install-service` as root, which create it."
        )
    if user in group.gr_mem and group.gr_gid not in os.getgroups():
        return (
            f"You were added to group {SOCKET_GROUP} after this session began: log out and in again "
            f"(or run `newgrp {SOCKET_GROUP}`) so that it takes effect."
        )
    if group.gr_gid in os.getgroups() or os.getgid() == group.gr_gid:
        return (
            f"You are in group {SOCKET_GROUP}, but the socket or its directory is not open to it: "
            f"ask an admin to restart crabd (it makes the socket 0660 root:{SOCKET_GROUP})."
        )
    return (
        f"Only members of group {SOCKET_GROUP} may use crabd: ask an admin to run "
        f"`usermod -aG {SOCKET_GROUP} {user}`, then log out and in again."
    )


class ClientClosed(CrabError):
    """An SDK client (or a sandbox or session of it) was used after ``close()``.  Attribute: ``socket``."""

    default_hint = "Make a new client, or keep using this one inside its `with` block."

    def __init__(self, message: str, *, socket: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.socket = socket


class HostUnavailable(CrabError):
    """A cluster host does not answer: its Ray node (and with it its agent) is gone, or never joined.

    Attributes: ``host``; ``gone``: Ray reports the host's agent dead (its node died), not just
    slow to answer.
    """

    grpc_code = "UNAVAILABLE"
    default_hint = (
        "See `crabctl --cluster ADDR cluster hosts`; a lost host's sandboxes come back on the others "
        "with `crabctl --cluster ADDR cluster recover HOST`."
    )

    def __init__(self, message: str, *, host: str, gone: bool = False, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.host = host
        self.gone = gone


class NoCapacity(CrabError):
    """The cluster's live hosts lack free capacity for the sandboxes asked for.  Attributes: ``requested``, ``free``."""

    grpc_code = "RESOURCE_EXHAUSTED"
    default_hint = "Add a host (`crabctl --cluster ADDR cluster join ...`), remove sandboxes, or ask for fewer."

    def __init__(self, message: str, *, requested: int, free: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.requested = requested
        self.free = free


class MigrationFailed(CrabError):
    """A migration did not complete.  Attributes: ``sandbox``, ``target``, ``source_kept``.

    ``source_kept``: the sandbox runs on its old host again (from the
    checkpoint the migration took), so nothing was lost; otherwise the
    message says where it stands.
    """

    grpc_code = "ABORTED"
    default_hint = "The sandbox stays where it was; check the target host and retry."

    def __init__(self, message: str, *, sandbox: str, target: str, source_kept: bool, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox
        self.target = target
        self.source_kept = source_kept
