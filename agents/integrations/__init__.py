"""Adapters of crab's task suites to RL frameworks (SkyRL-Gym, GEM), for a crab checkout.

The framework integrations that stand alone (mini-swe-agent, Harbor) moved to
:mod:`crabd.integrations`, in the installed package; their old names here are
deprecated aliases.  ``skyrl``, ``gem`` and ``textenv`` stay: they are built on
``agents.rl`` and the task suites under ``envs/tasks``, which only a checkout has.
"""
