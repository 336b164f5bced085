"""A small threaded JSON-over-HTTP(S) server shared by the extender and the webhook.

The stdlib server is enough: the callers are one kube-scheduler and one kube-apiserver, which keep
connections alive (HTTP/1.1), and the work per call is a vector computation, not I/O. TLS is the
stdlib's, with the certificate files the operator provides.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

log = logging.getLogger(__name__)

MAX_BODY = 256 * 1024 * 1024  # a NodeList of 5,000 full nodes is tens of MiB

PostHandler = Callable[[str, bytes], tuple[int, Any]]
GetHandler = Callable[[], tuple[int, str, bytes]]


class RawJSON(bytes):
    """A handler's answer already encoded as JSON; sent as is (hot paths skip ``json.dumps``)."""


@dataclass
class Routes:
    """POST prefix → handler(rest_of_path, body) returning (status, JSON value);
    GET exact path → handler() returning (status, content type, body)."""

    post: dict[str, PostHandler]
    get: dict[str, GetHandler]
    on_connection: Callable[[], None] | None = None  # called once per accepted connection


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "qgpu"
    timeout = 120  # idle keep-alive connections are closed after this many seconds
    # Headers and body leave in two writes; with Nagle on, the peer's delayed ACK adds ~40 ms to
    # every keep-alive call.
    disable_nagle_algorithm = True
    routes: Routes

    def setup(self) -> None:
        # The TLS handshake runs here, in the connection's own thread, so one slow client cannot
        # stall the accept loop.
        if self.routes.on_connection is not None:
            self.routes.on_connection()
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(10)
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, value: Any) -> None:
        body = value if isinstance(value, RawJSON) else json.dumps(value, separators=(",", ":")).encode()
        self._send(status, "application/json", body)

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        handler = self.routes.get.get(self.path.split("?", 1)[0])
        if handler is None:
            self._json(404, {"Error": f"no GET route {self.path}"})
            return
        status, content_type, body = handler()
        self._send(status, content_type, body)

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True
            self._json(411 if "Content-Length" not in self.headers else 400, {"Error": "a request body with Content-Length is required"})
            return
        if length < 0 or length > MAX_BODY:
            self.close_connection = True
            self._json(413, {"Error": f"Content-Length {length}: must be within 0..{MAX_BODY}"})
            return
        body = self.rfile.read(length)
        for prefix, handler in self.routes.post.items():
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                rest = path[len(prefix):].strip("/")
                try:
                    status, value = handler(rest, body)
                except Exception:  # noqa: BLE001 - answer, log, keep serving
                    log.exception("handler for %s failed", path)
                    status, value = 500, {"Error": "internal error; see the server log"}
                self._json(status, value)
                return
        self._json(404, {"Error": f"no POST route {path}"})


class JsonServer:
    """Serves ``routes`` on host:port (TLS when cert and key are given) in a daemon thread."""

    def __init__(self, host: str, port: int, routes: Routes, cert_file: str | None = None, key_file: str | None = None):
        if bool(cert_file) != bool(key_file):
            raise ValueError("TLS needs both a certificate file and a private key file, or neither")
        handler = type("Handler", (_Handler,), {"routes": routes})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: log.debug("connection from %s failed", address, exc_info=True)  # type: ignore[method-assign]
        self.tls = bool(cert_file)
        if cert_file and key_file:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(cert_file, key_file)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.port = int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
