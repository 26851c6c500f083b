"""``.env`` files: ``KEY=value`` lines, ``# comments``, optional ``export``, quotes."""

from __future__ import annotations

import re

_LINE = re.compile(r"^(?:export\s+)?(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*=\s*(?P<value>.*)$")


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        inner = value[1:-1]
        return inner.replace("\\n", "\n").replace('\\"', '"') if value[0] == '"' else inner
    # an unquoted value ends at an inline comment
    return re.split(r"\s+#", value, maxsplit=1)[0].strip()


def parse_dotenv(text: str) -> dict[str, str]:
    """The variables a .env file defines; a malformed line raises ValueError with its number."""
    env: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError(f".env line {number}: expected KEY=value, got {raw!r}")
        env[m.group("key")] = _unquote(m.group("value"))
    return env
