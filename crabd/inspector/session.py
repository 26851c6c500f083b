"""How a session's captured state differs from the head's: the decision's "session" reason.

The state is the JSON of ``runtime/session_state.py`` (cwd, environment,
shell variables and options, limits and descriptors read from /proc).
"""

from __future__ import annotations

import json


def session_change(now: str | None, before: str | None) -> str:
    """Why the session's state at the turn end differs from the head's ("" if it does not, for a restore)."""
    if now == before or now is None:
        return ""
    if before is None:
        return "the session's state was never checkpointed"
    try:
        a, b = json.loads(now), json.loads(before)
    except ValueError:
        return "the session's state changed"
    parts = []
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
