"""A plain-text to-do list: ``Buy milk #home !2 @2024-05-01``."""

from tasklist.model import Item
from tasklist.parser import format_item, parse_item
from tasklist.store import TodoList

__all__ = ["Item", "TodoList", "format_item", "parse_item"]
