"""Text from files and the environment, converted to each setting's type."""

from __future__ import annotations

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}


def coerce(name: str, text: str, default: object) -> object:
    """``text`` as the type of ``default``; ValueError names the setting."""
    value = text.strip()
    if isinstance(default, bool):
        low = value.lower()
        if low in TRUE:
            return True
        if low in FALSE:
            return False
        raise ValueError(f"{name}: not a boolean: {text!r}")
    if isinstance(default, int):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}: not an integer: {text!r}") from None
    return value
