"""Shell text and argv that clients built on the SDK share (the ROCK server, the SWE-ReX runtime).

Both answer a session command as one stream and write files with one-shot
commands; the text is the same for each, so it lives once, here.
"""

from __future__ import annotations

import shlex


def merged(command: str) -> str:
    """``command`` with its stderr in its stdout, run at the session's top level.

    A brace group, not a subshell: ``cd``, ``export`` and functions persist
    as when typed.  The newline before ``}`` ends a here-document or a
    comment on the command's last line.
    """
    return "{ " + command + "\n} 2>&1"


def sourced(path: str) -> str:
    """Session text that sources ``path``, its output merged (a session's startup files)."""
    return merged("source " + shlex.quote(path))


def write_file_argv(path: str) -> list[str]:
    """A one-shot command that writes its stdin to ``path`` in the sandbox, making the directory first."""
    return ["sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "sh", path]
