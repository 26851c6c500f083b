"""A small HTTP router: forwards GET requests to backends by path prefix.

    python3 router.py PORT

Routes live in memory and are managed at run time through the admin API:
    PUT    /_admin/routes/<prefix>   body: backend base URL (e.g. http://127.0.0.1:9000)
    DELETE /_admin/routes/<prefix>
    GET    /_admin/routes            JSON {prefix: backend}
    GET    /_admin/stats             JSON {prefix: requests forwarded}
A request for /<prefix>/rest is forwarded to <backend>/rest (longest prefix wins).
"""

import json
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTES: dict[str, str] = {}
HITS: dict[str, int] = {}
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/_admin/routes":
            with LOCK:
                return self.reply(200, json.dumps(ROUTES, sort_keys=True).encode())
        if self.path == "/_admin/stats":
            with LOCK:
                return self.reply(200, json.dumps(HITS, sort_keys=True).encode())
        with LOCK:
            match = max((p for p in ROUTES if self.path == p or self.path.startswith(p + "/")), key=len, default=None)
            if match is None:
                return self.reply(404, b'{"error": "no route"}')
            HITS[match] = HITS.get(match, 0) + 1
            target = ROUTES[match] + (self.path[len(match):] or "/")
        try:
            with urllib.request.urlopen(target, timeout=10) as r:
                self.reply(r.status, r.read(), r.headers.get("Content-Type", "application/octet-stream"))
        except urllib.error.HTTPError as e:
            self.reply(e.code, e.read())
        except OSError as e:
            self.reply(502, json.dumps({"error": str(e)}).encode())

    def do_PUT(self) -> None:
        if not self.path.startswith("/_admin/routes/"):
            return self.reply(405, b"{}")
        prefix = "/" + self.path[len("/_admin/routes/"):].strip("/")
        n = int(self.headers.get("Content-Length", "0"))
        with LOCK:
            ROUTES[prefix] = self.rfile.read(n).decode().strip().rstrip("/")
        self.reply(200, json.dumps({prefix: ROUTES[prefix]}).encode())

    def do_DELETE(self) -> None:
        prefix = "/" + self.path[len("/_admin/routes/"):].strip("/")
        with LOCK:
            ROUTES.pop(prefix, None)
        self.reply(200, b"{}")


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
