"""The base of every crab error, :class:`CrabError`, and the registry of its classes by name.

Every error has a ``hint``: one sentence telling the user what to do next.
A class that carries data says so in a keyword-only constructor
(``SandboxBusy(message, sandbox=...)``), so mypy checks every raise site; the
constructor's keywords (less ``hint``) are the class's :attr:`CrabError.fields`.
Every subclass registers itself by name when it is defined; across gRPC an
error travels as a status code plus ``(kind, message, hint, attrs)`` details,
and the SDK re-raises the same class through the same constructor (see
:func:`error_class` and ``crabd.api.errors``).

A class registers when its module is imported; ``crabd/errors/__init__.py``
imports every module of the package, and Python runs it before any of them,
so whoever imports one error has them all registered
(``tests/unit/test_errors.py`` checks the package exports every class).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

#: Every CrabError class by name: the ``kind`` an error crosses gRPC under.
_REGISTRY: dict[str, type[CrabError]] = {}


class CrabError(Exception):
    """Base class of every error crab raises on purpose."""

    #: gRPC status code name used when this error crosses the wire.
    grpc_code: ClassVar[str] = "INTERNAL"
    #: Default advice; instances may override it.
    default_hint: ClassVar[str] = "Run `crabctl doctor` and check the crabd log."
    #: The data this class carries: its constructor's keywords less ``hint``
    #: (derived in ``__init_subclass__``, so the two cannot drift apart).
    fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Register ``cls`` under its name and derive its :attr:`fields`."""
        super().__init_subclass__(**kwargs)
        # Names are the wire's kinds: two classes of one name would re-raise as each other.
        known = _REGISTRY.get(cls.__name__)
        if known is not None and known.__module__ != cls.__module__:
            raise TypeError(f"CrabError {cls.__name__} is defined in {known.__module__} and {cls.__module__}")
        _REGISTRY[cls.__name__] = cls
        params = inspect.signature(cls.__init__).parameters.values()
        cls.fields = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name != "hint")

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint

    @property
    def attrs(self) -> dict[str, Any]:
        """The error's data, by field name (what crosses the wire besides message and hint)."""
        return {name: getattr(self, name) for name in self.fields}

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's default pickles only args, which the keyword-only constructors refuse.
        return _rebuild, (type(self), self.message, self.hint, self.attrs)

    def describe(self) -> str:
        """The message plus the hint, as shown to a person."""
        return f"{self.message}\nhint: {self.hint}" if self.hint else self.message


def _rebuild(cls: type[CrabError], message: str, hint: str, attrs: dict[str, Any]) -> CrabError:
    return cls(message, hint=hint, **attrs)


_REGISTRY[CrabError.__name__] = CrabError


def error_class(name: str) -> type[CrabError]:
    """The error class called ``name``, or :class:`CrabError` if unknown."""
    return _REGISTRY.get(name, CrabError)


def registered() -> dict[str, type[CrabError]]:
    """Every error class by name (a copy)."""
    return dict(_REGISTRY)
