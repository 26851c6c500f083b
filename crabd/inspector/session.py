"""How a session's captured state differs from the head's: the decision's "session" reason.

The state is the JSON of ``runtime/session_state.py`` (cwd, environment,
shell variables and options, limits and descriptors read from /proc), with
the named sessions captured with it under ``named``: their states and how
they were started; a bash's pid is not part of its state (a restore starts
a new one).
"""

from __future__ import annotations

import json
from typing import Any


def session_change(now: str | None, before: str | None) -> str:
    """Why the session's state at the turn end differs from the head's ("" if it does not, for a restore)."""
    if now == before or now is None:
        return ""
    if before is None:
        return "the session's state was never checkpointed"
    try:
        a: Any = json.loads(now)
        b: Any = json.loads(before)
    except ValueError:
        return "the session's state changed"
    if not isinstance(a, dict) or not isinstance(b, dict):
        return "the session's state changed"
    a, b = _without_pids(a), _without_pids(b)
    parts = []
    named_a, named_b = a.get("named", {}), b.get("named", {})
    if named_a != named_b:
        if not isinstance(named_a, dict) or not isinstance(named_b, dict):
            parts.append("named sessions")
        else:
            names = sorted(k for k in set(named_a) | set(named_b) if named_a.get(k) != named_b.get(k))
            parts.append("named sessions " + ", ".join(names[:5]) + (" ..." if len(names) > 5 else ""))
    if a.get("cwd") != b.get("cwd"):
        parts.append(f"cwd {b.get('cwd')} -> {a.get('cwd')}")
    env_a, env_b = a.get("env", {}), b.get("env", {})
    diff = sorted(k for k in set(env_a) | set(env_b) if env_a.get(k) != env_b.get(k))
    if diff:
        parts.append("env " + ", ".join(diff[:5]) + (" ..." if len(diff) > 5 else ""))
    for key in ("variables", "functions", "aliases", "set_options", "shopt_options", "traps", "umask", "dirstack"):
        if a.get(key) != b.get(key):
            parts.append(key)
    # The bash's resource limits and open descriptors (read from /proc; see runtime/session_os.py).
    # Unrecorded (None) counts as a change: a restore could not tell what to give back.
    lim_a, lim_b = a.get("limits"), b.get("limits")
    if lim_a != lim_b:
        if isinstance(lim_a, dict) and isinstance(lim_b, dict):
            names = sorted(k for k in set(lim_a) | set(lim_b) if lim_a.get(k) != lim_b.get(k))
            parts.append("limits " + ", ".join(names[:5]))
        else:
            parts.append("limits")
    from crabd.runtime.session_os import descriptors_changed

    fds = descriptors_changed(now, before) if a.get("fds") is not None else ""
    if fds or (a.get("fds") is None) != (b.get("fds") is None):
        parts.append(fds or "open descriptors")
    if not parts and {k: v for k, v in a.items() if k != "fds"} == {k: v for k, v in b.items() if k != "fds"}:
        return ""  # only pipe or socket inode numbers differ (new ones after every restore)
    return "session changed: " + ("; ".join(parts) if parts else "state")


def _without_pids(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its named sessions' pids left out."""
    named = state.get("named")
    if not isinstance(named, dict):
        return state
    return {**state, "named": {k: {**v, "pid": None} if isinstance(v, dict) else v for k, v in named.items()}}
