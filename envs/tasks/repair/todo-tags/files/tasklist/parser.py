"""The one-line text format: ``[x] Title words #tag !priority @due-date``."""

from __future__ import annotations

from datetime import date

from tasklist.model import Item


def parse_item(line: str) -> Item:
    done = False
    text = line.strip()
    if text.startswith("[x] ") or text.startswith("[X] "):
        done, text = True, text[4:]
    elif text.startswith("[ ] "):
        text = text[4:]
    words, tags, priority, due = [], [], 3, None
    for word in text.split():
        if word.startswith("#") and len(word) > 1:
            tags.append(word)
        elif word.startswith("!") and word[1:].isdigit():
            priority = int(word[1:])
        elif word.startswith("@") and len(word) == 11:
            try:
                due = date.fromisoformat(word[1:])
            except ValueError:
                words.append(word)
        else:
            words.append(word)
    item = Item(" ".join(words), priority=priority, due=due, done=done)
    for tag in tags:
        item.tag(tag)
    return item


def format_item(item: Item) -> str:
    parts = ["[x]" if item.done else "[ ]", item.title]
    parts += [f"#{t}" for t in item.tags]
    if item.priority != 3:
        parts.append(f"!{item.priority}")
    if item.due:
        parts.append(f"@{item.due.isoformat()}")
    return " ".join(parts)
