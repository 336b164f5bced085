"""The metrics port under a stranger's connections: the node manager's ``/metrics`` (plain HTTP,
reachable by anyone with a route to the pod, and the manager's liveness probe) and the standalone
manager's. prometheus_client's own server took a thread per connection and never closed an idle
one: 3,000 idle connections held 3,000 threads and ~100 MiB of the manager's 300 MiB limit."""

from __future__ import annotations

import argparse
import logging
import socket
import threading
import urllib.request
from contextlib import ExitStack
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter

from qgpu_runtime.node.cli import _serve_metrics
from qgpu_runtime.serving import METRICS_LIMITS, metrics_server
from tests.polling import poll


def registry_with_a_counter() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("qgpu_probe_total", "a counter the test reads back", registry=registry).inc(3)
    return registry


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode()


def test_idle_connections_take_no_more_than_the_cap_and_the_scrape_is_answered():
    server = metrics_server("127.0.0.1", 0, registry_with_a_counter())
    try:
        before = threading.active_count()
        with ExitStack() as flood:
            for _ in range(200):
                flood.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=10))
            assert "qgpu_probe_total 3.0" in scrape(server.port)
            # one thread per connection the server keeps, and it keeps at most the cap (the thread
            # of a connection closed for a newcomer ends soon after its socket: waited for, not raced)
            poll(lambda: threading.active_count() - before <= METRICS_LIMITS.max_connections + 1,
                 timeout=10, what="the threads of connections closed for newcomers to end")
            assert len(server.connections) <= METRICS_LIMITS.max_connections
    finally:
        server.stop()


def test_the_metrics_port_serves_nothing_but_the_metrics():
    server = metrics_server("127.0.0.1", 0, registry_with_a_counter())
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
            assert sock.recv(64).split(b"\r\n")[0].split(b" ")[1] == b"404"
        assert server.stats.body_bytes_peak == 0
    finally:
        server.stop()


def test_the_node_manager_serves_its_registry_through_the_bounded_server():
    registry = registry_with_a_counter()
    manager = SimpleNamespace(metrics=SimpleNamespace(registry=registry))
    args = argparse.Namespace(metrics_port=0, metrics_address="127.0.0.1")
    server = _serve_metrics(args, manager, logging.getLogger("test"))
    try:
        assert server is not None
        assert server.limits == METRICS_LIMITS
        assert "qgpu_probe_total 3.0" in scrape(server.port)
    finally:
        server.stop()
    assert _serve_metrics(argparse.Namespace(metrics_port=-1, metrics_address="127.0.0.1"), manager,
                          logging.getLogger("test")) is None
