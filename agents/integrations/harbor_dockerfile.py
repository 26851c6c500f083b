"""Moved to :mod:`crabd.integrations.harbor_dockerfile` (in the package); this old path is kept for one release."""

from __future__ import annotations

from agents.integrations import moved

moved(__name__, "crabd.integrations.harbor_dockerfile")
