"""A local plain-HTTP server for client-side benchmarks: it answers every request at once, in
threads of its own, with one fixed status and JSON body, and keeps the last request's JSON body
(what a watch would then show). The calling thread's CPU time is then the client's alone.

Used by bench/kube_hotcalls.py (a Lease for every call) and bench/extender_inprocess.py (the
Binding's Status, and the Binding itself for the watch stage).
"""

from __future__ import annotations

import http.server
import json
import socketserver
import threading
from typing import Any


class AnsweringServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True

    def __init__(self, answer: bytes, status: int = 201) -> None:
        self.answer, self.status = answer, status
        self.last: Any = {}
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> "AnsweringServer":
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no delayed-ACK stall
    server: AnsweringServer

    def answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if body:
            self.server.last = json.loads(body)
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.server.answer)))
        self.end_headers()
        self.wfile.write(self.server.answer)

    do_POST = do_PUT = do_GET = answer  # noqa: N815 (http.server's names)

    def log_message(self, *args: object) -> None:
        pass
