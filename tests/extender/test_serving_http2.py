"""The JSON server over HTTP/2 (ALPN "h2", what kube-scheduler and kube-apiserver negotiate when
offered): the same answers and the same limits as HTTP/1.1, per stream, and a connection that
breaks them or stalls is closed. The client is the h2 library over a TLS socket, frame by frame, so
each test can misbehave exactly as it needs to."""

from __future__ import annotations

import json
import ssl
import threading
import time
from typing import Any, Iterator

import pytest

from qgpu_runtime.serving import JsonServer, RawJSON, Routes, ServerLimits
from tests.extender.h2client import Client, connect
from tests.k8s.pki import CertificateAuthority, KeyPair
from tests.polling import poll

LIMITS = ServerLimits(max_connections=8, max_in_flight=4, idle_timeout_s=30.0, header_timeout_s=2.0, body_timeout_s=0.5,
                      min_body_rate=1e6, write_timeout_s=0.5, busy_wait_s=0.2, watch_interval_s=0.05)
BIG = RawJSON(json.dumps({"names": [f"node-{i:05d}" for i in range(30000)]}).encode())  # ~420 KB: past a 64 KiB window
release = threading.Event()  # what the /slow handler waits for
slow_calls: list[float] = []  # when each /slow call started


def echo(rest: str, body: bytes) -> tuple[int, Any]:
    return 200, {"verb": rest, "got": len(body)}


def slow(rest: str, body: bytes) -> tuple[int, Any]:
    slow_calls.append(time.monotonic())
    release.wait(10)
    return 200, {"slow": True}


def serve(pki: tuple[CertificateAuthority, KeyPair, KeyPair], http2: bool = True) -> JsonServer:
    ca, server, _ = pki
    routes = Routes(post={"/echo": echo, "/slow": slow, "/small": echo, "/tokens": echo},
                    get={"/healthz": lambda: (200, "text/plain", b"ok"), "/big": lambda: (200, "application/json", BIG)},
                    body_limits={"/small": 100}, token_limits={"/tokens": 10}, open_paths=frozenset({"/healthz"}))
    srv = JsonServer("127.0.0.1", 0, routes, str(server.cert), str(server.key), limits=LIMITS,
                     client_ca_file=str(ca.cert_path), http2=http2)
    srv.start()
    return srv


@pytest.fixture
def server(pki: tuple[CertificateAuthority, KeyPair, KeyPair]) -> Iterator[JsonServer]:
    release.clear()
    slow_calls.clear()
    srv = serve(pki)
    yield srv
    release.set()
    srv.stop()


def test_http2_is_negotiated_and_answers_as_http1_does(server, client):
    assert client.protocol == "h2"
    assert client.answer(client.send("POST", "/echo/filter", b'{"a":1}')) == (200, {"verb": "filter", "got": 7})
    assert client.answer(client.send("GET", "/healthz")) == (200, b"ok")
    assert client.answer(client.send("GET", "/nowhere"))[0] == 404
    assert client.answer(client.send("POST", "/nowhere", b"{}"))[0] == 404
    assert client.answer(client.send("PUT", "/echo", b"{}"))[0] == 501
    assert server.stats.http2_connections == 1


def test_streams_are_answered_concurrently_on_one_connection(server, client):
    slow_sid = client.send("POST", "/slow", b"{}")
    # a bind waiting on the apiserver must not hold up the filter behind it on the same connection
    assert client.answer(client.send("POST", "/echo/filter", b"{}")) == (200, {"verb": "filter", "got": 2})
    assert slow_sid not in client.ended
    release.set()
    assert client.answer(slow_sid) == (200, {"slow": True})


def test_without_a_client_certificate_only_open_paths_answer_and_the_connection_is_closed(server, pki):
    c = connect(server.port, pki, certificate=False)
    try:
        assert c.answer(c.send("GET", "/healthz")) == (200, b"ok")
        status, doc = c.answer(c.send("POST", "/echo/bind", b"{}"))
        assert status == 401 and "client certificate" in doc["Error"]
        assert c.closed()
    finally:
        c.close()
    assert server.stats.refused_unauthenticated == 1


def test_a_body_past_the_paths_limit_is_refused_whether_announced_or_not(server, client):
    status, doc = client.answer(client.send("POST", "/small", b"x" * 101, length=101))
    assert status == 413 and "Content-Length 101" in doc["Error"]
    status, doc = client.answer(client.send("POST", "/small", b"x" * 101))  # no Content-Length: counted as it comes
    assert status == 413 and "more than 100 bytes" in doc["Error"]
    status, doc = client.answer(client.send("POST", "/tokens", b"[" + b"{}," * 20 + b"{}]"))
    assert status == 413 and "JSON tokens" in doc["Error"]
    assert server.stats.refused_too_large == 3
    assert client.answer(client.send("POST", "/small", b"{}")) == (200, {"verb": "", "got": 2})  # the connection serves on


@pytest.mark.parametrize("length", ["1_0", "+10", "0x0a", "١٠"])
def test_a_content_length_that_is_not_digits_breaks_the_protocol_and_closes_the_connection(server, pki, length):
    """h2 itself holds content-length to 1*DIGIT (a protocol error: the connection is closed)."""
    c = connect(server.port, pki)
    try:
        c.send("POST", "/echo", b"x" * 10, length=length)
        assert not c.pump(lambda: False)
    finally:
        c.close()
    assert server.stats.http2_protocol_errors == 1


def test_a_post_to_no_route_is_refused_before_its_body_is_held(server, client):
    status, doc = client.answer(client.send("POST", "/nowhere", b"x" * 1000, length=100 * 1024 * 1024, end=False))
    assert (status, doc) == (404, {"Error": "no POST route /nowhere"})
    assert server.stats.body_bytes_peak == 0
    assert client.answer(client.send("POST", "/echo", b"{}", length=2)) == (200, {"verb": "", "got": 2})


def test_a_content_length_of_twenty_digits_is_refused_naming_the_rule(server, client):
    # the stream stays open: ending it after 10 bytes would break the announced length (h2's check)
    status, doc = client.answer(client.send("POST", "/echo", b"x" * 10, length="1" * 20, end=False))
    assert (status, doc["Error"]) == (400, f"Content-Length {'1' * 20!r}: must be 1 to 19 ASCII digits"), doc
    assert client.answer(client.send("POST", "/echo", b"{}", length=2)) == (200, {"verb": "", "got": 2})


def test_an_answer_larger_than_the_clients_window_is_sent_as_the_window_opens(server, pki):
    c = connect(server.port, pki, window=16384)
    try:
        status, doc = c.answer(c.send("GET", "/big"))
        assert status == 200 and len(doc["names"]) == 30000
    finally:
        c.close()


def test_a_client_that_never_opens_its_window_is_closed_at_the_write_deadline(server, pki):
    c = connect(server.port, pki, window=16384)
    c.acknowledge = False
    try:
        c.send("GET", "/big")
        assert c.closed(timeout=5.0)
    finally:
        c.close()
    assert len(server.connections) == 0


def test_a_body_that_never_ends_is_closed_at_its_deadline_and_its_bytes_released(server, client):
    sid = client.send("POST", "/echo", b"x" * 1000, end=False, length=5000)
    assert sid not in client.ended
    assert client.closed(timeout=5.0)  # body_timeout_s (0.5) + 5000 bytes at 1 MB/s
    assert server.stats.body_bytes_peak >= 1000
    poll(lambda: server.bodies_held() == 0, what="the trickled body's bytes released")


def test_streams_reset_after_their_request_cannot_pile_up_handlers(server, client):
    """Rapid reset: a client that ends requests and resets them at once gets no handler for those
    still waiting, and never more running than max_in_flight; the connection then serves on."""
    for _ in range(40):
        sid = client.send("POST", "/slow", b"{}")
        client.conn.reset_stream(sid)
        client.sock.sendall(client.conn.data_to_send())
    assert client.answer(client.send("GET", "/healthz")) == (200, b"ok")  # every reset is processed by now
    time.sleep(LIMITS.busy_wait_s * 2)  # those that got past the reset wait for a slot, then give up
    assert len(slow_calls) <= LIMITS.max_in_flight
    release.set()
    deadline = time.monotonic() + 10
    while True:  # the slow handlers finish; the connection serves again
        status, doc = client.answer(client.send("POST", "/echo", b"{}"))
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (status, doc) == (200, {"verb": "", "got": 2})
    assert len(slow_calls) <= LIMITS.max_in_flight  # none of the reset requests ran after the slots freed


def test_a_first_flight_of_more_requests_than_handlers_waits_for_them(server, client):
    """kube-apiserver sends concurrent admissions before it has read the server's SETTINGS: more
    requests than handler slots wait for a slot (as HTTP/1.1 requests do), none is refused."""
    sids = [client.send("POST", f"/echo/{i}", b"{}") for i in range(3 * LIMITS.max_in_flight)]
    assert [client.answer(sid) for sid in sids] == [(200, {"verb": str(i), "got": 2}) for i in range(len(sids))]


def test_a_protocol_violation_closes_the_connection(server, client):
    client.sock.sendall(b"\x00\x00\x04\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00")  # WINDOW_UPDATE of 0 on the connection
    assert client.closed()
    assert server.stats.http2_protocol_errors == 1


def test_clients_that_offer_only_http1_and_servers_with_http2_off_speak_http1(server, pki):
    import http.client

    c = connect(server.port, pki, alpn=("http/1.1",))
    assert c.protocol == "http/1.1"
    c.close()
    off = serve(pki, http2=False)
    try:
        c = connect(off.port, pki, alpn=("h2", "http/1.1"))
        assert c.protocol is None  # no ALPN offered by the server
        c.close()
        ca, _, client = pki
        ctx = ssl.create_default_context(cafile=str(ca.cert_path))
        ctx.load_cert_chain(str(client.cert), str(client.key))
        conn = http.client.HTTPSConnection("127.0.0.1", off.port, context=ctx, timeout=10)
        conn.request("POST", "/echo/x", b"{}")
        assert json.loads(conn.getresponse().read()) == {"verb": "x", "got": 2}
        conn.close()
    finally:
        off.stop()


def test_the_plain_http_server_never_offers_http2(pki):
    srv = JsonServer("127.0.0.1", 0, Routes(post={"/echo": echo}, get={}))
    try:
        assert srv.workers is None
    finally:
        srv.httpd.server_close()



def test_a_header_block_that_never_ends_without_a_certificate_is_cut_at_the_header_budget(server, pki):
    """h2 buffers up to 64 CONTINUATION frames (~1 MiB) of a header block before it decodes it;
    a connection without a client certificate is closed once it sent max_header_bytes without
    completing a request, with GOAWAY(ENHANCE_YOUR_CALM)."""
    from h2.errors import ErrorCodes
    from hyperframe.frame import ContinuationFrame, HeadersFrame

    c = connect(server.port, pki, certificate=False)
    try:
        c.sock.sendall(HeadersFrame(1, data=b"\x82").serialize())  # :method GET, no END_HEADERS
        frames = b"".join(ContinuationFrame(1, data=b"\x00" * 16384).serialize() for _ in range(4))
        try:
            c.sock.sendall(frames)
        except (ConnectionError, ssl.SSLError):
            pass  # closed while still sending: as good
        assert c.closed()
        assert c.terminated is None or c.terminated.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    finally:
        c.close()
    assert server.stats.refused_headers == 1


def test_a_certified_connection_is_not_held_to_the_header_budget(server, client):
    big = b'{"names":"' + b"a" * (LIMITS.max_header_bytes + 16384) + b'"}'  # within the 64 KiB stream window
    chunks = [big[i:i + 16384] for i in range(0, len(big), 16384)]  # frames of the default largest size
    sid = client.send("POST", "/echo/filter", chunks[0], end=False)
    for i, chunk in enumerate(chunks[1:], 2):
        client.more(sid, chunk, end=i == len(chunks))
    assert client.answer(sid) == (200, {"verb": "filter", "got": len(big)})
    assert server.stats.refused_headers == 0


def test_a_connection_without_a_certificate_gets_the_header_deadline_while_idle(server, pki):
    c = connect(server.port, pki, certificate=False)
    try:
        assert c.answer(c.send("GET", "/healthz")) == (200, b"ok")
        started = time.monotonic()
        assert c.closed(timeout=LIMITS.idle_timeout_s / 2)  # not the 30 s idle deadline
        assert time.monotonic() - started < LIMITS.idle_timeout_s / 2
    finally:
        c.close()


def _http1_without_certificate(port: int, pki: tuple[CertificateAuthority, KeyPair, KeyPair], head: bytes) -> bytes:
    ca, _, _ = pki
    ctx = ssl.create_default_context(cafile=str(ca.cert_path))
    ctx.set_alpn_protocols(["http/1.1"])
    import socket

    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="127.0.0.1") as sock:
        sock.sendall(head)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except (ConnectionError, ssl.SSLError):
            pass
        return got


def test_http1_without_a_certificate_is_refused_after_its_request_line_before_its_headers(server, pki):
    # the headers never end: the 401 comes anyway, and the connection is closed
    answer = _http1_without_certificate(server.port, pki, b"POST /echo/bind HTTP/1.1\r\nHost: x\r\nX-Pad: aaaa")
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:80]
    assert b"client certificate" in answer
    assert server.stats.refused_unauthenticated == 1
    answer = _http1_without_certificate(server.port, pki, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"ok")


def _raw_headers(c: Client, headers: list[tuple[str, str]]) -> int:
    """A HEADERS frame sent past the client's own checks (as a peer that ignores RFC 9113 would)."""
    c.conn.config.validate_outbound_headers = False
    c.conn.config.normalize_outbound_headers = False
    sid = c.conn.get_next_available_stream_id()
    c.conn.send_headers(sid, headers, end_stream=True)
    c.sock.sendall(c.conn.data_to_send())
    return sid


def test_header_checks_are_skipped_only_for_a_peer_the_client_ca_certified(server, pki):
    """h2's inbound header validation holds for a connection without a certificate; one whose
    certificate the client CA signed (which may call every route anyway) is spared its cost."""
    request = [(":method", "GET"), (":path", "/healthz"), (":scheme", "https"), (":authority", "127.0.0.1"),
               ("connection", "keep-alive")]  # a connection-specific header: malformed in HTTP/2
    stranger = connect(server.port, pki, certificate=False)
    try:
        _raw_headers(stranger, request)
        assert stranger.closed()
    finally:
        stranger.close()
    assert server.stats.http2_protocol_errors == 1
    certified = connect(server.port, pki)
    try:
        assert certified.answer(_raw_headers(certified, request)) == (200, b"ok")
        assert certified.answer(certified.send("POST", "/echo/filter", b"{}")) == (200, {"verb": "filter", "got": 2})
    finally:
        certified.close()
    assert server.stats.http2_protocol_errors == 1
