"""Posts: a front matter block, then Markdown."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from blogkit.text import excerpt, reading_minutes, slugify


class PostError(ValueError):
    pass


@dataclass(frozen=True)
class Post:
    title: str
    day: date
    body: str
    tags: tuple[str, ...] = field(default=())

    @property
    def slug(self) -> str:
        return slugify(self.title)

    @property
    def url(self) -> str:
        return f"/{self.day.year}/{self.slug}/"

    @property
    def summary(self) -> str:
        return excerpt(self.body)

    @property
    def minutes(self) -> int:
        return reading_minutes(self.body)


def parse_post(text: str, name: str = "<post>") -> Post:
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        raise PostError(f"{name}: no front matter")
    try:
        end = lines.index("---", 1)
    except ValueError:
        raise PostError(f"{name}: front matter not closed") from None
    meta: dict[str, str] = {}
    for line in lines[1:end]:
        key, sep, value = line.partition(":")
        if not sep:
            raise PostError(f"{name}: bad front matter line {line!r}")
        meta[key.strip()] = value.strip()
    if "title" not in meta or "date" not in meta:
        raise PostError(f"{name}: title and date are required")
    tags = tuple(t.strip() for t in meta.get("tags", "").split(",") if t.strip())
    return Post(meta["title"], date.fromisoformat(meta["date"]), "\n".join(lines[end + 1 :]).strip(), tags)


def load_post(path: Path) -> Post:
    return parse_post(path.read_text(encoding="utf-8"), path.name)
