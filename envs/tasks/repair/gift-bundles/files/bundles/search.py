"""Finding bundles of products that fit a budget."""

from __future__ import annotations

from typing import Sequence

from bundles.catalog import Product
from bundles.combos import choose


def bundles_within(products: Sequence[Product], size: int, budget_cents: int,
                   must_tag: str | None = None) -> list[tuple[Product, ...]]:
    """Bundles of ``size`` distinct products costing at most the budget.

    With ``must_tag``, every product in the bundle must carry that tag.
    Most expensive (best use of the budget) first; ties by product names.
    """
    pool = [p for p in products if p.cents <= budget_cents and (must_tag is None or must_tag in p.tags)]
    found = [tuple(c) for c in choose(pool, size) if sum(p.cents for p in c) <= budget_cents]
    return sorted(found, key=lambda b: (-sum(p.cents for p in b), [p.name for p in b]))


def best_bundle(products: Sequence[Product], size: int, budget_cents: int,
                must_tag: str | None = None) -> tuple[Product, ...] | None:
    found = bundles_within(products, size, budget_cents, must_tag)
    return found[0] if found else None


def describe(bundle: tuple[Product, ...]) -> str:
    total = sum(p.cents for p in bundle)
    names = " + ".join(p.name for p in bundle)
    return f"{names} = {total // 100}.{total % 100:02d}"
