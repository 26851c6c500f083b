"""Driving a persistent, non-interactive bash over pipes.

crabd writes :data:`BOOTSTRAP` once, then one :func:`wrap_command` block per
command.  The block, as bash reads it from stdin::

    __crab_prev=$?
    IFS= read -r -d '' __crab_cmd <<'__CRAB_EOF_<nonce>' || :
    <the command text, verbatim>
    __CRAB_EOF_<nonce>
    (exit $__crab_prev); eval "$__crab_cmd" </dev/null
    __crab_rc=$?
    printf '\\036__CRAB_DONE_<nonce>_%d\\036' "$__crab_rc"            # to stdout
    printf '\\036__CRAB_DONE_<nonce>_%d\\036' "$__crab_rc" >&2        # and stderr
    eval "unset __crab_cmd __crab_prev __crab_rc; (exit $__crab_rc)"

Why this shape:

* The text arrives through a *quoted* heredoc whose terminator carries a
  random nonce: no expansion, any bytes but NUL, and a command with
  unbalanced quotes cannot swallow what follows (eval reports rc 2, the
  session carries on).
* ``eval`` at top level, not in a function: ``cd``, ``export``,
  ``declare``, ``alias``, functions, ``set -o``, ``trap``, ``umask`` and
  ``cmd &`` jobs persist exactly as if typed at a prompt.
* ``</dev/null`` on the eval: a command reading stdin gets EOF at once
  and can never eat the control stream.
* ``$?`` seen by a command is the previous command's status, and after the
  block it is this command's status, as at a prompt (two subshell forks).
* The done marker goes to both streams, so the reader knows both are
  complete; it is framed by 0x1E bytes and adds no newline, so output
  ``abc`` comes back as exactly ``abc``.  ``set -x`` traces show the marker
  *unexpanded* (``\\036``), so they can never be mistaken for it.
* ``exit N`` ends bash: the reader sees the process exit without a marker
  (reported as "session ended with status N").  Under ``set -e`` a failing
  command ends the session the same way, as it would end an interactive
  shell.

Interrupting a running command cleanly is not possible for a non-interactive
bash (SIGINT kills it, and a half-consumed heredoc would desynchronise the
stream), so on timeout the caller kills the whole session and starts a fresh
one from the last captured state (see ``coordinator.runner.Session``).
"""

from __future__ import annotations

import os
import re
import secrets
from typing import Literal

from crabd.errors import SessionCommandError

#: Written once to a fresh session.  Aliases expand as at a prompt; no
#: prompts are printed (bash prints none when not interactive, but keep
#: PS1/PS2 empty so a user's `bash -i` inside does not inherit ours).
BOOTSTRAP = b"shopt -s expand_aliases\nPS1=''\nPS2=''\n"

MARK = b"\x1e"
Stream = Literal["stdout", "stderr"]


def new_nonce() -> str:
    return secrets.token_hex(8)


def _encode(command: bytes | str) -> bytes:
    return os.fsencode(command) if isinstance(command, str) else command


def wrap_command(command: bytes | str, nonce: str, *, keep_status: bool = False) -> bytes:
    """The bytes that make bash run ``command`` and then print the done markers.

    With ``keep_status`` the block leaves ``$?`` as it found it (used for
    crab's own commands, such as state capture, so they are invisible).
    """
    text = _encode(command)
    if b"\0" in text:
        raise SessionCommandError("session commands cannot contain NUL bytes")
    if not re.fullmatch(r"[0-9a-f]{8,64}", nonce):
        raise ValueError("nonce must be hex")
    if not text.endswith(b"\n"):
        text += b"\n"
    eof = f"__CRAB_EOF_{nonce}".encode()
    marker = f"\\036__CRAB_DONE_{nonce}_%d\\036".encode()
    final = b"$__crab_prev" if keep_status else b"$__crab_rc"
    return (
        b"__crab_prev=$?\n"
        b"IFS= read -r -d '' __crab_cmd <<'" + eof + b"' || :\n" + text + eof + b"\n"
        b'(exit $__crab_prev); eval "$__crab_cmd" </dev/null\n'
        b"__crab_rc=$?\n"
        b"printf '" + marker + b"' \"$__crab_rc\"; printf '" + marker + b'\' "$__crab_rc" >&2\n'
        b'eval "unset __crab_cmd __crab_prev __crab_rc; (exit ' + final + b')"\n'
    )


class _StreamScan:
    """Finds the done marker in one stream, keeping output within a bound."""

    def __init__(self, prefix: bytes, limit: int) -> None:
        self.prefix = prefix
        self.limit = limit
        self.kept = bytearray()
        self.dropped = 0
        self.carry = b""
        self.done = False
        self.code: int | None = None

    def _keep(self, data: bytes) -> bytes:
        room = max(self.limit - len(self.kept), 0)
        part = data[:room]
        self.kept += part
        self.dropped += len(data) - len(part)
        return part

    def feed(self, data: bytes) -> bytes:
        """Consume ``data``; return the output bytes newly kept."""
        if self.done:
            return b""  # after the marker: output of background jobs, not this command's
        buf = self.carry + data
        self.carry = b""
        at = buf.find(self.prefix)
        if at >= 0:
            end = buf.find(MARK, at + len(self.prefix))
            if end < 0:
                self.carry = buf[at:]  # the digits are still coming
                return self._keep(buf[:at])
            digits = buf[at + len(self.prefix) : end]
            if digits.isdigit():
                self.done = True
                self.code = int(digits)
                return self._keep(buf[:at])
            # Looked like our marker but is not: plain output.
            return self._keep(buf[: at + len(self.prefix)]) + self.feed(buf[at + len(self.prefix) :])
        # Hold back a tail that could be the start of a marker split across reads.
        hold = 0
        for n in range(min(len(self.prefix) - 1, len(buf)), 0, -1):
            if buf.endswith(self.prefix[:n]):
                hold = n
                break
        self.carry = buf[len(buf) - hold :] if hold else b""
        return self._keep(buf[: len(buf) - hold])


class MarkerScanner:
    """Demarcates one command's output on both streams."""

    def __init__(self, nonce: str, *, max_stdout: int, max_stderr: int) -> None:
        prefix = b"\x1e__CRAB_DONE_" + nonce.encode() + b"_"
        self._s = {"stdout": _StreamScan(prefix, max_stdout), "stderr": _StreamScan(prefix, max_stderr)}

    def feed(self, stream: Stream, data: bytes) -> bytes:
        """Consume output; return what was newly kept (for live streaming)."""
        return self._s[stream].feed(data)

    @property
    def done(self) -> bool:
        return self._s["stdout"].done and self._s["stderr"].done

    @property
    def exit_code(self) -> int | None:
        return self._s["stdout"].code

    @property
    def stdout(self) -> bytes:
        return bytes(self._s["stdout"].kept)

    @property
    def stderr(self) -> bytes:
        return bytes(self._s["stderr"].kept)

    @property
    def dropped_stdout(self) -> int:
        return self._s["stdout"].dropped

    @property
    def dropped_stderr(self) -> int:
        return self._s["stderr"].dropped
