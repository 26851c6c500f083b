"""Suggesting gift bundles: k products from a catalogue within a budget."""

from bundles.catalog import Product, load_catalog
from bundles.combos import choose
from bundles.search import best_bundle, bundles_within

__all__ = ["Product", "best_bundle", "bundles_within", "choose", "load_catalog"]
