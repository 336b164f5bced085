#!/usr/bin/env python3
"""Peak memory of qgpu's HTTP server under a header flood from callers without credentials.

Before any handler runs, and so before anything checks who is calling, a server reads the request
line and the headers. ``JsonServer`` (``qgpu_runtime/serving.py``: the extender, the webhook, a
node manager's ``/metrics``) reads them through ``ServerLimits.max_header_bytes``; the stdlib alone
takes 100 lines of 64 KiB each. Each scenario starts a fresh server process from ``--tree`` (this
checkout by default; a worktree of an older commit gives the "before"), opens N connections that
send a request line and then 98 header lines of 64 KiB each (then the blank line), and reports the
server's peak resident memory (``VmHWM``) and how many connections the server closed while they
were still sending.

Scenarios: ``metrics`` (``metrics_server``, plain HTTP, its 32-connection cap) and ``tls`` (TLS
with a client CA as the extender runs, HTTP/2 offered, callers without a certificate, POST).

Run: .venv/bin/python bench/header_flood.py [--tree DIR] [--metrics-connections 32] [--tls-connections 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.k8s.pki import CertificateAuthority  # noqa: E402

SERVER = """
import sys, time
sys.path.insert(0, {tree!r})
from prometheus_client import CollectorRegistry
from qgpu_runtime.serving import JsonServer, Routes, metrics_server
routes = Routes(post={{"/": lambda verb, body: (200, {{}})}}, get={{"/healthz": lambda: (200, "text/plain", b"ok")}},
                open_paths=frozenset({{"/healthz"}}))
if {kind!r} == "metrics":
    server = metrics_server("127.0.0.1", 0, CollectorRegistry())
else:
    server = JsonServer("127.0.0.1", 0, routes, {cert!r}, {key!r}, client_ca_file={ca!r}, http2=True)
    server.start()
print(server.port, flush=True)
time.sleep(600)
"""


def memory_mib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) // 1024
    raise RuntimeError(f"{key} not in /proc/{pid}/status")


def flood(tree: Path, kind: str, connections: int, pki: dict[str, str]) -> dict[str, object]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER.format(tree=str(tree), kind=kind, **pki)],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        start = memory_mib(proc.pid, "VmRSS")
        ctx = ssl.create_default_context(cafile=pki["ca"])
        ctx.check_hostname = False
        socks = []
        for _ in range(connections):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            if kind == "tls":
                sock = ctx.wrap_socket(sock)
            sock.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\n" if kind == "tls" else b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            socks.append(sock)
        line = b"X-Pad: " + b"a" * 65500 + b"\r\n"
        closed = set()
        for _ in range(98):
            for i, sock in enumerate(socks):
                if i in closed:
                    continue
                try:
                    sock.sendall(line)
                except OSError:
                    closed.add(i)
        for i, sock in enumerate(socks):
            if i not in closed:
                try:
                    sock.sendall(b"\r\n")
                except OSError:
                    closed.add(i)
        time.sleep(0.5)
        peak = memory_mib(proc.pid, "VmHWM")
        for sock in socks:
            sock.close()
        return {"tree": str(tree), "scenario": kind, "connections": connections, "rss_at_start_mib": start,
                "peak_rss_mib": peak, "closed_by_server_while_sending": len(closed)}
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose qgpu_runtime serves (default: this one)")
    parser.add_argument("--metrics-connections", type=int, default=32)
    parser.add_argument("--tls-connections", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ca = CertificateAuthority(Path(tmp))
        server = ca.issue("server", "server", server=True, hosts=("127.0.0.1",))
        pki = {"ca": str(ca.cert_path), "cert": str(server.cert), "key": str(server.key)}
        results = [flood(args.tree.resolve(), "metrics", args.metrics_connections, pki),
                   flood(args.tree.resolve(), "tls", args.tls_connections, pki)]
    print(json.dumps({"results": results, "machine": f"{platform.machine()}, Python {platform.python_version()}",
                      "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
