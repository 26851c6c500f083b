"""crab's Python SDK.

The public surface is what this module exports; everything under
``crabd.sdk._*`` and the wire types are private.
"""

from __future__ import annotations

from crabd.errors import (
    AlreadyExists,
    CrabError,
    DaemonUnavailable,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    RequestTooLarge,
    SandboxBusy,
    SandboxDead,
    SandboxNotFound,
)
from crabd.sdk.aio import AsyncClient, AsyncSandbox, AsyncSession
from crabd.sdk.client import Client, Sandbox, Session
from crabd.sdk.embedded import EmbeddedDaemon
from crabd.sdk.models import CommandInfo, DaemonStatus, ExecResult, OutputChunk, SandboxInfo, Turn

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "AsyncSandbox",
    "AsyncSession",
    "Client",
    "CommandInfo",
    "CrabError",
    "DaemonStatus",
    "DaemonUnavailable",
    "EmbeddedDaemon",
    "ExecResult",
    "InvalidRequest",
    "NotFound",
    "OutputChunk",
    "PermissionDenied",
    "RequestTooLarge",
    "Sandbox",
    "SandboxBusy",
    "SandboxDead",
    "SandboxInfo",
    "SandboxNotFound",
    "Session",
    "Turn",
]
