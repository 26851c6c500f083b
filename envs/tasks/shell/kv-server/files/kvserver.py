"""A tiny key-value server over HTTP; it keeps everything in memory."""

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DATA: dict[str, str] = {}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        key = self.path.lstrip("/")
        if key == "":
            body = "\n".join(sorted(DATA)).encode()
        elif key in DATA:
            body = DATA[key].encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        n = int(self.headers.get("Content-Length", "0"))
        DATA[self.path.lstrip("/")] = self.rfile.read(n).decode()
        self.send_response(204)
        self.end_headers()


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
