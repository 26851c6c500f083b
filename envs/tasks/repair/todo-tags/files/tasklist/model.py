"""One to-do item."""

from __future__ import annotations

from datetime import date, timedelta


class Item:
    """A to-do item with a title, tags, a priority (1 = highest) and an optional due date."""

    def __init__(self, title: str, tags: list[str] = [], priority: int = 3, due: date | None = None,
                 done: bool = False) -> None:
        if not title.strip():
            raise ValueError("an item needs a title")
        if not 1 <= priority <= 5:
            raise ValueError(f"priority must be 1..5, not {priority}")
        self.title = title.strip()
        self.tags = tags
        self.priority = priority
        self.due = due
        self.done = done

    def tag(self, name: str) -> None:
        """Add a tag (lower-cased, without the leading #); adding one twice is a no-op."""
        name = name.lstrip("#").lower()
        if not name:
            raise ValueError("empty tag")
        if name not in self.tags:
            self.tags.append(name)

    def untag(self, name: str) -> None:
        name = name.lstrip("#").lower()
        if name in self.tags:
            self.tags.remove(name)

    def repeat(self, every: timedelta) -> Item:
        """The next occurrence of a recurring item: same title, tags and priority, not done."""
        due = self.due + every if self.due else None
        return Item(self.title, self.tags, self.priority, due)

    def __repr__(self) -> str:
        return f"Item({self.title!r}, tags={self.tags!r}, priority={self.priority}, due={self.due}, done={self.done})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Item):
            return NotImplemented
        return (self.title, self.tags, self.priority, self.due, self.done) == (
            other.title, other.tags, other.priority, other.due, other.done)
