"""The JSON server under slow and greedy clients: bounded connections, deadlines, in-flight cap,
per-path body limits. Every flood is loopback, bounded in count and closed by the test."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from contextlib import ExitStack
from typing import Iterator

import pytest

from qgpu_runtime.serving import JsonServer, Routes, ServerLimits
from tests.polling import poll

FAST = ServerLimits(max_connections=8, max_in_flight=2, idle_timeout_s=30.0, header_timeout_s=0.3, body_timeout_s=0.3,
                    min_body_rate=1e6, busy_wait_s=0.2, watch_interval_s=0.05)


def echo(rest: str, body: bytes) -> tuple[int, object]:
    return 200, {"got": len(body)}


@pytest.fixture
def server() -> Iterator[JsonServer]:
    srv = JsonServer("127.0.0.1", 0, Routes(post={"/echo": echo, "/small": echo}, get={}, body_limits={"/small": 100}), limits=FAST)
    srv.start()
    yield srv
    srv.stop()


def post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=body)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def opened(stack: ExitStack, port: int, first_bytes: bytes = b"") -> socket.socket:
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


SLOW_HEADERS = b"POST /echo HTTP/1.1\r\nHost: x\r\n"  # the blank line never comes
SLOW_BODY = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n0123456789"  # 990 bytes never come


def test_a_flood_of_idle_and_slow_connections_does_not_stop_a_legitimate_request(server):
    with ExitStack() as flood:
        for _ in range(30):
            opened(flood, server.port)
        for _ in range(3):
            opened(flood, server.port, SLOW_HEADERS)
        for _ in range(2):
            opened(flood, server.port, SLOW_BODY)
        assert post(server.port, "/echo", b"{}") == (200, {"got": 2})
        assert len(server.connections) <= FAST.max_connections


def test_slow_headers_are_closed_at_their_deadline(server):
    with ExitStack() as stack:
        sock = opened(stack, server.port, SLOW_HEADERS)
        assert sock.recv(1) == b""  # the server closed it; the 10 s client timeout would raise instead


def test_a_slow_body_is_closed_at_its_deadline(server):
    with ExitStack() as stack:
        sock = opened(stack, server.port, SLOW_BODY)
        assert sock.recv(1) == b""


def test_a_body_above_the_paths_limit_is_refused_before_it_is_read(server):
    status, doc = post(server.port, "/small", b"x" * 101)
    assert status == 413 and doc["Error"] == "Content-Length 101: must be within 0..100 for /small"
    assert post(server.port, "/echo", b"x" * 101)[0] == 200


def test_a_post_to_no_route_is_answered_before_its_body_is_read(server):
    """Before, the body was read (up to 256 MiB, reserved in the budget) and then answered 404:
    on a server with open paths, a stranger's way to hold memory."""
    announced = 200 * 1024 * 1024
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % announced + b"x" * 1000)
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 404
        assert json.loads(response.read()) == {"Error": "no POST route /nowhere"}
        assert sock.recv(1) == b""  # closed: the unread body is not taken for a next request
    assert server.stats.body_bytes_peak == 0


def raw_answer(port: int, request: bytes) -> tuple[int, dict, bytes]:
    """One request as raw bytes: the status, the JSON answer, and what came after it (b"" when
    the server closed the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        response = http.client.HTTPResponse(sock)
        response.begin()
        doc = json.loads(response.read())
        return response.status, doc, sock.recv(1)


@pytest.mark.parametrize(("headers", "error"), [
    (b"Content-Length: 1_0", "Content-Length '1_0': must be 1 to 19 ASCII digits"),
    (b"Content-Length: +10", "Content-Length '+10': must be 1 to 19 ASCII digits"),
    (b"Content-Length: -1", "Content-Length '-1': must be 1 to 19 ASCII digits"),
    (b"Content-Length: 10\r\nContent-Length: 12", "Content-Length ['10', '12']: sent 2 times with different values"),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 10", "Transfer-Encoding 'chunked': not accepted; send the body with a Content-Length"),
    (b"Transfer-Encoding: chunked", "Transfer-Encoding 'chunked': not accepted; send the body with a Content-Length"),
])
def test_a_body_framed_any_other_way_than_one_plain_content_length_is_refused_and_the_connection_closed(server, headers, error):
    request = b"POST /echo HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n\r\n0123456789POST /echo HTTP/1.1\r\n\r\n"
    assert raw_answer(server.port, request) == (400, {"Error": error}, b"")


def test_the_same_content_length_twice_is_one(server):
    request = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    assert raw_answer(server.port, request) == (200, {"got": 2}, b"")


def test_no_content_length_is_411(server):
    assert raw_answer(server.port, b"POST /echo HTTP/1.1\r\nHost: x\r\n\r\n")[:2] == (
        411, {"Error": "a request body with Content-Length is required"})


def test_expect_100_continue_gets_the_refusal_before_the_body_and_the_100_only_once_it_may_send(server):
    with ExitStack() as stack:
        refused = opened(stack, server.port, b"POST /small HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 101\r\n\r\n")
        everything = b"".join(iter(lambda: refused.recv(65536), b""))  # to the close: no body was invited
        head, _, doc = everything.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413 ") and json.loads(doc) == {"Error": "Content-Length 101: must be within 0..100 for /small"}
        invited = opened(stack, server.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        assert invited.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
        invited.sendall(b"{}")
        response = http.client.HTTPResponse(invited)
        response.begin()
        assert (response.status, json.loads(response.read())) == (200, {"got": 2})


def test_requests_past_the_in_flight_cap_get_503():
    release = threading.Event()
    entered = threading.Semaphore(0)

    def blocked(rest: str, body: bytes) -> tuple[int, object]:
        entered.release()
        release.wait(10)
        return 200, {}

    srv = JsonServer("127.0.0.1", 0, Routes(post={"/block": blocked}, get={}), limits=FAST)
    srv.start()
    try:
        holders = [threading.Thread(target=post, args=(srv.port, "/block", b"{}")) for _ in range(FAST.max_in_flight)]
        for t in holders:
            t.start()
        for _ in holders:
            assert entered.acquire(timeout=10)
        status, doc = post(srv.port, "/block", b"{}")
        assert status == 503 and doc["Error"].startswith("busy: 2 requests in flight")
        release.set()
        for t in holders:
            t.join(10)
    finally:
        release.set()
        srv.stop()


def test_bodies_past_the_memory_budget_get_503():
    # the slow body's deadline outlives any stall of a loaded machine: the test closes it itself
    limits = ServerLimits(body_budget=1000, header_timeout_s=5.0, body_timeout_s=60.0, watch_interval_s=0.05)
    srv = JsonServer("127.0.0.1", 0, Routes(post={"/echo": echo}, get={}), limits=limits)
    srv.start()
    try:
        with ExitStack() as stack:
            slow = opened(stack, srv.port, SLOW_BODY)  # reserves 1000 bytes, sends 10
            # Its thread reserves asynchronously. A request sent before that could hold its own 2
            # bytes at that moment and get the slow body refused instead, leaving the budget never
            # full again; so the request waits until the server counts the whole budget held.
            poll(lambda: srv.stats.body_bytes_peak == limits.body_budget, what="the slow body to hold the budget")
            status, doc = post(srv.port, "/echo", b"{}")
            assert (status, doc) == (503, {"Error": "busy: 1000 bytes of request bodies in memory; retry"})
            assert srv.stats.refused_budget == 1
            slow.close()
        poll(lambda: post(srv.port, "/echo", b"{}") == (200, {"got": 2}), what="the budget to be given back")
    finally:
        srv.stop()


def test_a_body_refused_for_the_budget_is_drained_so_its_sender_reads_the_503():
    """The 503 goes out before the body is read; closing on the unread rest would reset the
    connection under a sender still writing it (more than the socket buffers hold), and the caller
    would see a dropped connection, not the answer to retry on. The rest is read and thrown away,
    none of it held against the budget."""
    limits = ServerLimits(body_budget=1000, header_timeout_s=5.0, body_timeout_s=60.0, watch_interval_s=0.05)
    srv = JsonServer("127.0.0.1", 0, Routes(post={"/echo": echo}, get={}), limits=limits)
    srv.start()
    try:
        with ExitStack() as stack:
            opened(stack, srv.port, SLOW_BODY)
            poll(lambda: srv.stats.body_bytes_peak == limits.body_budget, what="the slow body to hold the budget")
            for _ in range(3):
                status, doc = post(srv.port, "/echo", b"x" * (8 * 1024 * 1024))
                assert (status, doc) == (503, {"Error": "busy: 1000 bytes of request bodies in memory; retry"})
            assert srv.stats.refused_budget == 3 and srv.stats.body_bytes_peak == limits.body_budget
    finally:
        srv.stop()


def test_a_drained_body_gives_back_what_it_had_read_before_the_drain():
    """Refused on its second chunk: the first chunk's bytes go back to the budget with the 503,
    not when the sender finally stops; the slow body's 1,000 bytes are all that stays held."""
    limits = ServerLimits(body_budget=100_000, read_chunk=65_536, header_timeout_s=5.0, body_timeout_s=60.0,
                          watch_interval_s=0.05)
    srv = JsonServer("127.0.0.1", 0, Routes(post={"/echo": echo}, get={}), limits=limits)
    srv.start()
    try:
        with ExitStack() as stack:
            opened(stack, srv.port, SLOW_BODY)
            poll(lambda: srv.bodies_held() == 1000, what="the slow body to hold its 1,000 bytes")
            big = opened(stack, srv.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 8388608\r\n\r\n" + b"x" * 70_000)
            assert big.recv(12) == b"HTTP/1.1 503"
            assert srv.stats.refused_budget == 1 and srv.stats.body_bytes_peak == 1000 + 65_536
            poll(lambda: srv.bodies_held() == 1000, what="the refused body's first chunk to be given back")
            big.sendall(b"x" * 100_000)  # still read (and dropped) while the sender goes on
    finally:
        srv.stop()


def test_limits_refuse_nonsense():
    with pytest.raises(ValueError, match="ServerLimits.max_connections=0: must be > 0"):
        ServerLimits(max_connections=0)


def _answer_head(sock: socket.socket) -> bytes:
    """What the server sent before it closed the connection (the status line first)."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


@pytest.fixture
def small_headers() -> Iterator[JsonServer]:
    limits = ServerLimits(max_connections=8, max_in_flight=2, header_timeout_s=5.0, watch_interval_s=0.05, max_header_bytes=1024)
    srv = JsonServer("127.0.0.1", 0, Routes(post={"/echo": echo}, get={"/ok": lambda: (200, "text/plain", b"ok")}), limits=limits)
    srv.start()
    yield srv
    srv.stop()


def test_a_request_line_and_headers_within_the_budget_are_served(small_headers):
    conn = http.client.HTTPConnection("127.0.0.1", small_headers.port, timeout=10)
    try:
        conn.request("POST", "/echo", body=b"{}", headers={"X-Pad": "a" * 800})
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    assert small_headers.stats.refused_headers == 0


@pytest.mark.parametrize("head", [
    b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1100,  # one header line past the budget, never ended
    b"GET /ok HTTP/1.1\r\n" + b"X-Pad: aaaaaaaa\r\n" * 80,  # many short lines past it, no blank line
    b"GET /" + b"a" * 1100,  # the request line alone
])
def test_headers_past_the_budget_get_431_before_they_end_and_the_connection_is_closed(small_headers, head):
    """The stdlib alone reads 100 lines of 64 KiB (6.5 MB per connection) before anything checks
    who sent them; here the answer comes while the client is still sending, after 1 KiB."""
    with ExitStack() as stack:
        sock = opened(stack, small_headers.port, head)
        answer = _answer_head(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
    assert b"more than 1024 bytes" in answer
    assert small_headers.stats.refused_headers == 1


def test_the_header_budget_holds_for_every_request_of_a_kept_alive_connection(small_headers):
    conn = http.client.HTTPConnection("127.0.0.1", small_headers.port, timeout=10)
    try:
        for _ in range(5):  # each request has its own budget: 5 x 800 bytes pass on one connection
            conn.request("GET", "/ok", headers={"X-Pad": "a" * 800})
            response = conn.getresponse()
            assert (response.status, response.read()) == (200, b"ok")
    finally:
        conn.close()


def test_limits_refuse_a_header_budget_of_nothing():
    with pytest.raises(ValueError, match="max_header_bytes"):
        ServerLimits(max_header_bytes=0)
