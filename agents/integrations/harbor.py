"""Moved to :mod:`crabd.integrations.harbor` (in the package); this old path is kept for one release.

The old name becomes the new module itself (not a copy of its names), so
classes, private helpers and monkeypatching are the same through either.
"""

from __future__ import annotations

import sys
import warnings

from crabd.integrations import harbor as _moved

warnings.warn(
    "agents.integrations.harbor moved to crabd.integrations.harbor (the package ships it); "
    "the old import path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
