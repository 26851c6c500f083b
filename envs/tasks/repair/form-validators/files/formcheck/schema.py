"""A schema: for each field, the rules its value must pass."""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from formcheck.rules import Rule

Check = Callable[[Mapping[str, str]], Optional[tuple[str, str]]]


class Schema:
    """``Schema({"age": [required(), is_int(0, 150)]})``.

    The rules are compiled once into a flat list of checks; each check looks
    at the submitted data and returns ``(field, message)`` or None.  For each
    field only the first failing rule is reported.
    """

    def __init__(self, fields: Mapping[str, list[Rule]]) -> None:
        self.fields = dict(fields)
        self._checks = self._compile()

    def _compile(self) -> list[Check]:
        checks: list[Check] = []
        for name, rules in self.fields.items():
            for rule in rules:
                def check(data: Mapping[str, str]) -> tuple[str, str] | None:
                    message = rule(data.get(name))
                    return (name, message) if message else None
                checks.append(check)
        return checks

    def errors(self, data: Mapping[str, str]) -> dict[str, str]:
        """``{field: message}`` for every invalid field; empty when the data is valid."""
        found: dict[str, str] = {}
        for check in self._checks:
            result = check(data)
            if result is not None and result[0] not in found:
                found[result[0]] = result[1]
        return found

    def clean(self, data: Mapping[str, str]) -> dict[str, str]:
        """The known fields, stripped; raises ValueError listing every error."""
        errors = self.errors(data)
        if errors:
            raise ValueError("; ".join(f"{k} {v}" for k, v in errors.items()))
        return {k: data[k].strip() for k in self.fields if data.get(k) is not None}
