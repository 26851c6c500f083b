"""The host engine: schedules the checkpoint work of every sandbox on the host (see engine.py)."""

from __future__ import annotations

from crabd.engine.engine import HostEngine
from crabd.engine.jobs import Job, JobControl, JobState, Outcome, Priority

__all__ = ["HostEngine", "Job", "JobControl", "JobState", "Outcome", "Priority"]
