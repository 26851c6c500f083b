"""python3 -m blogkit CONTENT_DIR: every post, newest first, with its URL."""

from __future__ import annotations

import sys
from pathlib import Path

from blogkit.posts import load_post


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "content")
    posts = sorted((load_post(p) for p in root.glob("*.md")), key=lambda p: p.day, reverse=True)
    for p in posts:
        print(f"{p.day}  {p.url:<48} {p.minutes} min  {p.title}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
