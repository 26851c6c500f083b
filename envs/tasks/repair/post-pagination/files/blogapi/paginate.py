"""Splitting a sequence into numbered pages (numbers start at 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")


class PageNotFound(LookupError):
    """A page number outside 1..page_count()."""


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    number: int
    pages: int
    total: int
    per_page: int

    @property
    def has_next(self) -> bool:
        return self.number < self.pages

    @property
    def has_prev(self) -> bool:
        return self.number > 1

    @property
    def first_index(self) -> int:
        """1-based position of the first item shown (0 when the page is empty)."""
        return (self.number - 1) * self.per_page + 1 if self.items else 0

    @property
    def last_index(self) -> int:
        """1-based position of the last item shown (0 when the page is empty)."""
        return self.first_index + len(self.items) - 1 if self.items else 0


def page_count(total: int, per_page: int) -> int:
    """How many pages ``total`` items fill; an empty listing still has one (empty) page."""
    if per_page < 1:
        raise ValueError(f"per_page must be at least 1, not {per_page}")
    if total < 0:
        raise ValueError(f"total cannot be negative ({total})")
    return total // per_page + 1


def paginate(items: Sequence[T], number: int, per_page: int) -> Page[T]:
    """Page ``number`` of ``items``, ``per_page`` items to a page."""
    pages = page_count(len(items), per_page)
    if not 1 <= number <= pages:
        raise PageNotFound(f"page {number} is out of range 1..{pages}")
    start = (number - 1) * per_page
    return Page(list(items[start : start + per_page]), number, pages, len(items), per_page)
