"""HTTP/2 abuse: the classic attacks on an HTTP/2 server (rapid reset, CONTINUATION and control
frame floods, HPACK tables, flow control held shut, streams past the limit, bodies past theirs)
against :class:`qgpu_runtime.serving._H2Session`, from a client without a certificate and from a
certified one that misbehaves. Each test says what it bounds; the client is the h2 library over a
TLS socket, frame by frame (tests/extender/h2client.py)."""

from __future__ import annotations

import gc
import socket
import ssl
import threading
import time
from typing import Any, Iterator

import pytest
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hpack import Encoder
from hyperframe.frame import ContinuationFrame, DataFrame, HeadersFrame, PingFrame, PriorityFrame, RstStreamFrame, SettingsFrame

from qgpu_runtime.serving import H2_CLOSED_STREAMS, H2_HEADER_TABLE, H2_MAX_STREAMS, JsonServer, RawJSON, Routes, ServerLimits
from tests.extender.h2client import Client, connect
from tests.k8s.pki import CertificateAuthority, KeyPair
from tests.polling import poll

LIMITS = ServerLimits(max_connections=8, max_in_flight=2, idle_timeout_s=30.0, header_timeout_s=2.0, body_timeout_s=0.5,
                      min_body_rate=1e6, write_timeout_s=0.5, busy_wait_s=1.0, watch_interval_s=0.05)
HUGE = RawJSON(b'"' + b"x" * (8 * 1024 * 1024) + b'"')  # past what loopback buffers (4 MiB to send, 4 KiB to receive)
release = threading.Event()
calls: dict[str, int] = {"slow": 0, "quick": 0}


def echo(rest: str, body: bytes) -> tuple[int, Any]:
    return 200, {"verb": rest, "got": len(body)}


def slow(rest: str, body: bytes) -> tuple[int, Any]:
    calls["slow"] += 1
    release.wait(10)
    return 200, {"slow": True}


def quick(rest: str, body: bytes) -> tuple[int, Any]:
    calls["quick"] += 1
    return 200, {"quick": len(body)}


def pad(rest: str, body: bytes) -> tuple[int, Any]:
    """An answer whose length the caller picks (a distinct Content-Length per request)."""
    return 200, RawJSON(b'"' + b"x" * int(rest or 0) + b'"')


@pytest.fixture
def server(pki: tuple[CertificateAuthority, KeyPair, KeyPair]) -> Iterator[JsonServer]:
    ca, cert, _ = pki
    release.clear()
    calls.update(slow=0, quick=0)
    routes = Routes(post={"/echo": echo, "/slow": slow, "/quick": quick, "/small": echo, "/pad": pad},
                    get={"/healthz": lambda: (200, "text/plain", b"ok"), "/huge": lambda: (200, "application/json", HUGE)},
                    body_limits={"/small": 100}, open_paths=frozenset({"/healthz"}), inline=frozenset({"/quick"}))
    srv = JsonServer("127.0.0.1", 0, routes, str(cert.cert), str(cert.key), limits=LIMITS, client_ca_file=str(ca.cert_path))
    srv.start()
    yield srv
    release.set()
    srv.stop()


def flood(c: Client, frames: bytes, times: int) -> bool:
    """Send ``frames`` ``times`` times without reading; False once the server stopped taking them."""
    c.sock.settimeout(2.0)
    try:
        for _ in range(times):
            c.sock.sendall(frames)
    except (OSError, ssl.SSLError):
        return False
    return True


def server_connections() -> list[H2Connection]:
    """The server's h2 connections in this process (the tests' clients are client-side)."""
    return [o for o in gc.get_objects() if isinstance(o, H2Connection) and not o.config.client_side]


GET_HEALTHZ = [(":method", "GET"), (":path", "/healthz"), (":scheme", "https"), (":authority", "127.0.0.1")]


def healthz(c: Client) -> tuple[int, Any]:
    """GET /healthz answered, asked again while the server refuses it with REFUSED_STREAM (as any
    client may retry): requests the client reset still wait for a worker to drop them, and count
    against the 100 a connection may have waiting until then."""
    for _ in range(100):
        sid = c.send("GET", "/healthz")
        assert c.pump(lambda: sid in c.ended or sid in c.reset), "the server closed the connection"
        if sid in c.ended:
            return c.answer(sid)
        time.sleep(0.05)
    raise AssertionError("GET /healthz refused 100 times")


# -- rapid reset (CVE-2023-44487) ------------------------------------------------------------------


def test_rapid_reset_without_a_certificate_is_cut_at_the_header_budget(server, pki):
    """HEADERS then RST_STREAM, never a complete request: what an unproven connection sends counts
    against max_header_bytes, so it is closed after ~32 KiB of them (ENHANCE_YOUR_CALM)."""
    c = connect(server.port, pki, certificate=False)
    try:
        encoder = Encoder()
        first, block = encoder.encode(GET_HEALTHZ), encoder.encode(GET_HEALTHZ)  # then all indexed
        frames = b""
        for sid in range(1, 2 * 2000, 2):
            frames += HeadersFrame(sid, data=first if sid == 1 else block, flags=["END_HEADERS"]).serialize()
            frames += RstStreamFrame(sid, error_code=ErrorCodes.CANCEL).serialize()
        flood(c, frames, 1)
        assert c.closed()
        assert c.terminated is None or c.terminated.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    finally:
        c.close()
    assert server.stats.refused_headers == 1
    poll(lambda: len(server.connections) == 0, timeout=5, what="the connection gone")


def test_completed_requests_reset_at_once_leave_bounded_state_per_connection(server, pki):
    """GET /healthz (open to every caller) ended and reset at once, thousands of times: h2 keeps a
    record of every closed stream (65,536 by default, ~7.6 MB per connection); the server keeps
    H2_CLOSED_STREAMS."""
    c = connect(server.port, pki, certificate=False)
    try:
        n = 3 * H2_CLOSED_STREAMS
        for _ in range(n // 100):
            for _ in range(100):
                sid = c.conn.get_next_available_stream_id()
                c.conn.send_headers(sid, GET_HEALTHZ, end_stream=True)
                c.conn.reset_stream(sid)
            c.sock.sendall(c.conn.data_to_send())
            # read before the next batch: an unproven connection's read past max_header_bytes is closed
            assert healthz(c) == (200, b"ok")
        remembered = [len(conn._closed_streams) for conn in server_connections()]
        assert remembered and max(remembered) <= H2_CLOSED_STREAMS, remembered
    finally:
        c.close()


# -- CONTINUATION, header lists, HPACK -------------------------------------------------------------


def test_a_header_list_past_its_limit_from_a_certified_client_closes_only_that_connection(server, pki, client):
    """h2 decodes at most 64 KiB of header list (SETTINGS_MAX_HEADER_LIST_SIZE) and buffers at most
    64 CONTINUATION frames; past either the connection is closed, others serve on."""
    big = connect(server.port, pki)
    try:
        big.conn.config.validate_outbound_headers = False
        sid = big.conn.get_next_available_stream_id()
        big.conn.send_headers(sid, GET_HEALTHZ + [(f"x-pad-{i}", "a" * 1000) for i in range(80)], end_stream=True)
        big.sock.sendall(big.conn.data_to_send())
        assert big.closed()
    finally:
        big.close()
    assert server.stats.http2_protocol_errors == 1
    assert client.answer(client.send("GET", "/healthz")) == (200, b"ok")


def test_a_continuation_flood_from_a_certified_client_closes_only_that_connection(server, pki, client):
    """The header budget holds only connections without a certificate; a certified one is held to
    h2's 64 CONTINUATION frames (~1 MiB buffered), then closed as a protocol error."""
    c = connect(server.port, pki)
    try:
        c.sock.sendall(HeadersFrame(1, data=b"\x82").serialize())  # :method GET, no END_HEADERS
        flood(c, ContinuationFrame(1, data=b"\x00" * 16384).serialize(), 100)  # ~1.6 MiB, never END_HEADERS
        assert c.closed()
    finally:
        c.close()
    assert server.stats.http2_protocol_errors == 1
    assert client.answer(client.send("GET", "/healthz")) == (200, b"ok")


def test_a_header_that_is_not_utf8_closes_only_that_connection(server, pki, client):
    c = connect(server.port, pki, certificate=False)
    try:
        block = Encoder().encode([(b":method", b"GET"), (b":path", b"/healthz"), (b":scheme", b"https"),
                                  (b":authority", b"127.0.0.1"), (b"x-bad", b"\xff\xfe")])
        c.sock.sendall(HeadersFrame(1, data=block, flags=["END_HEADERS", "END_STREAM"]).serialize())
        assert c.closed()
    finally:
        c.close()
    poll(lambda: len(server.connections) == 1, timeout=5, what="the connection closed")
    assert client.answer(client.send("GET", "/healthz")) == (200, b"ok")


def test_the_hpack_table_the_server_encodes_with_stays_at_4096_bytes_whatever_the_client_allows(server, client):
    """A client may allow a dynamic table of 4 GiB (SETTINGS_HEADER_TABLE_SIZE); h2 then indexes
    every distinct Content-Length the server sends, each a table entry it keeps and searches
    linearly for every answer. The server uses at most H2_HEADER_TABLE bytes of it, as Go does."""
    client.conn.update_settings({SettingCodes.HEADER_TABLE_SIZE: 2**31})
    client.sock.sendall(client.conn.data_to_send())
    for n in range(300):
        assert client.answer(client.send("POST", f"/pad/{n}", b"{}"))[0] == 200
    table = client.conn.decoder.header_table  # mirrors the server's encoder
    assert table._current_size <= H2_HEADER_TABLE, (table._current_size, len(table.dynamic_entries))


# -- control frame floods --------------------------------------------------------------------------


@pytest.mark.parametrize("frame", [
    PingFrame(0, opaque_data=b"12345678").serialize(),
    SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 65535}).serialize(),
    PriorityFrame(3, depends_on=0, stream_weight=16).serialize(),
], ids=["PING", "SETTINGS", "PRIORITY"])
def test_a_control_frame_flood_without_a_certificate_is_cut_at_the_header_budget(server, pki, frame):
    c = connect(server.port, pki, certificate=False)
    try:
        flood(c, frame * 100, 40)
        assert c.closed()
    finally:
        c.close()
    assert server.stats.refused_headers == 1


def test_a_certified_client_that_floods_pings_and_never_reads_is_closed_at_the_write_deadline(server, pki, client):
    """Every PING and SETTINGS is answered; the answers go out at once (nothing queues in the
    server), so a client that reads none of them blocks the send, and write_timeout_s closes it."""
    c = connect(server.port, pki)
    try:
        assert not flood(c, PingFrame(0, opaque_data=b"12345678").serialize() * 1000, 2000)
        poll(lambda: len(server.connections) == 1, timeout=5, what="the flooding connection closed")
    finally:
        c.close()
    assert client.answer(client.send("GET", "/healthz")) == (200, b"ok")


# -- flow control held shut ------------------------------------------------------------------------


def test_a_client_that_stops_reading_mid_answer_is_closed_and_frees_its_slot(server, pki):
    """A client that opens its windows wide, asks for a large answer and then reads nothing: the
    handler's send blocks in the kernel, not in h2's flow control. Its socket timeout
    (write_timeout_s) must end the connection, not leave it open in the 'working' phase, which has
    no deadline and cannot be evicted for a newcomer."""
    c = connect(server.port, pki, window=2**31 - 1)
    try:
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.conn.increment_flow_control_window(2**31 - 1 - 65535)
        c.send("GET", "/huge")
        poll(lambda: len(server.connections) == 0, timeout=10, what="the connection that reads nothing closed")
    finally:
        c.close()


def test_a_client_that_never_opens_its_window_holds_no_handler_and_no_slot(server, pki, client):
    """Answers wait in the session for the client's window, not in a worker or a handler slot:
    with every handler slot's worth of answers stuck, other requests are still served."""
    stuck = connect(server.port, pki, window=0)
    try:
        sids = [stuck.send("POST", "/echo", b"{}") for _ in range(3 * LIMITS.max_in_flight)]
        assert stuck.pump(lambda: all(sid in stuck.status for sid in sids))  # every handler ran: headers sent
        assert not any(sid in stuck.ended for sid in sids)  # bodies waiting for a window that never opens
        assert client.answer(client.send("POST", "/echo", b"{}")) == (200, {"verb": "", "got": 2})
    finally:
        stuck.close()


# -- streams past the limit ------------------------------------------------------------------------


def test_streams_past_max_concurrent_streams_close_the_connection(server, pki, client):
    c = connect(server.port, pki)
    try:
        for _ in range(H2_MAX_STREAMS + 1):
            c.send("POST", "/echo", b"{", end=False)  # open, never ended
        assert c.closed()
        assert c.terminated is not None and c.terminated.error_code == ErrorCodes.PROTOCOL_ERROR
    finally:
        c.close()
    poll(lambda: server.bodies_held() == 0, timeout=5, what="the open streams' bytes released")
    assert client.answer(client.send("GET", "/healthz")) == (200, b"ok")


# -- bodies ----------------------------------------------------------------------------------------


def test_data_past_the_paths_limit_is_refused_and_the_rest_of_the_stream_dropped(server, client):
    sid = client.send("POST", "/small", b"x" * 16384, end=False)
    status, doc = client.answer(sid)
    assert status == 413 and "more than 100 bytes" in doc["Error"]
    for _ in range(8):  # the client goes on sending: dropped, its window credited
        client.more(sid, b"x" * 16384)
    client.more(sid, b"", end=True)
    assert server.bodies_held() == 0
    assert client.answer(client.send("POST", "/echo", b"x" * 16000)) == (200, {"verb": "", "got": 16000})


def test_data_after_end_stream_resets_that_stream_only(server, client):
    sid = client.send("POST", "/slow", b"{}")
    client.sock.sendall(DataFrame(sid, data=b"more").serialize())  # past END_STREAM
    assert client.pump(lambda: sid in client.reset)
    assert client.answer(client.send("POST", "/echo", b"{}")) == (200, {"verb": "", "got": 2})
    release.set()
    poll(lambda: server.bodies_held() == 0, timeout=5, what="the reset stream's body released")


# -- inline paths ----------------------------------------------------------------------------------


def test_inline_requests_in_one_read_wait_for_a_handler_slot_busy_wait_s_in_all(server, client):
    """Inline requests run one after another on the reading thread; while every handler slot is
    taken, each would wait busy_wait_s for one, and the connection reads nothing meanwhile (its
    window updates, its other requests). A batch waits busy_wait_s in all, then is refused."""
    held = [client.send("POST", "/slow", b"{}") for _ in range(LIMITS.max_in_flight)]
    poll(lambda: calls["slow"] == LIMITS.max_in_flight, timeout=5, what="the handler slots taken")
    n = 10
    sids = []
    for _ in range(n):
        sids.append(client.conn.get_next_available_stream_id())
        client.conn.send_headers(sids[-1], [(":method", "POST"), (":path", "/quick"), (":scheme", "https"),
                                            (":authority", "127.0.0.1")], end_stream=True)
    started = time.monotonic()
    client.sock.sendall(client.conn.data_to_send())  # one write: one read
    answers = [client.answer(s) for s in sids]
    took = time.monotonic() - started
    assert [status for status, _ in answers] == [503] * n
    # busy_wait_s in all (not n * busy_wait_s): half of n of them leaves a wide margin for a loaded machine
    assert took < n * LIMITS.busy_wait_s / 2, took
    release.set()
    assert [client.answer(s)[0] for s in held] == [200] * LIMITS.max_in_flight
    assert client.answer(client.send("POST", "/quick", b"{}")) == (200, {"quick": 2})


def test_an_unfinished_inline_request_does_not_hold_up_other_streams(server, client):
    """An inline request runs once complete; one whose body trickles holds nobody up."""
    sid = client.send("POST", "/quick", b'{"a":', end=False, length=100)
    assert client.answer(client.send("POST", "/quick", b"{}")) == (200, {"quick": 2})
    assert client.answer(client.send("POST", "/echo", b"{}")) == (200, {"verb": "", "got": 2})
    client.more(sid, b"1}" + b" " * 93, end=True)
    assert client.answer(sid) == (200, {"quick": 100})


# -- descriptors -----------------------------------------------------------------------------------


def test_a_connection_on_a_descriptor_past_1023_is_served(server, pki):
    """select() refuses descriptors past FD_SETSIZE (1024): with that many open in the process
    (connections, watches, files), every HTTP/2 connection closed at its first wait."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard) if hard != resource.RLIM_INFINITY else 4096, hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # the next sockets land past 1023
    try:
        c = connect(server.port, pki)
        try:
            assert c.answer(c.send("POST", "/echo", b"{}")) == (200, {"verb": "", "got": 2})
            assert c.answer(c.send("POST", "/quick", b"{}"))[0] == 200
        finally:
            c.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_request_ended_and_reset_in_one_read_past_the_waiting_limit_keeps_the_connection(server, client):
    """Requests ended and reset at once wait (for a worker to drop them) until the read is handled;
    past H2_MAX_STREAMS waiting, a complete one is refused with REFUSED_STREAM. Reset by the client
    in the same read, h2 had closed it already, and refusing it raised: the connection was closed
    with PROTOCOL_ERROR."""
    for _ in range(H2_MAX_STREAMS + 5):
        sid = client.conn.get_next_available_stream_id()
        client.conn.send_headers(sid, GET_HEALTHZ, end_stream=True)
        client.conn.reset_stream(sid)
    client.sock.sendall(client.conn.data_to_send())  # one write: one read
    assert healthz(client) == (200, b"ok")
    assert client.terminated is None, client.terminated
