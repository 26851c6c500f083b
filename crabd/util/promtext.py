"""Prometheus text exposition for crabd's labelled counters (one family, one label)."""

from __future__ import annotations

from collections.abc import Mapping


def labelled_counter(name: str, help_text: str, label: str, values: Mapping[str, int]) -> str:
    """``name``'s HELP and TYPE lines, then one sample per ``values`` entry, labelled ``label``."""
    return f"# HELP {name} {help_text}\n# TYPE {name} counter\n" + "".join(
        f'{name}{{{label}="{k}"}} {n}\n' for k, n in values.items()
    )
