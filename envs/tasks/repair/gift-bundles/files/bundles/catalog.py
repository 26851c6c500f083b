"""The catalogue: ``name; price in cents; tags`` lines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Product:
    name: str
    cents: int
    tags: frozenset[str] = frozenset()

    @property
    def price(self) -> str:
        return f"{self.cents // 100}.{self.cents % 100:02d}"


def load_catalog(lines: Iterable[str]) -> list[Product]:
    """Products in file order; duplicate names are an error."""
    products: list[Product] = []
    seen: set[str] = set()
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(";")]
        if len(parts) not in (2, 3):
            raise ValueError(f"line {number}: expected 'name; cents[; tags]'")
        name, cents = parts[0], parts[1]
        if not cents.isdigit():
            raise ValueError(f"line {number}: price must be whole cents, not {cents!r}")
        if name in seen:
            raise ValueError(f"line {number}: duplicate product {name!r}")
        seen.add(name)
        tags = frozenset(t for t in (parts[2].split(",") if len(parts) == 3 else []) if t)
        products.append(Product(name, int(cents), frozenset(t.strip() for t in tags)))
    return products
