"""python3 -m svcconf [FILE.ini]: the effective settings, one per line."""

import sys

from svcconf.loader import ConfigError, load


def main(argv: list[str]) -> int:
    try:
        settings = load(argv[0] if argv else None)
    except ConfigError as exc:
        print(f"svcconf: {exc}", file=sys.stderr)
        return 1
    for name, value in sorted(settings.values.items()):
        print(f"{name} = {value!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
