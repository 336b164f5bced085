"""A small threaded JSON-over-HTTP(S) server shared by the extender and the webhook.

The stdlib server is enough for HTTP/1.1: the callers are one kube-scheduler and one
kube-apiserver, which keep connections alive, and the work per call is a vector computation, not
I/O. TLS is the stdlib's, with the certificate files the operator provides, read again when they
change (:mod:`qgpu_runtime.servingcert`: renewal without a restart). Over TLS the server
can also offer HTTP/2 (ALPN, the ``h2`` library; :class:`_H2Session`), which both callers take
(the extender offers it by default, the webhook with ``--http2 on``): Go
keeps at most two idle HTTP/1.1 connections per host, so overlapping calls (a bind waiting on the
apiserver while the next pod is filtered) open new connections, each a TLS handshake (~1.2–1.5 ms
of CPU with OpenSSL 3.0), where HTTP/2 multiplexes them on one. The rules below hold per stream.

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
- at most ``body_budget`` bytes of request bodies held at once (a 503 past it, after which the
  rest of the body is read into one reused buffer and dropped, so its sender reads the answer rather
  than a reset connection), reserved chunk by
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
import select
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import ConnectionTerminated, DataReceived, RequestReceived, StreamEnded, StreamReset
from h2.exceptions import H2Error, NoSuchStreamError, StreamIDTooLowError
from h2.settings import SettingCodes, Settings

from qgpu_runtime.servingcert import CertificateFiles, CertificateMetrics, ServingCertificate

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
    on_http2: Callable[[], None] | None = None  # called once per connection that negotiated HTTP/2
    body_limits: Mapping[str, int] = field(default_factory=dict)
    # exact POST path → the most JSON tokens (bytes among ``{ [ , :``) its body may hold, counted
    # before the handler decodes it: what bounds the decoded objects' memory (others: no limit).
    token_limits: Mapping[str, int] = field(default_factory=dict)
    # With client-certificate authentication: GET paths answered without a client certificate
    # (kubelet's probes present none). Every other path needs one.
    open_paths: frozenset[str] = frozenset()
    # Exact POST paths whose handler is quick and CPU-bound (the extender's filter and prioritize):
    # over HTTP/2 it runs on the connection's reading thread rather than the worker pool, which
    # saves two thread hand-offs per request. The connection reads nothing meanwhile (kube-scheduler
    # asks these one pod at a time); the in-flight limit and the body and token limits apply as on
    # the pool, except that the inline requests of one read wait ``busy_wait_s`` for handler slots
    # in all (in turn, the thread would read nothing for a multiple of it). A handler that may wait
    # on I/O for long does not belong here.
    inline: frozenset[str] = frozenset()

    def post_route(self, path: str) -> tuple[PostHandler, str] | None:
        """The POST handler serving ``path`` and the rest of the path after its prefix, or None."""
        for prefix, handler in self.post.items():
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return handler, path[len(prefix):].strip("/")
        return None


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
    # A request line and its headers, together (HTTP/1.1); what a connection without a client
    # certificate may send before its request is complete (HTTP/2). The stdlib alone takes 100
    # header lines of 64 KiB each: 6.5 MB per connection before anything checks who sent them.
    max_header_bytes: int = 32 * 1024
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
    refused_headers: int = 0  # 431, or an HTTP/2 connection closed: headers past max_header_bytes
    incomplete_bodies: int = 0  # the client left, or was closed, before its body was in
    http2_connections: int = 0  # connections that negotiated HTTP/2 (ALPN "h2")
    http2_protocol_errors: int = 0  # HTTP/2 connections closed for breaking the protocol
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

    def held(self) -> int:
        with self._lock:
            return self._total - self._left


def _shut(sock: socket.socket) -> None:
    try:
        # the plain socket's shutdown, also for TLS sockets: SSLSocket.shutdown would drop the
        # TLS state under the thread still using it
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its thread


class _HeaderBytes:
    """A connection's reader while a request line and its headers come in: lines as the stdlib
    asks for them, at most ``limit`` bytes in all (one more marks it ``over``, then it reads
    nothing: the stdlib takes that for the end of the headers, and parse_request answers 431).
    So a connection holds ``limit`` bytes of headers, whoever sent them."""

    def __init__(self, raw: Any, limit: int) -> None:
        self.raw = raw
        self.left = limit
        self.over = False

    def readline(self, size: int = -1) -> bytes:
        if self.left < 0:
            return b""
        want = self.left + 1 if size is None or size < 0 else min(size, self.left + 1)
        line: bytes = self.raw.readline(want)
        self.left -= len(line)
        if self.left < 0:
            self.over = True
        return line


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
    workers: ThreadPoolExecutor | None  # runs HTTP/2 streams' handlers (None: HTTP/2 not offered)
    peer_certified: bool  # this connection's handshake verified a client certificate (set in setup)
    http2: bool  # this connection negotiated HTTP/2 (set in setup)
    expects_continue: bool = False  # the request asked for a 100 Continue not sent yet

    def setup(self) -> None:
        # The TLS handshake runs here, in the connection's own thread, so one slow client cannot
        # stall the accept loop; it gets the header deadline, and until it ends the connection
        # may be closed for a newcomer (a client that never finishes it holds no slot).
        if self.routes.on_connection is not None:
            self.routes.on_connection()
        self.timeout = self.limits.idle_timeout_s  # a backstop; the watchdog's deadlines are what bind
        self.peer_certified = False
        self.http2 = False
        if isinstance(self.request, ssl.SSLSocket):
            self.connections.phase(self.request, "handshake", self.limits.header_timeout_s)
            self.request.settimeout(self.limits.header_timeout_s)
            self.request.do_handshake()
            # Once per connection, not per request (getpeercert decodes the certificate each call):
            # the context refuses renegotiation and never asks for a certificate after the
            # handshake, so what the handshake verified holds for the connection's life.
            self.peer_certified = bool(self.client_auth and self.request.getpeercert())
            self.http2 = self.workers is not None and self.request.selected_alpn_protocol() == "h2"
        super().setup()

    def handle(self) -> None:
        if self.http2:
            self.stats.count("http2_connections")
            if self.routes.on_http2 is not None:
                self.routes.on_http2()
            _H2Session(self).run()
            return
        super().handle()

    def handle_one_request(self) -> None:
        self.connections.phase(self.request, "idle", self.limits.idle_timeout_s)
        # The request line and the headers are read through a byte budget; the body from the
        # connection itself (parse_request hands it back).
        raw = self.rfile
        self.rfile = _HeaderBytes(raw, self.limits.max_header_bytes)  # type: ignore[assignment]
        try:
            super().handle_one_request()
        finally:
            self.rfile = raw

    def parse_request(self) -> bool:
        # called once the request line is in: the headers now have their own deadline
        self.connections.phase(self.request, "headers", self.limits.header_timeout_s)
        self.expects_continue = False
        budget = self.rfile
        assert isinstance(budget, _HeaderBytes)
        if budget.over:
            return self._headers_too_large()
        if self.client_auth and not self.peer_certified and not self._open_request_line():
            return False  # refused before a byte of its headers is read
        ok = super().parse_request()
        if budget.over:
            return self._headers_too_large()
        self.rfile = budget.raw
        return ok

    def _open_request_line(self) -> bool:
        """For a connection without a client certificate: whether its request line is a GET of an
        open path; if not, the 401 is sent now and the connection closed, headers unread."""
        words = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n").split()
        path = words[1].split("?", 1)[0] if len(words) >= 2 else ""
        if len(words) >= 2 and words[0] == "GET" and path in self.routes.open_paths:
            return True
        self.command, self.path = (words[0], words[1]) if len(words) >= 2 else ("", "")
        self.request_version = self.protocol_version
        self.requestline = " ".join(words)[:200]
        self._authenticated(path or "/")
        return False

    def _headers_too_large(self) -> bool:
        self.stats.count("refused_headers")
        self.requestline, self.request_version, self.command = "", self.protocol_version, ""
        self.close_connection = True
        self._json(431, {"Error": f"request line and headers: more than {self.limits.max_header_bytes} bytes"})
        return False

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue``: the 100 waits until the request passed every check made before
        its body (do_POST), so a refused sender (401, 411, 413) gets the refusal instead of an
        invitation to send a body that would be closed unread."""
        self.expects_continue = True
        return True

    def _continue(self) -> None:
        if self.expects_continue:
            self.expects_continue = False
            self.send_response_only(100)
            self.end_headers()

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
        self._send(status, "application/json", encode_json(value))

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
        self._send(*self._get(path))

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if not self._authenticated(path):
            return  # before a byte of the body is read
        if "Transfer-Encoding" in self.headers:
            # a body framed otherwise: refused whole, and the connection closed (no smuggled request)
            self.close_connection = True
            self._json(400, {"Error": f"Transfer-Encoding {self.headers['Transfer-Encoding']!r}: not accepted; "
                                      "send the body with a Content-Length"})
            return
        length = content_length(self.headers.get_all("Content-Length") or [])
        if isinstance(length, str):
            self.close_connection = True
            self._json(411 if "Content-Length" not in self.headers else 400, {"Error": length})
            return
        if self.routes.post_route(path) is None:
            # nothing would read it: answered before a byte of the body is held
            self.close_connection = True
            self._json(404, {"Error": f"no POST route {path}"})
            return
        limit = self.routes.body_limits.get(path, MAX_BODY)
        if length > limit:
            self.close_connection = True
            self.stats.count("refused_too_large")
            self._json(413, {"Error": f"Content-Length {length}: must be within 0..{limit} for {path}"})
            return
        self.connections.phase(self.request, "body", self.limits.body_timeout_s + length / self.limits.min_body_rate)
        self._continue()
        body, held = self._read_body(length)
        try:
            if body is None:
                return  # answered (503), or the client left
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
                self.close_connection = True
                self.stats.count("refused_budget")
                # what was read is given back before the drain: only the scratch buffer stays
                buffer = None
                chunk = b""
                self.bodies.release(held)
                self._json(503, {"Error": f"busy: {self.limits.body_budget} bytes of request bodies in memory; retry"})
                self._discard(length - held)
                return None, 0
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

    def _discard(self, rest: int) -> None:
        """Read the ``rest`` of a refused body and throw it away, in one reused buffer, under the
        body deadline again (the watchdog still closes a trickle). Closing on unread bytes would
        reset the connection under a sender still writing them, and it would lose the answer just
        sent; the body is within the path's limit, so the drain is bounded too."""
        self.connections.phase(self.request, "body", self.limits.body_timeout_s + rest / self.limits.min_body_rate)
        scratch = memoryview(bytearray(min(READ_CHUNK, rest)))
        while rest > 0:
            try:
                got = self.rfile.readinto(scratch[:min(len(scratch), rest)])
            except OSError:
                return  # closed by the watchdog, or reset by the client
            if not got:
                return
            rest -= got

    def _dispatch(self, path: str, body: bytes) -> tuple[int, Any]:
        self.connections.phase(self.request, "working", None)
        return self._run(path, body)

    def _get(self, path: str) -> tuple[int, str, bytes]:
        """The GET handler's answer for ``path`` (both protocols)."""
        handler = self.routes.get.get(path)
        if handler is None:
            return 404, "application/json", encode_json({"Error": f"no GET route {path}"})
        return handler()

    def _run(self, path: str, body: bytes, wait: float | None = None) -> tuple[int, Any]:
        """The POST handler's answer for ``path`` (both protocols): the path's JSON token limit
        before anything decodes the body, then a handler slot within the in-flight limit, waited
        for ``wait`` seconds at most (default ``busy_wait_s``)."""
        tokens = self.routes.token_limits.get(path)
        if tokens is not None and (count := json_tokens(body)) > tokens:
            self.close_connection = True
            self.stats.count("refused_too_large")
            return 413, {"Error": f"body of {path}: {count} JSON tokens ({{ [ , :); rule: at most {tokens}"}
        if not self.in_flight.acquire(timeout=self.limits.busy_wait_s if wait is None else wait):
            self.close_connection = True
            self.stats.count("refused_busy")
            return 503, {"Error": f"busy: {self.limits.max_in_flight} requests in flight; retry"}
        try:
            return self._handle(path, body)
        finally:
            self.in_flight.release()

    def _handle(self, path: str, body: bytes) -> tuple[int, Any]:
        route = self.routes.post_route(path)
        if route is None:
            return 404, {"Error": f"no POST route {path}"}
        handler, rest = route
        try:
            return handler(rest, body)
        except Exception:  # noqa: BLE001 - answer, log, keep serving
            log.exception("handler for %s failed", path)
            return 500, {"Error": "internal error; see the server log"}


H2_WINDOW = 1024 * 1024  # each stream's receive window (and the connection's): a NodeNames body in a few frames
# Streams a connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS), and requests it may
# have waiting for or in a handler. Go assumes 100 until the server's SETTINGS arrive, and h2 treats
# a stream past the setting as a connection error: a lower setting would close the connection of a
# client that opened more in its first flight (kube-apiserver does, with concurrent admissions).
H2_MAX_STREAMS = 100
# Closed streams h2 remembers, to tell a frame still in flight on a stream closed by RST_STREAM (a
# stream error) from one on a stream never opened (a connection error). h2 keeps 65,536, ~7.6 MB
# per connection, which any caller gets to by asking GET /healthz (open to all) 65,536 times on one
# connection; and kube-scheduler's connection after as many pods. A client has at most
# H2_MAX_STREAMS open, so no frame of an honest one is still in flight on a stream closed 1,024
# streams ago (h2 ignores WINDOW_UPDATE and RST_STREAM there and resets it for DATA; HEADERS close
# the connection).
H2_CLOSED_STREAMS = 1024
# The most HPACK dynamic table the answers' headers are encoded with, whatever the client's
# SETTINGS_HEADER_TABLE_SIZE allows (up to 4 GiB): h2 indexes every distinct Content-Length sent,
# each entry kept, and searched linearly for every header of every answer. 4096 is HPACK's default,
# what Go's server uses too; our four header names need no more.
H2_HEADER_TABLE = 4096


class _H2Connection(H2Connection):
    """h2's connection with H2_CLOSED_STREAMS closed streams remembered (h2 reads the class attribute)."""

    MAX_CLOSED_STREAMS = H2_CLOSED_STREAMS


@dataclass
class _H2Stream:
    method: str
    path: str
    limit: int  # the most body bytes accepted (the path's limit, or a smaller Content-Length)
    started: float
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    held: int = 0  # body bytes reserved in the budget
    refused: bool = False  # answered already; what else arrives is dropped
    cancelled: bool = False  # reset by the client after its request was complete: its handler is skipped


class _H2Session:
    """One HTTP/2 connection (ALPN "h2": kube-scheduler and kube-apiserver negotiate it, and then
    keep one connection instead of opening one per concurrent call, each a TLS handshake).

    The connection's thread reads; handlers run on the server's worker pool and send their answers
    themselves. Every use of the socket and of the protocol state is under one lock (an SSL socket
    must not be read and written from two threads at once); the thread waits for data outside it,
    and reads without blocking. The limits are those of HTTP/1.1, per stream: a
    client certificate for every path outside ``open_paths``; the path's body limit, checked against
    Content-Length when sent and against the bytes as they arrive; body bytes reserved in the
    server's budget as they arrive; the JSON token limit before decoding; at most ``max_in_flight``
    handlers at once for the whole server, a request waiting at most ``busy_wait_s`` for one (then a
    503). A connection may have :data:`H2_MAX_STREAMS` streams open and as many requests waiting
    for or in a handler; one more is refused with RST_STREAM(REFUSED_STREAM), which a client may
    retry. A request whose stream the client resets before its handler starts is dropped unhandled,
    so ending and resetting streams at once ("rapid reset") costs a queue entry, not a handler. h2
    bounds a header block (64 KiB decoded, 64 CONTINUATION frames); it remembers
    :data:`H2_CLOSED_STREAMS` closed streams, and encodes answers' headers with an HPACK table of
    :data:`H2_HEADER_TABLE` bytes at most, whatever the client allows. Deadlines
    are the connection's phases, as for HTTP/1.1: ``idle`` with no stream open, ``body`` while a
    request is incomplete (from the oldest such stream: ``body_timeout_s`` + its limit at
    ``min_body_rate``), ``writing`` while an answer waits for the client to open its window, and a
    socket timeout of ``write_timeout_s`` on every send (past it, a send on the reading thread or a
    worker ends the connection)."""

    def __init__(self, handler: _Handler) -> None:
        self.h = handler
        self.sock: ssl.SSLSocket = handler.request
        # A connection without a client certificate may only GET open paths: it gets the header
        # deadline while idle, and at most max_header_bytes between requests it completes (h2
        # alone buffers up to 64 CONTINUATION frames of a header block that never ends, ~1 MiB).
        self.unproven = handler.client_auth and not handler.peer_certified
        self.unproven_bytes = 0
        # Inbound headers are validated and normalised (RFC 9113 §8.2) for every connection but one
        # whose client certificate the client CA signed (kube-scheduler, kube-apiserver): that peer
        # may call every route already, and h2's checks cost ~30 µs per request (a third of its
        # receive path); Content-Length is checked for every connection (h2's stream, then ours).
        # Outbound headers are ours, four fixed names.
        trusted_peer = handler.client_auth and handler.peer_certified
        self.conn = _H2Connection(H2Configuration(client_side=False, header_encoding="utf-8",
                                                  validate_inbound_headers=not trusted_peer,
                                                  normalize_inbound_headers=not trusted_peer,
                                                  validate_outbound_headers=False, normalize_outbound_headers=False))
        self.conn.local_settings = Settings(client=False, initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: H2_MAX_STREAMS,
            SettingCodes.MAX_HEADER_LIST_SIZE: H2Connection.DEFAULT_MAX_HEADER_LIST_SIZE,
            SettingCodes.INITIAL_WINDOW_SIZE: H2_WINDOW,
        })
        self.lock = threading.Lock()  # the socket, the protocol state and everything below
        self.streams: dict[int, _H2Stream] = {}
        # answers' bytes the client's window does not take yet, as views: each frame sent slices
        # its part off without copying the rest (a copy per frame made a large answer quadratic)
        self.outbound: dict[int, memoryview] = {}
        self.dispatched: dict[int, _H2Stream] = {}  # requests waiting for or in a handler, by stream
        self.phase: tuple[str, int] | None = None
        self.closing = False
        self.closed = False  # the reading thread has ended: handlers finishing later send nothing
        self.ready: list[tuple[int, _H2Stream]] = []  # complete requests of inline paths, for the reading thread

    # -- the I/O loop ------------------------------------------------------------------------------

    def run(self) -> None:
        farewell = ErrorCodes.NO_ERROR
        try:
            with self.lock:
                self.conn.initiate_connection()
                self.conn.increment_flow_control_window(H2_WINDOW - 65535)
                self._flush()
                self._settle()
            # poll, not select: select() refuses a descriptor past 1023, which a process with many
            # connections, watches and files gets (every HTTP/2 connection then closed at once)
            readable = select.poll()
            readable.register(self.sock, select.POLLIN | select.POLLPRI)
            while not self.closing:
                with self.lock:
                    pending = self.sock.pending()
                if not pending:
                    readable.poll()
                with self.lock:
                    data = self._receive()
                    if data is None:
                        break
                    if self.unproven:
                        self.unproven_bytes += len(data)
                        if self.unproven_bytes > self.h.limits.max_header_bytes:
                            self.h.stats.count("refused_headers")
                            farewell = ErrorCodes.ENHANCE_YOUR_CALM
                            break
                    if data:
                        events = self.conn.receive_data(data)
                        self._cap_header_table()
                        self._events(events)
                    self._push()
                    self._flush()
                    self._settle()
                ready, self.ready = self.ready, []
                # One wait for a handler slot for them all: waiting busy_wait_s for each in turn,
                # the thread would read nothing (window updates, other streams) for a multiple of it.
                until = time.monotonic() + self.h.limits.busy_wait_s
                for sid, stream in ready:
                    self._work(sid, stream, until)
            with self.lock:
                self._goodbye(farewell)
        except H2Error as exc:
            self.h.stats.count("http2_protocol_errors")
            log.debug("HTTP/2 connection from %s closed: %s", self.h.address_string(), exc)
            with self.lock:
                self._goodbye(ErrorCodes.PROTOCOL_ERROR)
        except (OSError, ValueError):
            pass  # the client left, or the watchdog shut the socket past its deadline
        finally:
            with self.lock:
                self.closed = True
                for stream in self.streams.values():
                    self.h.bodies.release(stream.held)
                self.streams.clear()
                for _, stream in self.ready:
                    self.h.bodies.release(stream.held)
                self.ready.clear()

    def _receive(self) -> bytes | None:
        """What the socket has now (b"" when nothing), or None when the client closed it."""
        self.sock.settimeout(0.0)
        try:
            data = self.sock.recv(65536)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return b""
        return data or None

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            self.sock.settimeout(self.h.limits.write_timeout_s)  # sendall's whole duration
            self.sock.sendall(out)

    def _cap_header_table(self) -> None:
        """The encoder's table back within H2_HEADER_TABLE, after the client's SETTINGS raised it and
        before anything is encoded with it (a smaller table than the client allows is always legal:
        the next header block says so)."""
        if self.conn.encoder.header_table_size > H2_HEADER_TABLE:
            self.conn.encoder.header_table_size = H2_HEADER_TABLE

    def _goodbye(self, code: ErrorCodes) -> None:
        try:
            self.conn.close_connection(code)
            self._flush()
        except (H2Error, OSError):
            pass

    def _settle(self) -> None:
        """The connection's phase for the watchdog, set when it changes (see the class docstring)."""
        limits = self.h.limits
        incomplete = [(sid, s) for sid, s in self.streams.items() if not s.refused]
        if self.outbound:
            want, timeout = ("writing", 0), limits.write_timeout_s
        elif incomplete:
            sid, oldest = min(incomplete, key=lambda item: item[1].started)
            want = ("body", sid)
            timeout = oldest.started + limits.body_timeout_s + oldest.limit / limits.min_body_rate - time.monotonic()
        elif self.dispatched:
            want, timeout = ("working", 0), None
        else:
            want, timeout = ("idle", 0), limits.header_timeout_s if self.unproven else limits.idle_timeout_s
        if want != self.phase:
            self.phase = want
            self.h.connections.phase(self.sock, want[0], None if timeout is None else max(0.0, timeout))

    # -- requests ----------------------------------------------------------------------------------

    def _events(self, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, RequestReceived):
                self._request(event.stream_id, dict(event.headers))
            elif isinstance(event, DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                self._data(event.stream_id, event.data)
            elif isinstance(event, StreamEnded):
                self._ended(event.stream_id)
            elif isinstance(event, StreamReset):
                self._drop(event.stream_id)
                self.outbound.pop(event.stream_id, None)
                waiting = self.dispatched.get(event.stream_id)
                if waiting is not None:
                    waiting.cancelled = True
            elif isinstance(event, ConnectionTerminated):
                self.closing = True

    def _request(self, sid: int, headers: dict[str, str]) -> None:
        method, path = headers.get(":method", ""), headers.get(":path", "").split("?", 1)[0]
        routes = self.h.routes
        if method not in ("GET", "POST"):
            self._refuse(sid, 501, {"Error": f"method {method!r}: only GET and POST are served"})
            return
        if self.h.client_auth and not self.h.peer_certified and not (method == "GET" and path in routes.open_paths):
            self.h.stats.count("refused_unauthenticated")
            self._refuse(sid, 401, {"Error": f"{path}: a client certificate signed by the server's client CA "
                                             "(--client-ca-file) is required"})
            self.closing = True  # as HTTP/1.1 closes the connection
            return
        if method == "POST" and routes.post_route(path) is None:
            self._refuse(sid, 404, {"Error": f"no POST route {path}"})
            return
        limit = routes.body_limits.get(path, MAX_BODY) if method == "POST" else 0
        if "content-length" in headers:
            # h2 refused non-digits and disagreeing duplicates already (a protocol error); the
            # length of the number is the rule left to check.
            announced = content_length([headers["content-length"]])
            if isinstance(announced, str):
                self._refuse(sid, 400, {"Error": announced})
                return
            if announced > limit:
                self.h.stats.count("refused_too_large")
                self._refuse(sid, 413, {"Error": f"Content-Length {announced}: must be within 0..{limit} for {path}"})
                return
            limit = announced
        self.streams[sid] = _H2Stream(method, path, limit, time.monotonic())

    def _data(self, sid: int, data: bytes) -> None:
        stream = self.streams.get(sid)
        if stream is None or stream.refused or not data:
            return
        if stream.size + len(data) > stream.limit:
            self.h.stats.count("refused_too_large")
            self._refuse(sid, 413, {"Error": f"body of {stream.path}: more than {stream.limit} bytes"})
            return
        if not self.h.bodies.reserve(len(data)):
            self.h.stats.count("refused_budget")
            self._refuse(sid, 503, {"Error": f"busy: {self.h.limits.body_budget} bytes of request bodies in memory; retry"})
            return
        stream.held += len(data)
        stream.size += len(data)
        stream.chunks.append(data)

    def _ended(self, sid: int) -> None:
        stream = self.streams.pop(sid, None)
        if stream is None or stream.refused:
            if stream is not None:
                self.h.bodies.release(stream.held)
            return
        if len(self.dispatched) >= H2_MAX_STREAMS:
            # only streams reset after their request was complete get here (open ones are fewer)
            self.h.bodies.release(stream.held)
            self.h.stats.count("refused_busy")
            try:
                self.conn.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            except NoSuchStreamError:  # the client reset it too, later in the same read: closed already
                pass
            return
        self.dispatched[sid] = stream
        self.unproven_bytes = 0  # a request completed: what it took is accounted for
        if stream.method == "POST" and stream.path in self.h.routes.inline:
            self.ready.append((sid, stream))  # run by the reading thread once this read is handled
            return
        assert self.h.workers is not None
        self.h.workers.submit(self._work, sid, stream)

    def _work(self, sid: int, stream: _H2Stream, until: float | None = None) -> None:
        """On a worker, or on the reading thread for an inline path (waiting for a handler slot
        until the monotonic ``until`` at most): the handler's answer, sent on the connection (under
        its lock)."""
        try:
            if stream.cancelled:
                status, content_type, body = 0, "", b""  # the client reset it: nobody to answer
            elif stream.method == "GET":
                status, content_type, body = self.h._get(stream.path)
            else:
                data = stream.chunks[0] if len(stream.chunks) == 1 else b"".join(stream.chunks)
                stream.chunks.clear()
                wait = None if until is None else max(0.0, until - time.monotonic())
                status, value = self.h._run(stream.path, data, wait)
                del data
                content_type, body = "application/json", encode_json(value)
        except Exception:  # noqa: BLE001 - answer, log, keep serving
            log.exception("handler for %s failed", stream.path)
            status, content_type, body = 500, "application/json", encode_json({"Error": "internal error; see the server log"})
        finally:
            self.h.bodies.release(stream.held)
        with self.lock:
            self.dispatched.pop(sid, None)
            if self.closed or stream.cancelled:
                return
            try:
                self._send(sid, status, content_type, body)
                self._push()
                self._flush()
                self._settle()
            except (OSError, ValueError):
                # The client left, the watchdog shut the socket, or the send ran past
                # write_timeout_s (a client that reads nothing while its windows are open): a TLS
                # record may be half sent, and the reading thread may wait on a client that sends
                # nothing more in a phase without a deadline ("working"). Shut it: that thread ends it.
                _shut(self.sock)
            except H2Error:
                log.debug("HTTP/2 answer on stream %d not sent", sid, exc_info=True)

    # -- answers -----------------------------------------------------------------------------------

    def _refuse(self, sid: int, status: int, value: Any) -> None:
        """Answer now; whatever else the stream sends is dropped (its flow control still credited)."""
        stream = self.streams.get(sid)
        if stream is not None:
            stream.refused = True
            stream.chunks.clear()
            self.h.bodies.release(stream.held)
            stream.held = 0
        self._send(sid, status, "application/json", encode_json(value))

    def _drop(self, sid: int) -> None:
        stream = self.streams.pop(sid, None)
        if stream is not None:
            self.h.bodies.release(stream.held)

    def _send(self, sid: int, status: int, content_type: str, body: bytes) -> None:
        headers = [(":status", str(status)), ("content-type", content_type), ("content-length", str(len(body))),
                   ("server", self.h.server_version)]
        try:
            self.conn.send_headers(sid, headers, end_stream=not body)
        except (NoSuchStreamError, StreamIDTooLowError):
            return  # reset by the client meanwhile (and perhaps already forgotten)
        if body:
            self.outbound[sid] = memoryview(body)

    def _push(self) -> None:
        """Answers' bytes, as far as the client's flow-control windows take them."""
        for sid in list(self.outbound):
            data = self.outbound[sid]
            try:
                while data:
                    n = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size, len(data))
                    if n <= 0:
                        break
                    self.conn.send_data(sid, bytes(data[:n]), end_stream=n == len(data))
                    data = data[n:]
            except (NoSuchStreamError, StreamIDTooLowError):
                data = memoryview(b"")  # reset by the client meanwhile
            if data:
                self.outbound[sid] = data
            else:
                del self.outbound[sid]


def content_length(values: list[str]) -> int | str:
    """A request's Content-Length as RFC 9110 has it (ASCII digits; sent more than once, the same
    every time), or the error to answer. Python's ``int`` alone would also take ``+1``, ``1_0`` and
    other digits than ASCII ones, which no HTTP peer sends and a proxy might read otherwise."""
    if not values:
        return "a request body with Content-Length is required"
    distinct = {value.strip() for value in values}
    if len(distinct) > 1:
        return f"Content-Length {sorted(distinct)!r}: sent {len(values)} times with different values"
    text = distinct.pop()
    if not (text.isascii() and text.isdigit()) or len(text) > 19:
        return f"Content-Length {text[:40]!r}: must be 1 to 19 ASCII digits"
    return int(text)


def encode_json(value: Any) -> bytes:
    """A handler's answer as the server sends it: compact JSON, or a :class:`RawJSON`'s bytes as they are."""
    return value if isinstance(value, RawJSON) else json.dumps(value, separators=(",", ":")).encode()


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
    # Over TLS: the listening socket stays plain and each accepted connection is wrapped with the
    # context current at its accept, so a reloaded certificate reaches new connections while open
    # ones keep theirs (an SSLSocket's own accept wraps with the context it was created with).
    certificate: ServingCertificate | None = None

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = self.socket.accept()
        if self.certificate is None:
            return sock, address
        try:
            # the handshake runs in the connection's own thread (_Handler.setup), not here
            return self.certificate.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address
        except OSError:
            sock.close()
            raise

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

    The certificate, key and client CA files are looked at every ``certificate_check_s`` and read
    again when they change (:mod:`qgpu_runtime.servingcert`): new connections get the renewed
    certificate, open ones keep theirs, and a replacement that does not load leaves the previous
    one served. ``certificate_metrics`` receives its notAfter and the reloads' results.
    """

    def __init__(self, host: str, port: int, routes: Routes, cert_file: str | None = None, key_file: str | None = None,
                 limits: ServerLimits = ServerLimits(), client_ca_file: str | None = None, http2: bool = True,
                 certificate_metrics: CertificateMetrics | None = None, certificate_check_s: float = 10.0):
        if not certificate_check_s > 0:
            raise ValueError(f"certificate_check_s={certificate_check_s!r}: must be > 0")
        if bool(cert_file) != bool(key_file):
            raise ValueError("TLS needs both a certificate file and a private key file, or neither")
        if client_ca_file and not cert_file:
            raise ValueError("client-certificate authentication needs TLS: a client CA without a serving certificate")
        self.limits = limits
        self.connections = _Connections(limits)
        self.stats = ServerStats()
        self.bodies = _Budget(limits.body_budget, self.stats)
        # HTTP/2 is offered over TLS only (ALPN); its streams' handlers run on these workers
        # as many threads as HTTP/1.1 may have connections: a request waits for a handler slot (up to
        # busy_wait_s, then a 503) in its worker, as an HTTP/1.1 request waits in its connection's thread
        self.workers = ThreadPoolExecutor(limits.max_connections, thread_name_prefix="http2") if http2 and cert_file else None
        handler = type("Handler", (_Handler,), {"workers": self.workers, "routes": routes, "limits": limits, "connections": self.connections,
                                                "in_flight": threading.BoundedSemaphore(limits.max_in_flight),
                                                "bodies": self.bodies, "stats": self.stats,
                                                "client_auth": bool(client_ca_file)})
        self.httpd = _Server((host, port), handler)
        self.httpd.connections = self.connections
        self.httpd.handle_error = lambda request, address: log.debug("connection from %s failed", address, exc_info=True)  # type: ignore[method-assign]
        self.tls = bool(cert_file)
        self.client_auth = bool(client_ca_file)
        self.certificate: ServingCertificate | None = None
        if cert_file and key_file:
            try:
                self.certificate = ServingCertificate(
                    CertificateFiles(cert_file, key_file, client_ca_file),
                    alpn=("h2", "http/1.1") if self.workers is not None else (),
                    verify_mode=ssl.CERT_OPTIONAL if routes.open_paths else ssl.CERT_REQUIRED,
                    metrics=certificate_metrics)
            except BaseException:
                self.httpd.server_close()
                raise
            self.httpd.certificate = self.certificate
        self.port = int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="http-deadlines", daemon=True)
        # its own thread: reading files (a slow volume) must not hold up the connections' deadlines
        self._certificate_watch = None if self.certificate is None else threading.Thread(
            target=self.certificate.watch, args=(self._stopped, certificate_check_s), name="tls-reload", daemon=True)

    def tls_context(self) -> ssl.SSLContext | None:
        """The context the next connection is wrapped with (None over plain HTTP)."""
        return None if self.certificate is None else self.certificate.context

    def bodies_held(self) -> int:
        """Request-body bytes held now (reserved in the budget), both protocols."""
        return self.bodies.held()

    def _watch(self) -> None:
        while not self._stopped.wait(self.limits.watch_interval_s):
            self.connections.expire()

    def _start_watchers(self) -> None:
        self._watchdog.start()
        if self._certificate_watch is not None:
            self._certificate_watch.start()

    def start(self) -> None:
        self._start_watchers()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        self._start_watchers()
        self.httpd.serve_forever()

    def stop(self) -> None:
        self._stopped.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.workers is not None:
            self.workers.shutdown(wait=False, cancel_futures=True)


METRICS_LIMITS = ServerLimits(max_connections=32, max_in_flight=4, body_budget=READ_CHUNK, read_chunk=READ_CHUNK)
"""A metrics port's share: a scraper or two, a probe, an operator's curl. Past 32 connections a
newcomer closes the one that waited longest on its client."""


def metrics_server(host: str, port: int, registry: Any, limits: ServerLimits = METRICS_LIMITS) -> JsonServer:
    """Prometheus's text exposition of ``registry`` on ``GET /metrics`` (plain HTTP, started).

    Rather than prometheus_client's own server, which takes a thread per connection with no
    deadline: whoever reaches the port held one thread per idle connection (3,000 connections,
    3,000 threads and ~100 MiB), up to the memory limit of the process serving it — the node
    manager, whose liveness probe is this port. Here the connection cap, the deadlines and the
    eviction of clients that send nothing hold as for the extender and the webhook."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    def metrics() -> tuple[int, str, bytes]:
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)

    server = JsonServer(host, port, Routes(post={}, get={"/metrics": metrics}), limits=limits, http2=False)
    server.start()
    return server
