"""Short ids: a unique prefix of an id names the object, among the caller's own only.

As docker takes ``1a2b`` for a container whose id begins so, crabd takes a
prefix of a sandbox id (at least :data:`MIN_PREFIX` hex digits) or of a
checkpoint id (``ck-`` and at least as many) wherever a request names
one, once the whole id or name has matched nothing.  Only the caller's
own sandboxes and checkpoints are candidates (root's: all), so a prefix
never reveals that another uid's object exists; more than one candidate
is an :class:`~crabd.errors.AmbiguousReference` that lists them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from crabd.errors import AmbiguousReference

#: Fewest hex digits a prefix must have (fewer is taken as a name: a typo never picks a random sandbox).
MIN_PREFIX = 4

_SANDBOX = re.compile(rf"[0-9a-f]{{{MIN_PREFIX},}}")
_CHECKPOINT = re.compile(rf"ck-[0-9a-f]{{{MIN_PREFIX},}}")


def maybe_sandbox_prefix(ref: str) -> bool:
    return _SANDBOX.fullmatch(ref) is not None


def maybe_checkpoint_prefix(ref: str) -> bool:
    return _CHECKPOINT.fullmatch(ref) is not None


def unique(ref: str, ids: Iterable[str], kind: str, names: dict[str, str] | None = None) -> str | None:
    """The one of ``ids`` that begins with ``ref`` (None: none does); AmbiguousReference when several do."""
    hits = sorted(i for i in ids if i.startswith(ref))
    if len(hits) > 1:
        shown = ", ".join(f"{i} ({names[i]})" if names and i in names else i for i in hits[:10])
        more = f" and {len(hits) - 10} more" if len(hits) > 10 else ""
        raise AmbiguousReference(
            f"{ref!r} is the beginning of {len(hits)} {kind} ids: {shown}{more}",
            ref=ref,
            kind=kind,
            candidates=hits,
        )
    return hits[0] if hits else None
