"""A tiny read-only blog API: listing posts page by page."""

from blogapi.api import BadRequest, list_posts
from blogapi.paginate import Page, PageNotFound, page_count, paginate

__all__ = ["BadRequest", "Page", "PageNotFound", "list_posts", "page_count", "paginate"]
