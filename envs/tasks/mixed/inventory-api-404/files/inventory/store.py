"""The items, loaded once from a JSON file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Item:
    sku: str
    name: str
    category: str
    stock: int
    price_cents: int

    def to_json(self) -> dict[str, object]:
        return asdict(self)


class Inventory:
    def __init__(self, items: list[Item]) -> None:
        self._items = {i.sku: i for i in items}

    @classmethod
    def load(cls, path: str | Path) -> Inventory:
        rows = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls([Item(**row) for row in rows])

    def __len__(self) -> int:
        return len(self._items)

    def get(self, sku: str) -> Item:
        """The item with this SKU; KeyError if there is none."""
        return self._items[sku]

    def search(self, category: str | None = None, in_stock: bool = False) -> list[Item]:
        items = sorted(self._items.values(), key=lambda i: i.sku)
        if category is not None:
            items = [i for i in items if i.category == category]
        if in_stock:
            items = [i for i in items if i.stock > 0]
        return items
