"""The overlayfs implementation of :class:`~crabd.backends.fsdelta.FsDelta` (Docker's overlay2 upper dirs)."""

from __future__ import annotations
