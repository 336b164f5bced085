"""Inline paths over HTTP/2 (``Routes.inline``): a quick handler such as the extender's filter runs
on the connection's reading thread instead of the worker pool, under the same limits, and a slow
handler on the pool does not hold it up."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest

from qgpu_runtime.serving import JsonServer, Routes, ServerLimits
from tests.k8s.pki import CertificateAuthority, KeyPair

LIMITS = ServerLimits(max_connections=8, max_in_flight=1, idle_timeout_s=30.0, header_timeout_s=2.0, body_timeout_s=0.5,
                      min_body_rate=1e6, write_timeout_s=0.5, busy_wait_s=0.3, watch_interval_s=0.05)
release = threading.Event()
threads: dict[str, list[str]] = {"inline": [], "pool": []}


def on_thread(kind: str) -> Any:
    def handler(rest: str, body: bytes) -> tuple[int, Any]:
        threads[kind].append(threading.current_thread().name)
        if rest == "slow":
            release.wait(10)
        return 200, {"kind": kind, "rest": rest, "got": len(body)}
    return handler


@pytest.fixture
def server(pki: tuple[CertificateAuthority, KeyPair, KeyPair]) -> Iterator[JsonServer]:
    ca, cert, _ = pki
    release.clear()
    for names in threads.values():
        names.clear()
    routes = Routes(post={"/quick": on_thread("inline"), "/pool": on_thread("pool")}, get={},
                    body_limits={"/quick": 100}, token_limits={"/quick": 10}, inline=frozenset({"/quick"}))
    srv = JsonServer("127.0.0.1", 0, routes, str(cert.cert), str(cert.key), limits=LIMITS, client_ca_file=str(ca.cert_path))
    srv.start()
    yield srv
    release.set()
    srv.stop()


def test_an_inline_path_runs_on_the_connections_reading_thread_and_every_other_on_the_pool(server, client):
    assert client.protocol == "h2"
    assert client.answer(client.send("POST", "/quick", b"{}")) == (200, {"kind": "inline", "rest": "", "got": 2})
    assert client.answer(client.send("POST", "/quick", b"{}")) == (200, {"kind": "inline", "rest": "", "got": 2})
    assert client.answer(client.send("POST", "/pool", b"{}")) == (200, {"kind": "pool", "rest": "", "got": 2})
    assert len(set(threads["inline"])) == 1  # one connection, one reading thread
    assert not threads["inline"][0].startswith("http2")
    assert threads["pool"][0].startswith("http2")


def test_only_the_exact_inline_path_is_inline(server, client):
    """A path under an inline route's prefix (``/quick/x``) is served by the same handler on the pool."""
    assert client.answer(client.send("POST", "/quick/x", b"{}")) == (200, {"kind": "inline", "rest": "x", "got": 2})
    assert threads["inline"][0].startswith("http2")


def test_an_inline_request_keeps_the_in_flight_limit_and_the_body_and_token_limits(server, client):
    slow = client.send("POST", "/pool/slow", b"{}")  # the one handler slot, held
    time.sleep(0.1)
    status, doc = client.answer(client.send("POST", "/quick", b"{}"))
    assert status == 503 and "1 requests in flight" in doc["Error"]
    release.set()
    assert client.answer(slow) == (200, {"kind": "pool", "rest": "slow", "got": 2})
    status, doc = client.answer(client.send("POST", "/quick", b"x" * 101))
    assert status == 413 and "more than 100 bytes" in doc["Error"]
    status, doc = client.answer(client.send("POST", "/quick", b"[" + b"{}," * 20 + b"{}]"))
    assert status == 413 and "JSON tokens" in doc["Error"]
    assert server.stats.refused_busy == 1 and server.stats.refused_too_large == 2


def test_an_inline_request_reset_in_the_same_read_as_its_end_is_not_handled(server, client):
    sid = client.send("POST", "/quick", b"{}", end=False)
    client.conn.send_data(sid, b"", end_stream=True)
    client.conn.reset_stream(sid)
    client.sock.sendall(client.conn.data_to_send())  # END_STREAM and RST_STREAM in one write
    assert client.answer(client.send("POST", "/pool", b"{}"))[0] == 200
    assert threads["inline"] == []
    poll_held = time.monotonic() + 5
    while server.bodies_held() and time.monotonic() < poll_held:
        time.sleep(0.02)
    assert server.bodies_held() == 0
