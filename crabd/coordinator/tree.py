"""The lineage of checkpoints and forks around one sandbox, for `crabctl tree`.

The tree holds every checkpoint that shares a root with the sandbox's own
checkpoints or with the checkpoint it was forked from: its ancestors in
other sandboxes, its branches after rollbacks, and every fork made from any
of them (with the forks' own checkpoints).  Sandboxes are attached to the
checkpoint their files currently descend from (their head).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from crabd.models import CheckpointRecord, SandboxRecord
from crabd.store.catalog import Catalog

#: Safety bound on one tree's size (the rest is reported as truncated).
MAX_NODES = 10_000


@dataclass
class TreeView:
    nodes: list[CheckpointRecord] = field(default_factory=list)
    #: sandbox id -> (record, head checkpoint id or "")
    sandboxes: dict[str, tuple[SandboxRecord, str]] = field(default_factory=dict)
    truncated: bool = False


def build_tree(
    catalog: Catalog,
    sandboxes: list[SandboxRecord],
    start: SandboxRecord | CheckpointRecord,
    visible: Callable[[CheckpointRecord], bool],
) -> TreeView:
    seeds: list[str] = []
    if isinstance(start, CheckpointRecord):
        seeds.append(start.id)
    else:
        seeds += [c.id for c in catalog.list_checkpoints(start.id, start.owner_uid)]
        if start.origin:
            seeds.append(start.origin)
        head = catalog.head(start.id)
        if head and head.checkpoint:
            seeds.append(head.checkpoint.id)
    roots: list[str] = []
    for s in seeds:
        chain = catalog.lineage(s)
        if chain and chain[0].id not in roots:
            roots.append(chain[0].id)
    view = TreeView()
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        cid = todo.pop(0)
        if cid in seen:
            continue
        if len(seen) >= MAX_NODES:
            view.truncated = True
            break
        seen.add(cid)
        rec = catalog.find(cid)
        if rec is None:
            continue
        if visible(rec):
            view.nodes.append(rec)
        todo.extend(c.id for c in catalog.children(cid))
    ids = {n.id for n in view.nodes}
    heads = catalog.head_ids()
    for sb in sandboxes:
        head_id = heads.get(sb.id, "")
        if head_id in ids or sb.origin in ids or (isinstance(start, SandboxRecord) and sb.id == start.id):
            view.sandboxes[sb.id] = (sb, head_id)
    return view
