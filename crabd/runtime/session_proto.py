"""Driving a persistent, non-interactive bash over pipes, with an authenticated end marker.

crabd writes :data:`BOOTSTRAP` once, then one :func:`wrap_command` block per
command.  The block, as bash reads it from stdin::

    __crab_prev=$?
    IFS= read -r -d '' __crab_cmd <<'__CRAB_EOF_<nonce>' || :
    <the command text, verbatim>
    __CRAB_EOF_<nonce>
    <$? := __crab_prev>; eval "$__crab_cmd" </dev/null
    __crab_rc=$?
    printf 'DONE:<nonce>:%d\0' "$__crab_rc" >&100
    <unset __crab_cmd __crab_prev __crab_rc; $? := __crab_rc>

Fd 100 (:data:`CONTROL_FD`) is the session's *control channel*: crab-init
spawns the session bash with one end of a unix socketpair there and relays
what arrives on its own end to crabd as CONTROL frames, but only bytes the
bash process itself sent (the kernel stamps every message with its
sender's pid; see crab-init.c).  The done marker is written by bash's
``printf`` builtin, in bash itself.  The command runs with fd 100 open, and
what it starts inherits it, because closing it for the command is not
robust: bash would save and restore it around the ``eval`` with dup2(2),
which fails once the command has set ``ulimit -n`` to 100 or less, and
the session would lose its channel.  Inheriting it gives nothing: a child
sends with its own pid.  So:

* Completion and exit status come only from the control channel.  Whatever
  a command prints on stdout or stderr is output, returned byte for byte,
  even if it looks like a marker with the right nonce.
* Any other process that writes to the channel (a child or a forked
  subshell, which inherit fd 100; a thief with ``pidfd_getfd``) sends with
  its own pid: init drops that and reports it
  (:class:`~crabd.runtime.initproto.ControlRejected`).
* What the channel does NOT stop: code that runs in the bash process
  itself (the commands crabd sends, and the functions, traps and aliases
  they define, e.g. a function named ``printf``) and a process that
  ptraces bash to make it write (which the eBPF inspector records as
  ``ptrace``).  They act as the session, which is what they are.
* crab-init relays a command's stdout/stderr bytes written before the
  marker before the marker, so the command's output is complete when the
  marker arrives; output after it (background jobs) is dropped, as before.

Control stream: NUL-terminated words (bash text can never contain NUL).
``DONE:<nonce>:<status>`` ends a command; ``STATE`` ... ``END`` is a state
capture (format in ``session_state.py``); content words inside it start
with ``=``, so no content can look like a structural word.  Anything else
is ignored.  The nonce is not a secret any more (a process can read it
from bash's memory); it only tells this command's marker from a stale one
(a command whose crabd went away).

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
  block it is this command's status, as at a prompt (set with ``:`` or
  ``! :``, or a subshell ``(exit N)`` for a status above 1).
* Nothing is added to the output streams, so output ``abc`` comes back as
  exactly ``abc``, and a command that closes or redirects stdout for good
  (``exec >file``) still completes.
* ``exit N`` ends bash: the reader sees the process exit without a marker
  (reported as "session ended with status N").  Under ``set -e`` a failing
  command ends the session the same way, as it would end an interactive
  shell.  A command that replaces bash (``exec prog``) ends it when
  ``prog`` exits; one that closes fd 100 for good (``exec 100>&-``, or
  ``exec bash``, which does not inherit it) leaves crabd without a marker:
  the command times out and the session is restarted from its last state.

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
from crabd.runtime.initproto import CONTROL_FD

#: Written once to a fresh session.  Aliases expand as at a prompt; no
#: prompts are printed (bash prints none when not interactive, but keep
#: PS1/PS2 empty so a user's `bash -i` inside does not inherit ours).
BOOTSTRAP = b"shopt -s expand_aliases\nPS1=''\nPS2=''\n"

Stream = Literal["stdout", "stderr"]
#: The largest control-stream record crabd buffers (a state capture).
MAX_CONTROL = 64 << 20


def new_nonce() -> str:
    return secrets.token_hex(8)


def _encode(command: bytes | str) -> bytes:
    return os.fsencode(command) if isinstance(command, str) else command


def _status_from(value: bytes, first: bytes = b"") -> bytes:
    """Bash text that runs ``first`` (if any), then sets ``$?`` to ``value`` (a ``$variable``).

    ``(exit N)`` is a subshell: a fork and a wait in bash, twice for every
    command crabd runs.  ``:`` and ``! :`` set 0 and 1 in place, inside a
    ``case`` at top level: a negated command neither trips ``set -e`` nor
    runs an ERR trap, where ``(exit 1)``, or an ``eval`` returning 1, did
    both (restoring a status is not a failure of its own).  A status above 1
    still takes the subshell (``first`` then runs in an ``eval``, whose
    double quotes expand ``value`` before ``first`` can unset it).
    """
    if not first:
        return b"case " + value + b" in 0) : ;; 1) ! : ;; *) (exit " + value + b") ;; esac"
    return (
        b"case " + value + b" in 0) " + first + b" ;; 1) " + first + b"; ! : ;; "
        b'*) eval "' + first + b"; (exit " + value + b')" ;; esac'
    )


def wrap_command(command: bytes | str, nonce: str, *, keep_status: bool = False) -> bytes:
    """The bytes that make bash run ``command`` and then write the done marker.

    With ``keep_status`` the command is crab's own (the state capture): it
    runs inline, not through the heredoc and ``eval`` (bash reads its input
    a byte per read(2), and the heredoc has it read the text twice: ~5,000
    reads for a capture), and ``$?`` is left as it found it, so the command
    is invisible.  Only crab's own well-formed text may go this way: a user
    command with unbalanced quotes would swallow what follows it.
    """
    text = _encode(command)
    if b"\0" in text:
        raise SessionCommandError("session commands cannot contain NUL bytes")
    if not re.fullmatch(r"[0-9a-f]{8,64}", nonce):
        raise ValueError("nonce must be hex")
    if not text.endswith(b"\n"):
        text += b"\n"
    fd = str(CONTROL_FD).encode()
    marker = b"printf 'DONE:" + nonce.encode() + b':%d\\0\' "$__crab_rc" >&' + fd + b"\n"
    if keep_status:
        end = _status_from(b"$__crab_prev", b"unset __crab_prev __crab_rc") + b"\n"
        return b"__crab_prev=$?\n" + text + b"__crab_rc=$?\n" + marker + end
    eof = f"__CRAB_EOF_{nonce}".encode()
    end = _status_from(b"$__crab_rc", b"unset __crab_cmd __crab_prev __crab_rc") + b"\n"
    read = b"IFS= read -r -d '' __crab_cmd <<'" + eof + b"' || :\n"
    run = _status_from(b"$__crab_prev") + b'; eval "$__crab_cmd" </dev/null\n'
    return b"__crab_prev=$?\n" + read + text + eof + b"\n" + run + b"__crab_rc=$?\n" + marker + end


class _Output:
    """Keeps the first ``limit`` bytes of one stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.dropped = 0

    def feed(self, data: bytes) -> bytes:
        room = max(self.limit - len(self.kept), 0)
        part = data[:room]
        self.kept += part
        self.dropped += len(data) - len(part)
        return part


class MarkerScanner:
    """Demarcates one command: its output, and its end from the control channel.

    ``feed`` takes output (never searched for markers); ``feed_control``
    takes the CONTROL bytes crab-init authenticated.  The command is done at
    ``DONE:<nonce>:<status>`` with *this* command's nonce; output after that
    is not the command's.  The last complete ``STATE`` ... ``END`` record
    seen before it is :attr:`state`.
    """

    def __init__(self, nonce: str, *, max_stdout: int, max_stderr: int, max_control: int = MAX_CONTROL) -> None:
        self._done_word = b"DONE:" + nonce.encode() + b":"
        self._s = {"stdout": _Output(max_stdout), "stderr": _Output(max_stderr)}
        self._max_control = max_control
        self._carry = bytearray()  # an unfinished control word
        self._record: bytearray | None = None  # a STATE record being collected
        self._skip_word = False  # the current word overflowed; drop it
        self.done = False
        self.exit_code: int | None = None
        self.state: bytes | None = None
        #: A state record (or a word) exceeded ``max_control`` and was dropped.
        self.control_overflow = False

    def feed(self, stream: Stream, data: bytes) -> bytes:
        """Consume output; return what was newly kept (for live streaming)."""
        if self.done:
            return b""  # after the marker: output of background jobs, not this command's
        return self._s[stream].feed(data)

    def feed_control(self, data: bytes) -> None:
        """Consume authenticated control-channel bytes."""
        while data and not self.done:
            at = data.find(b"\0")
            if at < 0:
                self._grow(data)
                return
            self._grow(data[:at])
            word, skip = bytes(self._carry), self._skip_word
            self._carry.clear()
            self._skip_word = False
            data = data[at + 1 :]
            if skip:
                self._drop_record()
            else:
                self._word(word)

    def _grow(self, part: bytes) -> None:
        if self._skip_word:
            return
        held = len(self._carry) + len(part) + (len(self._record) if self._record is not None else 0)
        if held > self._max_control:
            self._carry.clear()
            self._skip_word = True
            self.control_overflow = True
        else:
            self._carry += part

    def _drop_record(self) -> None:
        if self._record is not None:
            self._record = None
            self.control_overflow = True

    def _word(self, word: bytes) -> None:
        if word.startswith(b"DONE:"):
            self._record = None  # a capture cut short never completes
            if word.startswith(self._done_word) and word[len(self._done_word) :].isdigit():
                self.done = True
                self.exit_code = int(word[len(self._done_word) :])
            return  # else: a stale marker (a command whose crabd went away)
        if word == b"STATE":
            self._record = bytearray(b"STATE\0")
            return
        if self._record is None:
            return  # content outside a record: ignore
        if len(self._record) + len(word) + 1 > self._max_control:
            self._drop_record()
            return
        self._record += word + b"\0"
        if word == b"END":
            self.state = bytes(self._record)
            self._record = None

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
