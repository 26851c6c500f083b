"""Adapters of crab's task suites to RL frameworks (SkyRL-Gym, GEM), for a crab checkout.

The framework integrations that stand alone (mini-swe-agent, Harbor) moved to
:mod:`crabd.integrations`, in the installed package; their old names here are
deprecated aliases.  ``skyrl``, ``gem`` and ``textenv`` stay: they are built on
``agents.rl`` and the task suites under ``envs/tasks``, which only a checkout has.
"""

from __future__ import annotations

import importlib
import sys
import warnings


def moved(old: str, new: str) -> None:
    """Make the module ``old`` the module ``new`` itself, with a DeprecationWarning (one release).

    The old name becomes the new module (not a copy of its names), so classes,
    private helpers and monkeypatching are the same through either.
    """
    module = importlib.import_module(new)
    warnings.warn(
        f"{old} moved to {new} (the package ships it); the old import path goes in the next release",
        DeprecationWarning,
        stacklevel=3,  # the importer of ``old``, as a module-level warn there would name
    )
    sys.modules[old] = module
