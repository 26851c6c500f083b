"""Where a benchmark's machine-readable results go: one JSON file, its parent made if needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(results: Any, out: str | Path) -> Path:
    """Write ``results`` as indented JSON to ``out``; return the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    return path
