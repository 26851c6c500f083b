"""Adapters that run other agent frameworks' agents in crab sandboxes.

Each module imports its framework, which an extra of the ``crabd`` package
installs (crabd itself imports none of them)::

    pip install 'crabd[minisweagent]'   # crabd.integrations.minisweagent
    pip install 'crabd[harbor]'         # crabd.integrations.harbor (Python >= 3.12)

They talk to crabd through :mod:`crabd.sdk` only (an import-linter contract
in pyproject.toml keeps them off the daemon's layers).
"""
