"""The semantic state of a session's bash: capture it cheaply, re-apply it to a fresh bash.

Captured (no process dump, a few ms): cwd and OLDPWD, umask, the exported
environment, every other shell variable with its attributes (arrays,
associative arrays, integer, readonly, nameref, ...), functions (and which
are exported), aliases, ``set -o`` and ``shopt`` options, traps, and the
directory stack.

Capture output format (what :data:`CAPTURE_COMMAND` prints on stdout)::

    capture  := section*  "\\x1eEND\\x1e"
    section  := "\\x1e" NAME "\\x1e" body
    NAME     := CWD | OLDPWD | UMASK | ENV | VARS | FUNCS | FUNCX | ALIASES | SETO | SHOPT | TRAPS | DIRS
    ENV      body: NUL-terminated "KEY=VALUE" items (from `env -0`)
    VARS     body: per variable: name NUL `declare -p name` output NUL
    FUNCX, DIRS body: NUL-terminated names / directories
    others   body: bash's own text (`umask`, `declare -f`, `alias -p`, `set +o`, `shopt -p`, `trap -p`)

Everything is re-applied with bash's own quoting, so values with newlines,
quotes, ``=`` or non-UTF-8 bytes round-trip exactly.  In Python, text is
decoded with ``surrogateescape``, and JSON keeps lone surrogates as
``\\udcXX`` escapes, so bytes survive storage too.

The bash's resource limits and open descriptors are not in the capture:
crabd reads them from /proc on the host and adds them (``limits``, ``fds``;
see ``session_os.py``).  Captures stored before these fields existed load
with them unset (None: not recorded).

Variables bash manages itself (dynamic, readonly or per-process: BASH*,
EUID, PPID, RANDOM, SECONDS, LINENO, PIPESTATUS, SHELLOPTS, ...) and crab's
own ``__crab_*`` helpers are neither captured nor restored; PWD and OLDPWD
are restored by ``cd``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from crabd.errors import SessionStateError

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

CAPTURE_COMMAND = (
    "printf '\\036CWD\\036%s' \"$PWD\"\n"
    "printf '\\036OLDPWD\\036%s' \"${OLDPWD-}\"\n"
    "printf '\\036UMASK\\036'; umask\n"
    "printf '\\036ENV\\036'; env -0\n"
    "printf '\\036VARS\\036'\n"
    "for __crab_n in $(compgen -v); do case $__crab_n in " + _EXCLUDED_CASE + ") continue;; esac; "
    "printf '%s\\0' \"$__crab_n\"; declare -p \"$__crab_n\" 2>/dev/null; printf '\\0'; done; unset __crab_n\n"
    "printf '\\036FUNCS\\036'; declare -f\n"
    "printf '\\036FUNCX\\036'; for __crab_n in $(compgen -A function); do "
    'case "$(declare -F -p "$__crab_n")" in \'declare -fx\'*) printf \'%s\\0\' "$__crab_n";; esac; done; '
    "unset __crab_n\n"
    "printf '\\036ALIASES\\036'; alias -p\n"
    "printf '\\036SETO\\036'; set +o\n"
    "printf '\\036SHOPT\\036'; shopt -p\n"
    "printf '\\036TRAPS\\036'; trap -p\n"
    "printf '\\036DIRS\\036'; printf '%s\\0' \"${DIRSTACK[@]}\"\n"
    "printf '\\036END\\036'\n"
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

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, ensure_ascii=True)

    @classmethod
    def from_json(cls, text: str) -> SessionState:
        try:
            data: Any = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("cwd"), str):
                raise ValueError("not a session state object")
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise SessionStateError(f"invalid session state: {exc}") from exc


def _split0(body: bytes) -> list[bytes]:
    items = body.split(b"\0")
    return items[:-1] if items and items[-1] == b"" else items


def parse_state(raw: bytes) -> SessionState:
    """Parse :data:`CAPTURE_COMMAND` output."""
    if not raw.endswith(b"\x1eEND\x1e") or not raw.startswith(b"\x1eCWD\x1e"):
        raise SessionStateError("session state capture is incomplete or garbled")
    sections: dict[str, bytes] = {}
    rest = raw[1 : -len(b"\x1eEND\x1e")]
    for i, name in enumerate(SECTIONS):
        head = name.encode() + b"\x1e"
        if not rest.startswith(head):
            raise SessionStateError(f"session state capture lacks section {name}")
        rest = rest[len(head) :]
        if i + 1 < len(SECTIONS):
            nxt = b"\x1e" + SECTIONS[i + 1].encode() + b"\x1e"
            at = rest.find(nxt)
            if at < 0:
                raise SessionStateError(f"session state capture lacks section {SECTIONS[i + 1]}")
            sections[name], rest = rest[:at], rest[at + 1 :]
        else:
            sections[name] = rest
    env: dict[str, str] = {}
    for item in _split0(sections["ENV"]):
        key, sep, value = item.partition(b"=")
        if sep and key != b"_" and not key.startswith(b"BASH_FUNC_"):
            env[_dec(key)] = _dec(value)
    variables: dict[str, str] = {}
    items = _split0(sections["VARS"])
    for j in range(0, len(items) - 1, 2):
        stmt = items[j + 1].rstrip(b"\n")
        if stmt:
            variables[_dec(items[j])] = _dec(stmt)
    return SessionState(
        cwd=_dec(sections["CWD"]),
        oldpwd=_dec(sections["OLDPWD"]),
        umask=_dec(sections["UMASK"]).strip(),
        env=env,
        variables=variables,
        functions=_dec(sections["FUNCS"]),
        exported_functions=[_dec(n) for n in _split0(sections["FUNCX"])],
        aliases=_dec(sections["ALIASES"]),
        set_options=_dec(sections["SETO"]),
        shopt_options="".join(
            line + "\n" for line in _dec(sections["SHOPT"]).splitlines() if not line.endswith(READONLY_SHOPT)
        ),
        traps=_dec(sections["TRAPS"]),
        dirstack=[_dec(d) for d in _split0(sections["DIRS"])],
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
