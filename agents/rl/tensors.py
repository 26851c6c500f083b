"""Trajectories as torch tensors for a trainer (torch is the optional extra ``rl``).

:func:`to_tensors` lays a batch of B trajectories out as right-padded rows
of their generated tokens (every step's generation, in order)::

    token_ids    int64   [B, T]  generated token ids (pad_id after the end)
    logprobs     float32 [B, T]  their logprobs under the sampling policy (0 at padding)
    mask         bool    [B, T]  True on real tokens
    step         int64   [B, T]  the step each token belongs to (-1 at padding)
    shared       bool    [B, T]  True on tokens of the prefix inherited from the parent
    reward       float32 [B]     the verifier's reward
    solved       bool    [B]
    truncated    bool    [B]
    num_steps    int64   [B]
    branch_step  int64   [B]     steps shared with the parent (0: from reset)
    group        int64   [B]     rollout (tree/group) index, in order of first appearance
    parent       int64   [B]     row of the trajectory it branched from, -1 if not in the batch

A trainer computing group-relative advantages (GRPO) normalises ``reward``
within ``group``; ``shared`` lets it count a prefix's tokens once.  Prompts
are not tokenized here: ``messages`` (see :class:`Trajectory`) go through the
trainer's own chat template.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from agents.rl.trajectory import Trajectory

if TYPE_CHECKING:
    import torch


class MissingTokenIds(ValueError):
    """A generation came back without token ids (the server was not asked for them, or cannot give them)."""


def _require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise ImportError("agents.rl.tensors needs torch: install the extra with `pip install -e '.[rl]'`") from exc


def to_tensors(trajs: Sequence[Trajectory], *, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The batch as tensors (see the module docstring); MissingTokenIds if a step has no token ids."""
    _require_torch()
    import torch

    rows: list[tuple[list[int], list[float], list[int], list[bool]]] = []
    for t in trajs:
        ids: list[int] = []
        lps: list[float] = []
        steps: list[int] = []
        shared: list[bool] = []
        for s in t.steps:
            g = s.action.generation
            if g.completion_tokens and not g.token_ids:
                raise MissingTokenIds(
                    f"{t.id} step {s.index}: the server returned no token ids; with vLLM ask for "
                    "logprobs and return_tokens_as_token_ids (ChatPolicy does by default)"
                )
            ids += g.token_ids
            lps += g.logprobs if len(g.logprobs) == len(g.token_ids) else [0.0] * len(g.token_ids)
            steps += [s.index] * len(g.token_ids)
            shared += [s.index < t.branch_step] * len(g.token_ids)
        rows.append((ids, lps, steps, shared))
    b, width = len(rows), max((len(r[0]) for r in rows), default=0)
    out = {
        "token_ids": torch.full((b, width), pad_id, dtype=torch.int64),
        "logprobs": torch.zeros((b, width), dtype=torch.float32),
        "mask": torch.zeros((b, width), dtype=torch.bool),
        "step": torch.full((b, width), -1, dtype=torch.int64),
        "shared": torch.zeros((b, width), dtype=torch.bool),
    }
    for i, (ids, lps, steps, shared) in enumerate(rows):
        n = len(ids)
        out["token_ids"][i, :n] = torch.tensor(ids, dtype=torch.int64)
        out["logprobs"][i, :n] = torch.tensor(lps, dtype=torch.float32)
        out["mask"][i, :n] = True
        out["step"][i, :n] = torch.tensor(steps, dtype=torch.int64)
        out["shared"][i, :n] = torch.tensor(shared, dtype=torch.bool)
    groups: dict[str, int] = {}
    row_of = {t.id: i for i, t in enumerate(trajs)}
    out["reward"] = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    out["solved"] = torch.tensor([t.solved for t in trajs], dtype=torch.bool)
    out["truncated"] = torch.tensor([t.truncated for t in trajs], dtype=torch.bool)
    out["num_steps"] = torch.tensor([len(t.steps) for t in trajs], dtype=torch.int64)
    out["branch_step"] = torch.tensor([t.branch_step for t in trajs], dtype=torch.int64)
    out["group"] = torch.tensor([groups.setdefault(t.group, len(groups)) for t in trajs], dtype=torch.int64)
    out["parent"] = torch.tensor([row_of.get(t.parent, -1) for t in trajs], dtype=torch.int64)
    return out


def group_advantages(reward: torch.Tensor, group: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage: each reward minus its group's mean, over the group's standard deviation."""
    _require_torch()
    import torch

    adv = torch.zeros_like(reward)
    for g in torch.unique(group):
        sel = group == g
        r = reward[sel]
        std = r.std(unbiased=False) if r.numel() > 1 else torch.tensor(0.0)
        adv[sel] = (r - r.mean()) / (std + eps)
    return adv
