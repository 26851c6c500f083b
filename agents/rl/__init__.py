"""Branchable crab environments for agentic RL: environments, policies, rollout strategies, tensors.

    from agents.rl import CrabEnv, Rollouts, ChatPolicy, to_tensors

See docs/rl.md.  ``to_tensors`` needs torch (the ``rl`` extra); the rest
needs only crab's SDK.
"""

from __future__ import annotations

from agents.rl.env import CrabEnv, EnvError, EnvGroup, Recovery, Snapshot, StepResult
from agents.rl.policy import ChatPolicy, OraclePolicy, Policy
from agents.rl.rollout import Rollouts, TreeBudget
from agents.rl.tensors import MissingTokenIds, group_advantages, to_tensors
from agents.rl.trajectory import Action, Generation, Ledger, Step, Trajectory

__all__ = [
    "Action",
    "ChatPolicy",
    "CrabEnv",
    "EnvError",
    "EnvGroup",
    "Generation",
    "Ledger",
    "MissingTokenIds",
    "OraclePolicy",
    "Policy",
    "Recovery",
    "Rollouts",
    "Snapshot",
    "Step",
    "StepResult",
    "Trajectory",
    "TreeBudget",
    "group_advantages",
    "to_tensors",
]
