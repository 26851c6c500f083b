"""User names.

People type their names in every way Unicode allows, so two names are the
same name when they are equal after compatibility normalisation (NFKC:
full-width ``ｊｏｅ`` is ``joe``, the ligature ``ﬁ`` is ``fi``) and full
Unicode case folding (``Straße`` is ``STRASSE``).  ``canonical()`` computes
that comparison key; the name as typed is kept for display.
"""

from __future__ import annotations

import unicodedata

MIN_LEN = 3
MAX_LEN = 24
_ALLOWED_PUNCT = "._-"


class InvalidName(ValueError):
    """A name that cannot be registered."""


def canonical(name: str) -> str:
    """The key under which ``name`` is stored and looked up."""
    return unicodedata.normalize("NFC", name.strip()).lower()


def validate(name: str) -> str:
    """The name as it will be displayed (trimmed), or InvalidName saying what is wrong."""
    display = unicodedata.normalize("NFC", name.strip())
    key = canonical(display)
    if not MIN_LEN <= len(key) <= MAX_LEN:
        raise InvalidName(f"{display!r}: must be {MIN_LEN} to {MAX_LEN} characters long")
    for ch in key:
        if ch.isalnum() or ch in _ALLOWED_PUNCT:
            continue
        raise InvalidName(f"{display!r}: character {ch!r} ({unicodedata.name(ch, '?')}) is not allowed")
    if key[0] in _ALLOWED_PUNCT or key[-1] in _ALLOWED_PUNCT:
        raise InvalidName(f"{display!r}: must start and end with a letter or digit")
    return display
