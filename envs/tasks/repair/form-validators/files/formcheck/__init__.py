"""Declarative validation of submitted web forms."""

from formcheck.rules import is_int, matches, max_len, min_len, one_of, required
from formcheck.schema import Schema

__all__ = ["Schema", "is_int", "matches", "max_len", "min_len", "one_of", "required"]
