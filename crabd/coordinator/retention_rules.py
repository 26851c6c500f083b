"""Which checkpoints a retention policy keeps, and why (pure: no I/O, no clock).

For each checkpoint of a sandbox the rules give the list of
:class:`~crabd.models.KeepReason` that keep it; an empty list means
retention thins it.  In order:

1. **Protections**, which no policy overrides:

   * ``pinned``: ``crabctl checkpoint pin``;
   * ``head``: a sandbox stands on it now (its next checkpoint's parent);
   * ``line-end``: nothing descends from it, so it is the newest state of
     some line (the current one, or one an in-place restore left behind);
   * ``fork-origin``: a sandbox was forked from it, or checkpoints of
     another sandbox descend from it;
   * ``branch-point``: two or more checkpoints descend from it;
   * ``root``: the sandbox's first checkpoint (nothing of the sandbox's
     before it: the state it was created or forked in);
   * ``in-use``: a restore, fork or export holds it right now;
   * ``kept``: its sandbox was removed with ``--keep-checkpoints`` (or its
     checkpoints were imported): retention applies to live sandboxes only.

2. **The policy** (the sandbox's own, else the daemon's default), each rule
   adding its reason, any of them keeping the checkpoint:

   * ``last``: the newest ``keep_last`` checkpoints;
   * ``hourly`` / ``daily``: the newest checkpoint of each of the newest
     ``keep_hourly`` hours / ``keep_daily`` days (UTC) that have one;
   * ``within``: every checkpoint younger than ``keep_within_s``.

   With no active policy everything is kept (``no-policy``).

"Newest" is by creation time (then id): a restore's new line continues the
sandbox's history, it does not restart the count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from crabd.models import KeepReason, RetentionPolicy
from crabd.store.lineage import Lineage, Node

#: What each checkpoint is kept for (empty: thin it).
Verdict = dict[str, list[KeepReason]]


def protections(node: Node, lineage: Lineage, in_use: set[str]) -> list[KeepReason]:
    """The reasons no policy can override that keep ``node`` (step 1 of the module doc)."""
    kids = lineage.children.get(node.id, [])
    out: list[KeepReason] = []
    if node.pinned:
        out.append(KeepReason.PINNED)
    if node.id in lineage.heads:
        out.append(KeepReason.HEAD)
    elif not kids:
        out.append(KeepReason.LINE_END)
    if node.id in lineage.origins or any(s != node.sandbox_id for s in kids):
        out.append(KeepReason.FORK_ORIGIN)
    if len(kids) >= 2:
        out.append(KeepReason.BRANCH_POINT)
    if node.parent_id is None or node.parent_sandbox != node.sandbox_id:
        out.append(KeepReason.ROOT)
    if node.id in in_use:
        out.append(KeepReason.IN_USE)
    return out


def selected(nodes: list[Node], policy: RetentionPolicy, now: float) -> dict[str, list[KeepReason]]:
    """What each rule of ``policy`` selects among one sandbox's ``nodes`` (step 2 of the module doc)."""
    out: dict[str, list[KeepReason]] = {n.id: [] for n in nodes}
    newest_first = sorted(nodes, key=lambda n: (n.created_at, n.id), reverse=True)
    for n in newest_first[: policy.keep_last]:
        out[n.id].append(KeepReason.LAST)
    for reason, count, width in (
        (KeepReason.HOURLY, policy.keep_hourly, 3600),
        (KeepReason.DAILY, policy.keep_daily, 86400),
    ):
        seen: set[int] = set()
        for n in newest_first:
            if len(seen) >= count:
                break
            bucket = int(n.created_at // width)
            if bucket not in seen:
                seen.add(bucket)
                out[n.id].append(reason)
    if policy.keep_within_s:
        for n in newest_first:
            if n.created_at < now - policy.keep_within_s:
                break
            out[n.id].append(KeepReason.WITHIN)
    return out


def verdict(
    lineage: Lineage,
    sandboxes: Iterable[str],
    policy_of: Callable[[str], RetentionPolicy | None],
    *,
    now: float,
    in_use: set[str] | None = None,
) -> Verdict:
    """Why each checkpoint of ``lineage`` is kept (empty: thinned).

    ``sandboxes`` are the live ones; ``policy_of`` gives a live sandbox's
    policy.  A checkpoint whose sandbox is not live is ``kept``.
    """
    live = set(sandboxes)
    held = in_use or set()
    out: Verdict = {}
    by_sandbox: dict[str, list[Node]] = {}
    for n in lineage.nodes.values():
        by_sandbox.setdefault(n.sandbox_id, []).append(n)
    for sandbox_id, nodes in by_sandbox.items():
        policy = policy_of(sandbox_id) if sandbox_id in live else None
        chosen = selected(nodes, policy, now) if policy is not None and policy.active else {}
        for n in nodes:
            reasons = protections(n, lineage, held)
            if sandbox_id not in live:
                reasons.append(KeepReason.KEPT)
            elif policy is None or not policy.active:
                reasons.append(KeepReason.NO_POLICY)
            else:
                reasons += chosen[n.id]
            out[n.id] = reasons
    return out


def to_thin(lineage: Lineage, result: Verdict) -> list[str]:
    """The checkpoints ``result`` keeps for no reason, oldest first."""
    doomed = [lineage.nodes[c] for c, reasons in result.items() if not reasons]
    return [n.id for n in sorted(doomed, key=lambda n: (n.created_at, n.id))]
