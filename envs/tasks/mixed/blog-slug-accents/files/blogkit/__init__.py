"""The team blog's static-site helper."""

from blogkit.posts import Post, load_post
from blogkit.text import excerpt, reading_minutes, slugify

__all__ = ["Post", "excerpt", "load_post", "reading_minutes", "slugify"]
