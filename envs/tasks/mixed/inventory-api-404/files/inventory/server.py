"""The HTTP API (see docs/api.md): python3 -m inventory.server [--port N] [--data FILE]."""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from inventory.store import Inventory


class Handler(BaseHTTPRequestHandler):
    store: Inventory  # set by make_server

    def _send(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        parts = [p for p in url.path.split("/") if p]
        if parts == ["health"]:
            self._send(200, {"ok": True, "items": len(self.store)})
        elif parts == ["items"]:
            category = query.get("category", [None])[0]
            in_stock = query.get("in_stock", ["0"])[0] == "1"
            self._send(200, [i.to_json() for i in self.store.search(category, in_stock)])
        elif len(parts) == 2 and parts[0] == "items":
            item = self.store.get(parts[1])
            if item is None:
                self._send(404, {"error": "no such item", "sku": parts[1]})
            else:
                self._send(200, item.to_json())
        else:
            self._send(404, {"error": "not found"})

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        print(f"{self.address_string()} {format % args}", flush=True)


def make_server(store: Inventory, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"store": store})
    return ThreadingHTTPServer((host, port), handler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--data", default="data/items.json")
    args = ap.parse_args()
    server = make_server(Inventory.load(args.data), args.port)
    print(f"serving {args.data} on http://127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
