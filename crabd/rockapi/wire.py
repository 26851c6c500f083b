"""ROCK's sandbox API on the wire: the reply envelope, the request bodies, and crab's errors in ROCK's terms.

Every reply is HTTP 200 with ``{"status": "Success" | "Failed", "message",
"error", "result"}``: ROCK's client raises on any other status code before
it reads the body, and reads ``result`` only after checking ``status``
(except ``read_file``, which reads ``result["content"]`` whatever the status
says, so a failed read still carries ``{"content": ""}``).  Codes follow
ROCK's ranges: 2000 ok, 4xxx the caller's mistake, 5xxx the server's, 6xxx a
command's.

Request bodies are input from a client crab did not write: each is parsed
into a model here, with every field bounded, before anything happens.
Unknown fields are ignored, not refused (``extra="ignore"``): ROCK's client
sends fields its own server does not know either (``auto_clear_time``), and
refusing them would break the unmodified client this server exists for.
"""

from __future__ import annotations

import re
from enum import IntEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crabd.errors import CrabError, InvalidRequest, NotFound, PermissionDenied, QuotaExceeded, SandboxBusy

#: The path every route hangs off (ROCK's client appends the route to ``$ROCK_BASE_URL`` + this).
PREFIX = "/apis/envs/sandbox/v1"
#: Longest command, path or file ROCK's client may send in one request (bytes).
MAX_TEXT = 8 << 20
#: ROCK's temporary sessions: ``arun()`` without a session opens ``bash-<time_ns>`` and never closes it.
TEMP_SESSION = re.compile(r"bash-[0-9]{1,24}")


class Code(IntEnum):
    OK = 2000
    BAD_REQUEST = 4000
    FORBIDDEN = 4003
    NOT_FOUND = 4004
    BUSY = 4009
    QUOTA = 4029
    SERVER = 5000
    COMMAND = 6000


def success(result: Any) -> dict[str, Any]:
    return {"status": "Success", "message": None, "error": None, "result": result}


def failed(message: str, error: str, result: Any = None) -> dict[str, Any]:
    return {"status": "Failed", "message": message, "error": error, "result": result}


def failed_code(message: str, error: str, code: Code) -> dict[str, Any]:
    """A failure whose ``result`` carries a code (ROCK's client turns 4xxx/5xxx/6xxx into its own errors)."""
    return failed(message, error, {"code": int(code), "exit_code": None, "failure_reason": error})


def code_for(exc: CrabError) -> Code:
    if isinstance(exc, PermissionDenied):
        return Code.FORBIDDEN
    if isinstance(exc, NotFound):
        return Code.NOT_FOUND
    if isinstance(exc, SandboxBusy):
        return Code.BUSY
    if isinstance(exc, QuotaExceeded):
        return Code.QUOTA
    if isinstance(exc, InvalidRequest):
        return Code.BAD_REQUEST
    return Code.SERVER


def crab_failure(what: str, exc: CrabError) -> dict[str, Any]:
    """A crab error as ROCK's failure: the message says what failed, the error what crab said (and its hint)."""
    text = exc.message + (f" ({exc.hint})" if exc.hint else "")
    return failed_code(what, text, code_for(exc))


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", str_max_length=MAX_TEXT)


class StartRequest(_Body):
    image: str = Field("", max_length=4096)
    memory: str | None = Field(None, max_length=32)
    cpus: float | None = Field(None, ge=0, le=1024)
    sandbox_id: str | None = Field(None, max_length=128)


class SandboxRef(_Body):
    sandbox_id: str = Field(..., min_length=1, max_length=128)


class CommandRequest(SandboxRef):
    command: str | list[str]
    timeout: float | None = Field(1200.0, gt=0, le=7 * 86400)
    cwd: str | None = Field(None, max_length=4096)
    env: dict[str, str] | None = None


class CreateSessionRequest(SandboxRef):
    session_type: Literal["bash"] = "bash"
    session: str = Field("default", max_length=64)
    startup_source: list[str] = Field(default_factory=list, max_length=64)
    env_enable: bool = False
    env: dict[str, str] | None = None
    remote_user: str | None = Field(None, max_length=64)


class RunRequest(SandboxRef):
    action_type: Literal["bash"] = "bash"
    session: str = Field("default", max_length=64)
    command: str
    check: Literal["raise", "silent", "ignore"] = "raise"
    timeout: float | None = Field(None, gt=0, le=7 * 86400)


class CloseSessionRequest(SandboxRef):
    session_type: Literal["bash"] = "bash"
    session: str = Field("default", max_length=64)


class ReadFileRequest(SandboxRef):
    path: str = Field(..., min_length=1, max_length=4096)
    encoding: str | None = Field(None, max_length=32)
    errors: str | None = Field(None, max_length=32)


class WriteFileRequest(SandboxRef):
    path: str = Field(..., min_length=1, max_length=4096)
    content: str


class CheckpointRequest(SandboxRef):
    label: str = Field("", max_length=256)


class RestoreRequest(SandboxRef):
    checkpoint: str = Field("", max_length=128)
    turn: int | None = Field(None, ge=0)


class ForkRequest(RestoreRequest):
    n: int = Field(1, ge=1, le=256)


def parse(model: type[_Body], body: Any) -> Any:
    """``body`` as ``model``; InvalidRequest naming each bad field (ROCK answers "invalid parameter")."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        parts = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:10])
        raise InvalidRequest(f"invalid parameter: {parts}") from None


def status_of(state: str, ready: bool, error: str) -> tuple[bool, dict[str, dict[str, str]], str]:
    """``get_status``'s ``is_alive``, phases and state for a sandbox crab is making or has made."""
    if error:
        return False, {"docker_run": {"status": "failed", "message": error}}, "stopped"
    if not ready:
        return False, {"docker_run": {"status": "running", "message": "creating the crab sandbox"}}, "pending"
    alive = state == "running"
    phase = "success" if alive else "failed"
    return (
        alive,
        {"docker_run": {"status": phase, "message": f"crab sandbox {state}"}},
        "running" if alive else "stopped",
    )
