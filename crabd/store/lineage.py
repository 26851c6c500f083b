"""What retention needs to know of a set of checkpoints: their shape in the lineage DAG, in one read.

Retention (``coordinator/retention.py``) decides which checkpoints of a
sandbox to thin from where each one stands, not from what it holds: who
descends from it (and from which sandbox), which sandbox stands on it,
whether it is pinned.  This module reads exactly that for the checkpoints
of some sandboxes (or of one owner), with the children of each found
through the ``checkpoints_parent`` index, so thinning one sandbox never
reads the whole catalog.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crabd.store.db import Database


@dataclass(frozen=True)
class Node:
    """One checkpoint as retention sees it."""

    id: str
    sandbox_id: str
    owner_uid: int
    parent_id: str | None
    #: The sandbox its parent belongs to ("" for a root or a parent that is gone).
    parent_sandbox: str
    created_at: float
    turn: int
    pinned: bool
    kept: bool
    #: Bytes it added to the store when it was taken (what its owner is charged: store/accounting.py).
    new_bytes: int


@dataclass
class Lineage:
    """The checkpoints asked about, with what points at them."""

    nodes: dict[str, Node] = field(default_factory=dict)
    #: Checkpoint id -> the sandboxes of the checkpoints whose parent it is (one entry per child).
    children: dict[str, list[str]] = field(default_factory=dict)
    #: Checkpoints some sandbox stands on now (``heads``).
    heads: set[str] = field(default_factory=set)
    #: Checkpoints some sandbox was forked from (``sandboxes.origin``).
    origins: set[str] = field(default_factory=set)


_NODE_SQL = (
    "SELECT c.id, c.sandbox_id, c.owner_uid, c.parent_id, COALESCE(p.sandbox_id, ''), c.created_at, c.turn,"
    " c.pinned, c.kept, CAST(COALESCE(json_extract(c.stats_json, '$.new_bytes'), 0) AS INTEGER)"
    " FROM checkpoints c LEFT JOIN checkpoints p ON p.id = c.parent_id"
)


def read(db: Database, *, sandbox_ids: list[str] | None = None, owner_uid: int | None = None) -> Lineage:
    """The lineage of the checkpoints of ``sandbox_ids`` that ``owner_uid`` owns (either filter may be left out)."""
    where, args = " WHERE 1=1", list[object]()
    if sandbox_ids is not None:
        marks = ",".join("?" * len(sandbox_ids))
        where += f" AND c.sandbox_id IN ({marks})"
        args += list(sandbox_ids)
    if owner_uid is not None:
        where += " AND c.owner_uid=?"
        args.append(owner_uid)
    out = Lineage()
    with db.lock:
        conn = db.conn
        for r in conn.execute(_NODE_SQL + where, args):
            parent = None if r[3] is None else str(r[3])
            out.nodes[str(r[0])] = Node(
                str(r[0]),
                str(r[1]),
                int(r[2]),
                parent,
                str(r[4]),
                float(r[5]),
                int(r[6]),
                bool(r[7]),
                bool(r[8]),
                int(r[9]),
            )
        ids = list(out.nodes)
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            q = f"SELECT parent_id, sandbox_id FROM checkpoints WHERE parent_id IN ({','.join('?' * len(chunk))})"
            for parent_id, sandbox_id in conn.execute(q, chunk):
                out.children.setdefault(str(parent_id), []).append(str(sandbox_id))
        out.heads = {str(r[0]) for r in conn.execute("SELECT checkpoint_id FROM heads") if r[0]}
        out.origins = {str(r[0]) for r in conn.execute("SELECT origin FROM sandboxes") if r[0]}
    return out


def split_by_owner(view: Lineage, owners: dict[str, int]) -> tuple[Lineage, Lineage]:
    """``view`` as (the nodes whose owner is their sandbox's in ``owners``, or whose sandbox is not
    there; the others), both sharing ``view``'s children, heads and origins."""
    own, foreign = (
        Lineage(children=view.children, heads=view.heads, origins=view.origins),
        Lineage(children=view.children, heads=view.heads, origins=view.origins),
    )
    for cid, n in view.nodes.items():
        mine = owners.get(n.sandbox_id, n.owner_uid) == n.owner_uid
        (own if mine else foreign).nodes[cid] = n
    return own, foreign
