"""Moved to :mod:`crabd.integrations.minisweagent_data` (in the package); this old path is kept for one release."""

from __future__ import annotations

from agents.integrations import moved

moved(__name__, "crabd.integrations.minisweagent_data")
