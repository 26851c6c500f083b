"""Lazy exports: a package's public names, each imported from its module on first use.

What a client imports is time at every ``crabctl`` call (docs/cli.md), so a
package such as ``crabd.sdk`` names everything it exports (``__all__``) but
imports the heavier modules only when one of their names is first read
(PEP 562's module ``__getattr__``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any


def lazy_exports(
    package: str, lazy: Mapping[str, str], names: Collection[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``lazy`` maps a name to the module that defines it.

    A name read once is kept in the package's namespace, so later reads are
    plain attribute lookups.  ``names`` (its ``__all__``) are listed by dir().
    """

    def __getattr__(name: str) -> Any:
        module = lazy.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
