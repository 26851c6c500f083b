"""python3 scripts/get.py PATH [PORT]: GET one path of the local API, print the status and the JSON.

Exits 1 for an answer of 400 or more, 2 when nothing answers.
"""

import json
import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    path, port = argv[0], int(argv[1]) if len(argv) > 1 else 8765
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    except OSError as e:
        print(f"no answer: {e}", file=sys.stderr)
        return 2
    print(f"HTTP {status}")
    try:
        print(json.dumps(json.loads(body), indent=1))
    except ValueError:
        print(body.decode("utf-8", "replace")[:2000])
    return 0 if status < 400 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
