"""A list of items, saved as one line per item."""

from __future__ import annotations

from datetime import date
from typing import Iterable, Iterator

from tasklist.model import Item
from tasklist.parser import format_item, parse_item


class TodoList:
    def __init__(self, items: Iterable[Item] = ()) -> None:
        self.items = list(items)

    @classmethod
    def loads(cls, text: str) -> TodoList:
        return cls(parse_item(line) for line in text.splitlines() if line.strip())

    def dumps(self) -> str:
        return "".join(format_item(i) + "\n" for i in self.items)

    def add(self, line: str) -> Item:
        item = parse_item(line)
        self.items.append(item)
        return item

    def __iter__(self) -> Iterator[Item]:
        return iter(self.items)

    def by_tag(self, tag: str) -> list[Item]:
        tag = tag.lstrip("#").lower()
        return [i for i in self.items if tag in i.tags]

    def open_items(self) -> list[Item]:
        """Items not done, most urgent first: priority, then due date (undated last)."""
        return sorted((i for i in self.items if not i.done),
                      key=lambda i: (i.priority, i.due or date.max, i.title))

    def tags(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for item in self.items:
            for t in item.tags:
                counts[t] = counts.get(t, 0) + 1
        return dict(sorted(counts.items()))
