"""The semantic state of a session's bash: capture it cheaply, re-apply it to a fresh bash.

Captured (no process dump, a few ms): cwd and OLDPWD, umask, the exported
environment, every other shell variable with its attributes (arrays,
associative arrays, integer, readonly, nameref, ...), functions (and which
are exported), aliases, ``set -o`` and ``shopt`` options, traps, and the
directory stack.

Capture format.  :data:`CAPTURE_COMMAND` writes it to the session's
*control channel* (fd 100, see ``session_proto.py``), never to stdout: only
bytes the session's bash process itself writes there reach crabd, so the
capture is made with bash builtins only (``printf``, ``declare``,
``umask``, parameter expansions; no ``$(...)``, no pipes, no external
programs: a forked writer would be dropped by crab-init), each redirected
on its own so a DEBUG trap's output cannot mix in.  A command printing
something that looks like a capture on stdout changes nothing.  The format
is a sequence of NUL-terminated words (bash text never contains NUL)::

    capture  := "STATE" section* "END"                  (each word NUL-terminated)
    section  := NAME item*
    item     := "=" bytes                               (content; structure never starts with "=")
    NAME     := CWD | OLDPWD | UMASK | ENV | VARS | FUNCS | FUNCX | ALIASES | SETO | SHOPT | TRAPS | DIRS
    ENV      items: "KEY=VALUE" of each exported, set, scalar variable
    VARS     items: per variable: name, then its `declare -p` statement
    DIRS     items: the directory stack
    FUNCX    one item: `declare -F -x` (one "declare -fx NAME" line per exported function)
    others   one item: bash's own text (`umask`, `declare -f`, `alias -p`, `set +o`, `shopt -p`, `trap -p`)

Variable names are listed with ``"${!A@}" ... "${!z@}"`` (every set
variable, as ``compgen -v`` lists them).  ENV is what ``env`` would print
for bash's variables, except for environment entries bash cannot name as
variables (e.g. ``A-B=1`` inherited from the container): those are not
captured, and a fresh bash gets them from the container anyway.

Everything is re-applied with bash's own quoting, so values with newlines,
quotes, ``=`` or non-UTF-8 bytes round-trip exactly.  In Python, text is
decoded with ``surrogateescape``, and JSON keeps lone surrogates as
``\\udcXX`` escapes, so bytes survive storage too.

The bash's resource limits and open descriptors are not in the capture:
crabd reads them from /proc on the host and adds them (``limits``, ``fds``;
see ``session_os.py``).  Captures stored before these fields existed load
with them unset (None: not recorded).

Named sessions (``named``, omitted when empty).  The stored state of a
sandbox is its default session's, and, under ``named``, each named session
that was idle at the capture and holds no descriptor beyond 0-2: its own
state and how its bash was started (:class:`NamedCapture`: pid in the
sandbox at the capture, pty size, uid, gid).  A restore without a process
image of that moment re-creates each from it (``coordinator/named_capture.py``);
a named session not listed is one the sandbox's process image holds.
Names are checked like a request's (an archive is input).

Variables bash manages itself (dynamic, readonly or per-process: BASH*,
EUID, PPID, RANDOM, SECONDS, LINENO, PIPESTATUS, SHELLOPTS, ...) and crab's
own ``__crab_*`` helpers are neither captured nor restored; PWD and OLDPWD
are restored by ``cd``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from crabd.errors import SessionStateError
from crabd.runtime.initproto import CONTROL_FD

#: Shell variables never captured or restored (bash owns them).
EXCLUDED_VARS = frozenset(
    {
        "BASH",
        "BASHOPTS",
        "BASHPID",
        "BASH_ALIASES",
        "BASH_ARGC",
        "BASH_ARGV",
        "BASH_ARGV0",
        "BASH_CMDS",
        "BASH_COMMAND",
        "BASH_EXECUTION_STRING",
        "BASH_LINENO",
        "BASH_LOADABLES_PATH",
        "BASH_REMATCH",
        "BASH_SOURCE",
        "BASH_SUBSHELL",
        "BASH_VERSINFO",
        "BASH_VERSION",
        "BASH_COMPAT",
        "COLUMNS",
        "COMP_WORDBREAKS",
        "DIRSTACK",
        "EPOCHREALTIME",
        "EPOCHSECONDS",
        "EUID",
        "FUNCNAME",
        "GROUPS",
        "HISTCMD",
        "HOSTNAME",
        "HOSTTYPE",
        "LINENO",
        "LINES",
        "MACHTYPE",
        "OLDPWD",
        "OPTERR",
        "OPTIND",
        "OSTYPE",
        "PIPESTATUS",
        "PPID",
        "PWD",
        "RANDOM",
        "SECONDS",
        "SHELLOPTS",
        "SHLVL",
        "SRANDOM",
        "UID",
        "_",
    }
)
_EXCLUDED_CASE = "|".join(sorted(EXCLUDED_VARS)) + "|__crab_*"
#: shopt options that cannot be set and are skipped on restore.
READONLY_SHOPT = ("login_shell", "restricted_shell")

SECTIONS = ("CWD", "OLDPWD", "UMASK", "ENV", "VARS", "FUNCS", "FUNCX", "ALIASES", "SETO", "SHOPT", "TRAPS", "DIRS")

_FD = str(CONTROL_FD)
#: Every set variable's name: bash's prefix expansion for each possible first character.
_ALL_NAMES = " ".join(f'"${{!{c}@}}"' for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz")

#: Each redirected command costs bash a save, a dup2 and a restore of the descriptor (~10
#: system calls; an ``open`` more for ``2>/dev/null``), so the capture keeps them few: the
#: exported variables are gathered in an array and written by one ``printf``, each variable's
#: closing NUL is written with the next one's name, and stderr is silenced once for the whole
#: ``declare -p`` loop.  Stdout stays redirected command by command, never for a group: a DEBUG
#: trap runs before every command, and inside a group its output would land in the state.
CAPTURE_COMMAND = (
    f'printf \'STATE\\0CWD\\0=%s\\0OLDPWD\\0=%s\\0UMASK\\0=\' "$PWD" "${{OLDPWD-}}" >&{_FD}\n'
    f"umask >&{_FD}\n"
    # Every name, listed once (the text is read by bash a byte per read(2)).
    f"__crab_e=() __crab_v=({_ALL_NAMES})\n"
    'for __crab_n in "${__crab_v[@]}"; do case $__crab_n in _|__crab_*) continue;; esac; '
    # `${!n+x}` first: under `set -u` an unset one would end the shell.  A nameref
    # (`-R`) would report its target's attributes and value; env shows its own.
    "if [[ -n ${!__crab_n+x} && ! -R $__crab_n && ${!__crab_n@a} == *x* && ${!__crab_n@a} != *[aA]* ]]; then "
    '__crab_e+=("$__crab_n" "${!__crab_n}"); fi; done\n'
    f"printf '\\0ENV\\0' >&{_FD}\n"
    f"(( ${{#__crab_e[@]}} )) && printf '=%s=%s\\0' \"${{__crab_e[@]}}\" >&{_FD}\n"
    f"printf 'VARS\\0' >&{_FD}\n"
    # A format in a variable: printf turns its two characters \0 into a NUL (bash cannot hold one).
    "__crab_f='=%s\\0='\n"
    'for __crab_n in "${__crab_v[@]}"; do case $__crab_n in ' + _EXCLUDED_CASE + ") continue;; esac; "
    f'printf "$__crab_f" "$__crab_n" >&{_FD}; declare -p "$__crab_n" >&{_FD}; __crab_f=\'\\0=%s\\0=\'; '
    "done 2>/dev/null\n"
    f"[[ $__crab_f == '=%s\\0=' ]] || printf '\\0' >&{_FD}; unset __crab_n __crab_e __crab_f __crab_v\n"
    f"printf 'FUNCS\\0=' >&{_FD}; declare -f >&{_FD}\n"
    f"printf '\\0FUNCX\\0=' >&{_FD}; declare -F -x >&{_FD}\n"
    f"printf '\\0ALIASES\\0=' >&{_FD}; alias -p >&{_FD}\n"
    f"printf '\\0SETO\\0=' >&{_FD}; set +o >&{_FD}\n"
    f"printf '\\0SHOPT\\0=' >&{_FD}; shopt -p >&{_FD}\n"
    f"printf '\\0TRAPS\\0=' >&{_FD}; trap -p >&{_FD}\n"
    f"printf '\\0DIRS\\0' >&{_FD}; printf '=%s\\0' \"${{DIRSTACK[@]}}\" >&{_FD}\n"
    f"printf 'END\\0' >&{_FD}\n"
)


def _dec(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def _enc(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


@dataclass
class SessionState:
    cwd: str
    oldpwd: str = ""
    umask: str = "0022"
    env: dict[str, str] = field(default_factory=dict)
    variables: dict[str, str] = field(default_factory=dict)  # name -> `declare -p` statement
    functions: str = ""  # `declare -f` text
    exported_functions: list[str] = field(default_factory=list)
    aliases: str = ""  # `alias -p` text
    set_options: str = ""  # `set +o` text
    shopt_options: str = ""  # `shopt -p` text
    traps: str = ""  # `trap -p` text
    dirstack: list[str] = field(default_factory=list)
    # Read by crabd from /proc, not by the capture command (formats: runtime/session_os.py).
    # None: not recorded (a capture older than these fields, or /proc could not be read).
    limits: dict[str, list[int]] | None = None  # name -> [soft, hard], -1 = unlimited
    fds: list[dict[str, Any]] | None = None  # open descriptors beyond 0-2
    #: Named sessions captured with it: name -> :meth:`NamedCapture.to_obj` (see the module's docstring).
    named: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        # The fields themselves, not ``asdict``'s deep copy of them (json only reads them): a
        # copy cost ~2% of crabd's CPU per session turn, whose end serializes the state.
        fields = vars(self) if self.named else {k: v for k, v in vars(self).items() if k != "named"}
        return json.dumps(fields, sort_keys=True, ensure_ascii=True)

    @classmethod
    def from_json(cls, text: str) -> SessionState:
        try:
            data: Any = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("cwd"), str):
                raise ValueError("not a session state object")
            state = cls(**data)
        except (ValueError, TypeError) as exc:
            raise SessionStateError(f"invalid session state: {exc}") from exc
        state.named_captures()  # checked now: a stored state may come from an archive
        return state

    def named_captures(self) -> dict[str, NamedCapture]:
        """The named sessions captured with this state, checked."""
        if not isinstance(self.named, dict):
            raise SessionStateError("invalid session state: 'named' is not an object")
        return {name: NamedCapture.from_obj(name, obj) for name, obj in self.named.items()}

    def with_named(self, captures: dict[str, NamedCapture]) -> SessionState:
        """This state with ``captures`` as its named sessions (a shallow copy)."""
        return replace(self, named={name: c.to_obj() for name, c in sorted(captures.items())})


def named_pids(text: str | None) -> frozenset[int]:
    """The pids of the named sessions' bashes a stored state captured (none if it has no ``named``)."""
    if not text or '"named"' not in text:  # the common case, without parsing a big state
        return frozenset()
    try:
        named = json.loads(text).get("named")
    except (ValueError, AttributeError):
        return frozenset()
    if not isinstance(named, dict):
        return frozenset()
    return frozenset(v["pid"] for v in named.values() if isinstance(v, dict) and type(v.get("pid")) is int)


#: A named session's name (the service's check; repeated here for states read from storage).
NAMED_SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class NamedCapture:
    """A named session as a turn end captured it: its state, and what its bash was started with."""

    state: SessionState
    #: Its bash's pid inside the sandbox at the capture (the inspector leaves it out of the processes).
    pid: int
    #: Its output a pseudo-terminal of (rows, columns); None: pipes.
    pty: tuple[int, int] | None = None
    uid: int | None = None
    gid: int | None = None

    def to_obj(self) -> dict[str, Any]:
        state = {k: v for k, v in vars(self.state).items() if k != "named"}
        return {
            "state": state,
            "pid": self.pid,
            "pty": list(self.pty) if self.pty else None,
            "uid": self.uid,
            "gid": self.gid,
        }

    @classmethod
    def from_obj(cls, name: str, obj: Any) -> NamedCapture:
        """One entry of ``SessionState.named``, checked (SessionStateError if malformed)."""
        what = f"invalid session state of named session {name[:80]!r}"
        if not isinstance(name, str) or not NAMED_SESSION_RE.fullmatch(name):
            raise SessionStateError(f"invalid session state: bad named session name {str(name)[:80]!r}")
        if not isinstance(obj, dict) or set(obj) != {"state", "pid", "pty", "uid", "gid"}:
            raise SessionStateError(f"{what}: not an object of state, pid, pty, uid, gid")
        pty, ids = obj["pty"], (obj["pid"], obj["uid"], obj["gid"])
        if not all(v is None or (type(v) is int and 0 <= v < 1 << 32) for v in ids) or obj["pid"] is None:
            raise SessionStateError(f"{what}: pid, uid or gid is not a 32-bit number")
        if pty is not None and not (
            isinstance(pty, list) and len(pty) == 2 and all(type(v) is int and 1 <= v <= 0xFFFF for v in pty)
        ):
            raise SessionStateError(f"{what}: pty is not [rows, columns]")
        raw = obj["state"]
        if not isinstance(raw, dict) or "named" in raw:
            raise SessionStateError(f"{what}: its state is not a session state object")
        state = SessionState.from_json(json.dumps(raw))
        return cls(state, obj["pid"], (pty[0], pty[1]) if pty else None, obj["uid"], obj["gid"])


_SINGLE = frozenset(SECTIONS) - {"ENV", "VARS", "DIRS"}


def _sections(raw: bytes) -> dict[str, list[bytes]]:
    """The capture's sections, each a list of its items (the leading "=" removed)."""
    words = raw.split(b"\0")
    if len(words) < 3 or words[0] != b"STATE" or words[-2:] != [b"END", b""]:
        raise SessionStateError("session state capture is incomplete or garbled")
    sections: dict[str, list[bytes]] = {}
    current: list[bytes] | None = None
    for word in words[1:-2]:
        if word.startswith(b"="):
            if current is None:
                raise SessionStateError("session state capture has content before its first section")
            current.append(word[1:])
            continue
        name = word.decode("ascii", "replace")
        if name not in SECTIONS or name in sections:
            raise SessionStateError(f"session state capture has an unexpected section {name[:40]!r}")
        current = sections[name] = []
    for name in SECTIONS:
        if name not in sections:
            raise SessionStateError(f"session state capture lacks section {name}")
        if name in _SINGLE and len(sections[name]) != 1:
            raise SessionStateError(f"session state capture section {name} is garbled")
    if len(sections["VARS"]) % 2:
        raise SessionStateError("session state capture section VARS is garbled")
    return sections


def _exported_functions(text: str) -> list[str]:
    """Names from `declare -F -x` output ("declare -fx NAME" lines)."""
    out = []
    for line in text.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == "declare" and parts[1].startswith("-f") and "x" in parts[1]:
            out.append(parts[2])
    return out


def parse_state(raw: bytes) -> SessionState:
    """Parse what :data:`CAPTURE_COMMAND` wrote (the control channel's STATE record)."""
    sections = _sections(raw)

    def one(name: str) -> str:
        return _dec(sections[name][0])

    env: dict[str, str] = {}
    for item in sections["ENV"]:
        key, sep, value = item.partition(b"=")
        if sep and key != b"_" and not key.startswith(b"BASH_FUNC_"):
            env[_dec(key)] = _dec(value)
    variables: dict[str, str] = {}
    items = sections["VARS"]
    for j in range(0, len(items) - 1, 2):
        stmt = items[j + 1].rstrip(b"\n")
        if stmt:
            variables[_dec(items[j])] = _dec(stmt)
    return SessionState(
        cwd=one("CWD"),
        oldpwd=one("OLDPWD"),
        umask=one("UMASK").strip(),
        env=env,
        variables=variables,
        functions=one("FUNCS"),
        exported_functions=_exported_functions(one("FUNCX")),
        aliases=one("ALIASES"),
        set_options=one("SETO"),
        shopt_options="".join(line + "\n" for line in one("SHOPT").splitlines() if not line.endswith(READONLY_SHOPT)),
        traps=one("TRAPS"),
        dirstack=[_dec(d) for d in sections["DIRS"]],
    )


def _is_readonly(stmt: str) -> bool:
    """Whether a `declare -p` statement carries the readonly flag (``declare -r...``)."""
    parts = stmt.split(" ", 2)
    return len(parts) > 1 and parts[0] == "declare" and parts[1].startswith("-") and "r" in parts[1]


def _declare_in_order(stmt: str) -> str:
    """Assign first, then add case/readonly attributes.

    `declare -l` does not rewrite a value that was set before the attribute
    (``x=UPPER; declare -l x`` keeps "UPPER"); re-running bash's own
    ``declare -l x="UPPER"`` would lower it.  So the value goes in plain and
    the attributes follow.
    """
    parts = stmt.split(" ", 2)
    if len(parts) < 3 or parts[0] != "declare" or not parts[1].startswith("-"):
        return stmt
    flags = parts[1][1:]
    late = "".join(f for f in flags if f in "lur")
    if not late or "=" not in parts[2]:
        return stmt
    early = "".join(f for f in flags if f not in "lur")
    name = parts[2].split("=", 1)[0]
    return f"declare -{early or '-'} {parts[2]}\ndeclare -{late} {name}"


def bash_quote(text: str) -> str:
    """``$'...'`` quoting of arbitrary bytes (as surrogateescape text)."""
    out = []
    for byte in _enc(text):
        ch = chr(byte)
        if ch in "\\'":
            out.append("\\" + ch)
        elif 0x20 <= byte < 0x7F:
            out.append(ch)
        else:
            out.append(f"\\x{byte:02x}")
    return "$'" + "".join(out) + "'"


def render_restore_script(state: SessionState) -> str:
    """bash text that makes a fresh session's state equal ``state``."""
    keep = " ".join(bash_quote(k) for k in sorted(set(state.env) | set(state.variables)))
    lines = [
        # Exported variables the state does not have must go (a fresh bash
        # starts from the container's environment).
        f'for __crab_n in $(compgen -e); do case " {keep} " in *" $__crab_n "*) ;; *) '
        "case $__crab_n in " + _EXCLUDED_CASE + ') ;; *) unset "$__crab_n" 2>/dev/null;; esac;; esac; done; '
        "unset __crab_n",
    ]
    # `declare` at top level creates globals; readonly ones go last so
    # nothing later trips over them.
    for _name, stmt in sorted(state.variables.items(), key=lambda kv: _is_readonly(kv[1])):
        lines.append(_declare_in_order(stmt))
    for key, value in sorted(state.env.items()):
        if key not in state.variables:
            lines.append(f"export {key}={bash_quote(value)}")
    lines.append("unset -f $(compgen -A function) 2>/dev/null")
    if state.functions:
        lines.append(state.functions.rstrip("\n"))
    for name in state.exported_functions:
        lines.append(f"export -f {name}")
    lines.append("unalias -a")
    if state.aliases:
        lines.append(state.aliases.rstrip("\n"))
    if state.set_options:
        lines.append(state.set_options.rstrip("\n"))
    if state.shopt_options:
        lines.append(state.shopt_options.rstrip("\n"))
    lines.append("trap - EXIT")
    if state.traps:
        lines.append(state.traps.rstrip("\n"))
    lines.append(f"umask {state.umask}")
    lines.append("dirs -c")
    for d in reversed(state.dirstack[1:]):
        lines.append(f"pushd -n {bash_quote(d)} >/dev/null 2>&1 || :")
    if state.oldpwd:
        lines.append(f"cd -- {bash_quote(state.oldpwd)} 2>/dev/null || :")
    lines.append(
        f"cd -- {bash_quote(state.cwd)} 2>/dev/null || "
        f'{{ echo "crab: directory {state.cwd!r} is gone; session starts in /" >&2; cd /; }}'
    )
    lines.append(f"OLDPWD={bash_quote(state.oldpwd)}" if state.oldpwd else "unset OLDPWD")
    return "\n".join(lines) + "\n"
