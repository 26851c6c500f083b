"""Checks of what a command request carries, before anything is looked up or run.

``exec``, a session command and a session restart each bring caller-made
text into crabd: a command line, its environment, stdin, a working
directory, a user, a session state (and ``create`` a new sandbox's
environment).  Each is checked here in full, against
``[limits]`` (:class:`~crabd.config.LimitsConfig`) and the one shared rule
for environment variables (``crabd.util.validate.env_vars``), so that a bad
request gets a clear error and has no effect (``service.py``).  Pure
functions of the request and the limits: no state.
"""

from __future__ import annotations

import re

from crabd.config import LimitsConfig
from crabd.errors import InvalidRequest, RequestTooLarge
from crabd.runtime import session_state
from crabd.runtime.initproto import DEFAULT_PTY_SIZE, MAX_PTY_SIDE
from crabd.util import validate


def parse_user(user: str) -> tuple[int | None, int | None]:
    """``"uid"`` or ``"uid:gid"`` (numeric) -> (uid, gid); empty -> (None, None)."""
    if not user:
        return None, None
    uid_s, _, gid_s = user.partition(":")
    try:
        uid = int(uid_s)
        gid = int(gid_s) if gid_s else uid
    except ValueError as exc:
        raise InvalidRequest(f"user {user!r} must be numeric 'uid' or 'uid:gid'") from exc
    if not (0 <= uid < 2**32 - 1 and 0 <= gid < 2**32 - 1):
        raise InvalidRequest(f"user {user!r} is out of range")
    return uid, gid


def max_output(lim: LimitsConfig, requested: int) -> int:
    """The output a command may keep per stream: ``requested`` within the limit (0: the default)."""
    requested = validate.integer(requested, "max_output_bytes", minimum=0)
    if requested > lim.max_output_bytes:
        raise RequestTooLarge(
            f"max_output_bytes {requested} exceeds the limit of {lim.max_output_bytes}",
            limit=lim.max_output_bytes,
            size=requested,
        )
    return requested or lim.default_max_output_bytes


def command_size(lim: LimitsConfig, size: int, what: str) -> None:
    limit = lim.max_command_bytes
    if size > limit:
        raise RequestTooLarge(f"{what} is {size} bytes, more than the limit of {limit}", limit=limit, size=size)


def check_env(lim: LimitsConfig, env: dict[str, str], what: str = "environment") -> None:
    """Check environment variables (a new sandbox's, a session's): the shared rule, and their size."""
    validate.env_vars(env, what)
    command_size(lim, sum(len(k) + len(v) + 2 for k, v in env.items()), f"the {what}")


def check_workdir(workdir: str) -> None:
    """A working directory in the sandbox: absolute ("" is the sandbox's own)."""
    if workdir and (not workdir.startswith("/") or "\0" in workdir):
        raise InvalidRequest(f"workdir {workdir!r} must be an absolute path")


def check_exec(
    lim: LimitsConfig, argv: list[str], env: dict[str, str], stdin: bytes, workdir: str, user: str
) -> tuple[int | None, int | None]:
    """Check an ``exec`` request's command, environment, stdin and workdir; its user as (uid, gid)."""
    if not argv or not argv[0]:
        raise InvalidRequest("empty command", hint="Give the program and its arguments, e.g. ['ls', '-l'].")
    if any("\0" in a for a in argv):
        raise InvalidRequest("command arguments must not contain NUL bytes")
    validate.env_vars(env)
    size = sum(len(a.encode()) + 1 for a in argv) + sum(len(k) + len(v) + 2 for k, v in env.items())
    command_size(lim, size, "the command")
    if len(stdin) > lim.max_stdin_bytes:
        raise RequestTooLarge(
            f"stdin is {len(stdin)} bytes, more than the limit of {lim.max_stdin_bytes}",
            limit=lim.max_stdin_bytes,
            size=len(stdin),
        )
    check_workdir(workdir)
    return parse_user(user)


def check_session_command(lim: LimitsConfig, command: str) -> None:
    """Check a command for the sandbox's shell session (one script, run as it is)."""
    if not command.strip():
        raise InvalidRequest("empty session command")
    if "\0" in command:
        raise InvalidRequest("session commands must not contain NUL bytes")
    command_size(lim, len(command.encode()), "the session command")


def check_session_state(lim: LimitsConfig, state_json: str) -> None:
    """Check a session state to restart the shell session with ("": a fresh session)."""
    command_size(lim, len(state_json.encode()), "the session state")
    if state_json:
        # Its environment obeys the same rule as create's and exec's.
        state = session_state.SessionState.from_json(state_json)
        validate.env_vars(state.env, "session environment")
        if not isinstance(state.variables, dict):
            raise InvalidRequest("invalid session state: 'variables' must map names to declarations")
        validate.env_vars(dict.fromkeys(state.variables, ""), "session")


#: A named session's name: what init's table, a CLI flag and a log line all carry safely.
SESSION_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_session_name(name: str) -> None:
    """A named session's name ("" is the default session and passes)."""
    if name and not SESSION_NAME_RE.fullmatch(name):
        raise InvalidRequest(
            f"session name {name[:80]!r} is not valid",
            hint="Use 1-64 characters: letters, digits, '.', '_', '-', starting with a letter or digit.",
        )


def check_pty_size(size: tuple[int, int] | None) -> tuple[int, int] | None:
    """A pty's (rows, columns) as asked: 0 for either means its default (24 x 80); None: no pty."""
    if size is None:
        return None
    rows, cols = size[0] or DEFAULT_PTY_SIZE[0], size[1] or DEFAULT_PTY_SIZE[1]
    if not (1 <= rows <= MAX_PTY_SIDE and 1 <= cols <= MAX_PTY_SIDE):
        raise InvalidRequest(
            f"a pty of {size[0]} x {size[1]} is not possible",
            hint=f"Give rows and columns from 1 to {MAX_PTY_SIDE} (0: the default, 24 x 80).",
        )
    return rows, cols


def check_open_session(
    lim: LimitsConfig, name: str, env: dict[str, str], workdir: str, user: str
) -> tuple[int | None, int | None]:
    """Check a request to open a named session; its user as (uid, gid)."""
    if not name:
        raise InvalidRequest("a session to open needs a name (the default session opens by itself)")
    check_session_name(name)
    check_env(lim, env, "session environment")
    check_workdir(workdir)
    return parse_user(user)
