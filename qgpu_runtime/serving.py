"""A small threaded JSON-over-HTTP(S) server shared by the extender and the webhook.

The stdlib server is enough: the callers are one kube-scheduler and one kube-apiserver, which keep
connections alive (HTTP/1.1), and the work per call is a vector computation, not I/O. TLS is the
stdlib's, with the certificate files the operator provides.

Anything that can reach the port can also be slow or greedy, and one thread per connection makes
that cheap to exploit. So (:class:`ServerLimits`):

- at most ``max_connections`` connections; a new one past the cap closes the connection that has
  waited longest on its client (in the TLS handshake, idle between requests, or sending a request
  line, headers or body: time the client spends, not the server), and is refused only when every
  connection is being handled or answered. So connections that announce a body and send nothing
  cannot keep a caller out: each newcomer closes the oldest of them;
- deadlines, not per-read timeouts (a client sending a byte every few seconds never trips those):
  ``idle_timeout_s`` to start a request, ``header_timeout_s`` for its headers, a body deadline
  that grows with Content-Length at ``min_body_rate`` bytes/s, ``write_timeout_s`` to take the
  answer; a watchdog thread shuts the socket of any connection past its deadline;
- at most ``body_budget`` bytes of request bodies held at once (a 503 past it), reserved chunk by
  chunk as the bytes are read: the first chunk is ``read_chunk``, each next one as large as what
  already arrived, so with a small ``read_chunk`` (the webhook: 64 KiB) a client that announces
  megabytes and sends nothing holds one chunk, and one that sent N bytes holds at most 2N. The
  default reads (and reserves) the whole body at once: splitting a 1.3 MB body costs ~2 ms more
  on loopback, which the extender's latency budget cannot spare, and only kube-scheduler's
  certificate reaches its bodies. At most ``max_in_flight`` requests are decoded and
  handled at once (a 503 after ``busy_wait_s``), and only once their body is fully read: decoding
  JSON multiplies a body's size several times, so that is where the count is kept small;
- a body limit per path (:attr:`Routes.body_limits`), sized to what its caller sends, checked
  against Content-Length before a byte of the body is read, and a JSON token limit per path
  (:attr:`Routes.token_limits`), checked on the read body before any decoding: a 3 MiB body of
  ``[{},{},...]`` decodes to ~80 MiB of Python objects, a count of ``{ [ , :`` bounds that.

:class:`ServerStats` is the server's own accounting (peak body bytes held, refusals by reason),
for tests and benchmarks that must not rely on a stopwatch.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping

log = logging.getLogger(__name__)

MAX_BODY = 256 * 1024 * 1024  # a NodeList of 5,000 full nodes is tens of MiB
READ_CHUNK = 64 * 1024  # a small first chunk: what a client that sends nothing can hold
# Phases in which a connection waits on its client; one of them may be closed for a newcomer.
CLIENT_PHASES = frozenset({"handshake", "idle", "headers", "body"})

PostHandler = Callable[[str, bytes], tuple[int, Any]]
GetHandler = Callable[[], tuple[int, str, bytes]]


class RawJSON(bytes):
    """A handler's answer already encoded as JSON; sent as is (hot paths skip ``json.dumps``)."""


@dataclass
class Routes:
    """POST prefix → handler(rest_of_path, body) returning (status, JSON value);
    GET exact path → handler() returning (status, content type, body).
    ``body_limits``: exact POST path → the largest body accepted there (others: ``MAX_BODY``)."""

    post: dict[str, PostHandler]
    get: dict[str, GetHandler]
    on_connection: Callable[[], None] | None = None  # called once per accepted connection
    body_limits: Mapping[str, int] = field(default_factory=dict)
    # exact POST path → the most JSON tokens (bytes among ``{ [ , :``) its body may hold, counted
    # before the handler decodes it: what bounds the decoded objects' memory (others: no limit).
    token_limits: Mapping[str, int] = field(default_factory=dict)
    # With client-certificate authentication: GET paths answered without a client certificate
    # (kubelet's probes present none). Every other path needs one.
    open_paths: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ServerLimits:
    """How much one server gives its clients; see the module docstring. ``idle_timeout_s`` stays
    above the 90 s Go's HTTP client keeps idle connections, or kube-scheduler would race the
    close with a POST it cannot retry."""

    max_connections: int = 256
    max_in_flight: int = 16
    idle_timeout_s: float = 120.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    min_body_rate: float = 1024 * 1024
    write_timeout_s: float = 30.0
    busy_wait_s: float = 5.0
    body_budget: int = 512 * 1024 * 1024
    watch_interval_s: float = 0.5
    read_chunk: int = MAX_BODY  # the first body chunk read and reserved; see the module docstring

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"ServerLimits.{name}={value!r}: must be > 0")


@dataclass
class ServerStats:
    """What the server refused and held, by its own count (thread-safe increments under a lock)."""

    body_bytes_peak: int = 0  # the most request-body bytes held at once
    refused_too_large: int = 0  # 413: Content-Length past the path's limit, or too many JSON tokens
    refused_budget: int = 0  # 503: the body budget was spent
    refused_busy: int = 0  # 503: no handler slot within busy_wait_s
    refused_unauthenticated: int = 0  # 401: no client certificate on a path that needs one
    incomplete_bodies: int = 0  # the client left, or was closed, before its body was in
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


@dataclass
class _Connection:
    sock: socket.socket
    # "handshake", "idle", "headers", "body" (the client's time: see CLIENT_PHASES), "working", "writing"
    phase: str
    deadline: float | None  # monotonic; None while the handler works (our time, not the client's)
    since: float


class _Connections:
    """Every open connection with its phase and deadline; the watchdog and the accept loop use it."""

    def __init__(self, limits: ServerLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[int, _Connection] = {}
        self.refused = 0
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def admit(self, sock: socket.socket) -> bool:
        """Take a new connection (idle until its first request), making room if at the cap."""
        now = self._clock()
        with self._lock:
            if len(self._open) >= self.limits.max_connections:
                waiting = [c for c in self._open.values() if c.phase in CLIENT_PHASES]
                if not waiting:
                    self.refused += 1
                    return False
                oldest = min(waiting, key=lambda c: c.since)
                del self._open[id(oldest.sock)]  # its thread finds the socket shut and ends
                _shut(oldest.sock)
                self.evicted += 1
            # handshake or first request line: the header deadline covers both (setup() sets it
            # again for TLS; a plain connection's first request line gets the same deadline)
            self._open[id(sock)] = _Connection(sock, "handshake", now + self.limits.header_timeout_s, now)
        return True

    def phase(self, sock: socket.socket, phase: str, timeout_s: float | None) -> None:
        now = self._clock()
        with self._lock:
            conn = self._open.get(id(sock))
            if conn is None:  # evicted: the socket is already shut
                return
            conn.phase = phase
            conn.since = now
            conn.deadline = None if timeout_s is None else now + timeout_s

    def leave(self, sock: socket.socket) -> None:
        with self._lock:
            conn = self._open.get(id(sock))
            if conn is not None and conn.sock is sock:
                del self._open[id(sock)]

    def expire(self) -> None:
        """Shut every connection past its deadline (its blocked read or write then fails)."""
        now = self._clock()
        with self._lock:
            late = [c for c in self._open.values() if c.deadline is not None and now >= c.deadline]
            for conn in late:
                del self._open[id(conn.sock)]
                self.expired += 1
        for conn in late:
            log.debug("closing a connection %.1fs into phase %s: past its deadline", now - conn.since, conn.phase)
            _shut(conn.sock)


class _Budget:
    """Bytes that may be reserved at once; reservations never wait. Records its peak in ``stats``."""

    def __init__(self, total: int, stats: ServerStats) -> None:
        self._total = total
        self._left = total
        self._lock = threading.Lock()
        self._stats = stats

    def reserve(self, n: int) -> bool:
        with self._lock:
            if n > self._left:
                return False
            self._left -= n
            held = self._total - self._left
            if held > self._stats.body_bytes_peak:
                self._stats.body_bytes_peak = held
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self._left += n


def _shut(sock: socket.socket) -> None:
    try:
        # the plain socket's shutdown, also for TLS sockets: SSLSocket.shutdown would drop the
        # TLS state under the thread still using it
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its thread


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "qgpu"
    # Headers and body leave in two writes; with Nagle on, the peer's delayed ACK adds ~40 ms to
    # every keep-alive call.
    disable_nagle_algorithm = True
    routes: Routes
    limits: ServerLimits
    connections: _Connections
    in_flight: threading.BoundedSemaphore
    bodies: _Budget
    stats: ServerStats
    client_auth: bool
    peer_certified: bool  # this connection's handshake verified a client certificate (set in setup)

    def setup(self) -> None:
        # The TLS handshake runs here, in the connection's own thread, so one slow client cannot
        # stall the accept loop; it gets the header deadline, and until it ends the connection
        # may be closed for a newcomer (a client that never finishes it holds no slot).
        if self.routes.on_connection is not None:
            self.routes.on_connection()
        self.timeout = self.limits.idle_timeout_s  # a backstop; the watchdog's deadlines are what bind
        self.peer_certified = False
        if isinstance(self.request, ssl.SSLSocket):
            self.connections.phase(self.request, "handshake", self.limits.header_timeout_s)
            self.request.settimeout(self.limits.header_timeout_s)
            self.request.do_handshake()
            # Once per connection, not per request (getpeercert decodes the certificate each call):
            # the context refuses renegotiation and never asks for a certificate after the
            # handshake, so what the handshake verified holds for the connection's life.
            self.peer_certified = bool(self.client_auth and self.request.getpeercert())
        super().setup()

    def handle_one_request(self) -> None:
        self.connections.phase(self.request, "idle", self.limits.idle_timeout_s)
        super().handle_one_request()

    def parse_request(self) -> bool:
        # called once the request line is in: the headers now have their own deadline
        self.connections.phase(self.request, "headers", self.limits.header_timeout_s)
        return super().parse_request()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.connections.phase(self.request, "writing", self.limits.write_timeout_s)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, value: Any) -> None:
        body = value if isinstance(value, RawJSON) else json.dumps(value, separators=(",", ":")).encode()
        self._send(status, "application/json", body)

    def _authenticated(self, path: str, *, open_path: bool = False) -> bool:
        """With a client CA, a path outside ``open_paths`` needs a client certificate that the CA
        signed. The TLS layer already refused a certificate it did not sign (CERT_OPTIONAL still
        verifies what is sent); here a connection that sent none is refused, and closed."""
        if not self.client_auth or open_path:
            return True
        if self.peer_certified:
            return True
        self.close_connection = True
        self.stats.count("refused_unauthenticated")
        self._json(401, {"Error": f"{path}: a client certificate signed by the server's client CA (--client-ca-file) is required"})
        return False

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self.connections.phase(self.request, "working", None)
        path = self.path.split("?", 1)[0]
        if not self._authenticated(path, open_path=path in self.routes.open_paths):
            return
        handler = self.routes.get.get(self.path.split("?", 1)[0])
        if handler is None:
            self._json(404, {"Error": f"no GET route {self.path}"})
            return
        status, content_type, body = handler()
        self._send(status, content_type, body)

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if not self._authenticated(path):
            return  # before a byte of the body is read
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True
            self._json(411 if "Content-Length" not in self.headers else 400, {"Error": "a request body with Content-Length is required"})
            return
        limit = self.routes.body_limits.get(path, MAX_BODY)
        if length < 0 or length > limit:
            self.close_connection = True
            self.stats.count("refused_too_large")
            self._json(413, {"Error": f"Content-Length {length}: must be within 0..{limit} for {path}"})
            return
        self.connections.phase(self.request, "body", self.limits.body_timeout_s + length / self.limits.min_body_rate)
        body, held = self._read_body(length)
        try:
            if body is None:
                return  # answered (503), or the client left
            tokens = self.routes.token_limits.get(path)
            if tokens is not None and (count := json_tokens(body)) > tokens:
                self.close_connection = True
                self.stats.count("refused_too_large")
                status, value = 413, {"Error": f"body of {path}: {count} JSON tokens ({{ [ , :); rule: at most {tokens}"}
            else:
                status, value = self._dispatch(path, body)
        finally:
            del body
            self.bodies.release(held)
        self._json(status, value)

    def _read_body(self, length: int) -> tuple[bytes | None, int]:
        """The body, read chunk by chunk, each chunk's bytes reserved before it is read; and the
        bytes held (the caller releases them). None when the budget ran out (answered 503) or the
        client left or was closed by the watchdog before sending all of it.

        A body read at once is returned as read. Otherwise the chunks go into one BytesIO, whose
        getvalue() hands over its buffer without a copy, so a body costs about its length once
        (plus BytesIO's growth slack of an eighth), never the two copies a join would need."""
        buffer: io.BytesIO | None = None
        chunk = b""
        held = 0
        while held < length:
            # chunks double with what arrived (read_chunk, read_chunk, 2 x read_chunk, ...): a
            # client holds at most twice what it sent plus one chunk, a big body takes a few reads
            size = min(max(self.limits.read_chunk, held), length - held)
            if not self.bodies.reserve(size):
                self.close_connection = True  # the rest of the body stays unread
                self.stats.count("refused_budget")
                self._json(503, {"Error": f"busy: {self.limits.body_budget} bytes of request bodies in memory; retry"})
                return None, held
            held += size
            chunk = self.rfile.read(size)
            if size < length:  # more than one chunk: gather them
                buffer = buffer or io.BytesIO()
                buffer.write(chunk)
            if len(chunk) < size:  # the client left, or the watchdog closed a trickle
                self.close_connection = True
                self.stats.count("incomplete_bodies")
                return None, held
        if buffer is None:
            return chunk, held
        return buffer.getvalue(), held

    def _dispatch(self, path: str, body: bytes) -> tuple[int, Any]:
        self.connections.phase(self.request, "working", None)
        if not self.in_flight.acquire(timeout=self.limits.busy_wait_s):
            self.close_connection = True
            self.stats.count("refused_busy")
            return 503, {"Error": f"busy: {self.limits.max_in_flight} requests in flight; retry"}
        try:
            return self._handle(path, body)
        finally:
            self.in_flight.release()

    def _handle(self, path: str, body: bytes) -> tuple[int, Any]:
        for prefix, handler in self.routes.post.items():
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                rest = path[len(prefix):].strip("/")
                try:
                    return handler(rest, body)
                except Exception:  # noqa: BLE001 - answer, log, keep serving
                    log.exception("handler for %s failed", path)
                    return 500, {"Error": "internal error; see the server log"}
        return 404, {"Error": f"no POST route {path}"}


def json_tokens(body: bytes) -> int:
    """An upper bound on the values and keys a JSON document decodes to (each but the first
    follows one of ``[ { , :``; the same bytes inside strings only make it larger)."""
    return body.count(b"{") + body.count(b"[") + body.count(b",") + body.count(b":")


class _Server(ThreadingHTTPServer):
    """Threads per connection, admitted through :class:`_Connections`."""

    daemon_threads = True
    # The stdlib's backlog is 5: a burst of connections (a flood, or the apiserver after a restart)
    # would see SYNs dropped and retried after 1, 3, 7 s; the cap on connections is ours to keep.
    request_queue_size = 128
    connections: _Connections

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.admit(request):
            log.warning("refusing a connection from %s: %d connections, all mid-request",
                        client_address[0], self.connections.limits.max_connections)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.leave(request)


class JsonServer:
    """Serves ``routes`` on host:port (TLS when cert and key are given) in a daemon thread.

    ``client_ca_file`` turns on client-certificate authentication: a client that presents a
    certificate must present one this CA signed (the handshake fails otherwise), and only paths in
    :attr:`Routes.open_paths` answer a client that presents none. The context asks for the
    certificate with CERT_OPTIONAL rather than CERT_REQUIRED only so kubelet's probes (which
    present none) can reach ``/healthz`` and ``/readyz``; every other path refuses them with a 401.
    """

    def __init__(self, host: str, port: int, routes: Routes, cert_file: str | None = None, key_file: str | None = None,
                 limits: ServerLimits = ServerLimits(), client_ca_file: str | None = None):
        if bool(cert_file) != bool(key_file):
            raise ValueError("TLS needs both a certificate file and a private key file, or neither")
        if client_ca_file and not cert_file:
            raise ValueError("client-certificate authentication needs TLS: a client CA without a serving certificate")
        self.limits = limits
        self.connections = _Connections(limits)
        self.stats = ServerStats()
        handler = type("Handler", (_Handler,), {"routes": routes, "limits": limits, "connections": self.connections,
                                                "in_flight": threading.BoundedSemaphore(limits.max_in_flight),
                                                "bodies": _Budget(limits.body_budget, self.stats), "stats": self.stats,
                                                "client_auth": bool(client_ca_file)})
        self.httpd = _Server((host, port), handler)
        self.httpd.connections = self.connections
        self.httpd.handle_error = lambda request, address: log.debug("connection from %s failed", address, exc_info=True)  # type: ignore[method-assign]
        self.tls = bool(cert_file)
        self.client_auth = bool(client_ca_file)
        if cert_file and key_file:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.options |= ssl.OP_NO_RENEGOTIATION  # a connection's peer is the one its handshake verified
            context.load_cert_chain(cert_file, key_file)
            if client_ca_file:
                context.load_verify_locations(cafile=client_ca_file)
                context.verify_mode = ssl.CERT_OPTIONAL if routes.open_paths else ssl.CERT_REQUIRED
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.port = int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="http-deadlines", daemon=True)

    def _watch(self) -> None:
        while not self._stopped.wait(self.limits.watch_interval_s):
            self.connections.expire()

    def start(self) -> None:
        self._watchdog.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        self._watchdog.start()
        self.httpd.serve_forever()

    def stop(self) -> None:
        self._stopped.set()
        self.httpd.shutdown()
        self.httpd.server_close()
