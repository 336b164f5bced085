#!/usr/bin/env python3
"""Legitimate calls while slow and greedy clients hold the server (issue 11 §2).

The server is qgpu's own JSON server (``qgpu_runtime.serving.JsonServer``) exactly as the
extender runs it: HTTPS with client-certificate authentication and the production
``ServerLimits`` (256 connections, 16 in flight, 10 s header and body deadlines). Its one route
parses an extender-sized JSON body, so the figures are the transport's, not the placement's.

Three phases, each with the same legitimate client (a new TLS connection with kube-scheduler's
client certificate per call, as kube-scheduler opens when its two idle connections are busy):
1. quiet: no flood;
2. idle flood: ``--idle`` TCP connections that never start TLS (more than the connection cap);
3. slow flood: ``--slow`` authenticated connections that send headers without the blank line and
   ``--slow`` that announce a body and never send it, on top of the idle ones.
Reported: p50/p99/max latency and failures of the legitimate calls in each phase, the connections
the server held, and how many it refused or evicted.

Run: .venv/bin/python bench/flood_bench.py [--idle 400 --slow 60 --calls 200] [--markdown]
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import ssl
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qgpu_runtime.serving import JsonServer, Routes, ServerLimits  # noqa: E402
from tests.k8s.pki import CertificateAuthority  # noqa: E402

SLOW_HEADERS = b"POST /filter HTTP/1.1\r\nHost: x\r\n"
SLOW_BODY = b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"


def filter_like(rest: str, body: bytes) -> tuple[int, object]:
    doc = json.loads(body)
    return 200, {"NodeNames": doc.get("NodeNames", []), "FailedNodes": {}, "Error": ""}


def legitimate(port: int, ctx: ssl.SSLContext, body: bytes) -> float | None:
    t = time.perf_counter()
    try:
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
        conn.request("POST", "/filter", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        conn.close()
        return time.perf_counter() - t if response.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None


def phase(name: str, port: int, ctx: ssl.SSLContext, body: bytes, calls: int, server: JsonServer) -> dict:
    times, failed = [], 0
    for _ in range(calls):
        took = legitimate(port, ctx, body)
        if took is None:
            failed += 1
        else:
            times.append(took)
    ms = sorted(1000 * t for t in times)
    quantile = (lambda q: round(statistics.quantiles(ms, n=100, method="inclusive")[q - 1], 2)) if len(ms) > 1 else (lambda q: None)
    return {"phase": name, "calls": calls, "failed": failed, "p50_ms": quantile(50), "p99_ms": quantile(99),
            "max_ms": round(ms[-1], 2) if ms else None, "server_connections": len(server.connections)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=400, help="idle TCP connections that never start TLS")
    parser.add_argument("--slow", type=int, default=60, help="slow-header and slow-body connections (each)")
    parser.add_argument("--calls", type=int, default=200, help="legitimate calls per phase")
    parser.add_argument("--nodes", type=int, default=1000, help="node names in each legitimate call's body")
    parser.add_argument("--markdown", action="store_true", help="append a section to docs/benchmarks.md")
    args = parser.parse_args()
    for name in ("idle", "slow", "calls", "nodes"):
        if getattr(args, name) < (0 if name in ("idle", "slow") else 1):
            parser.error(f"--{name} {getattr(args, name)}: out of range")
    workdir = Path(tempfile.mkdtemp(prefix="qgpu-flood-"))
    ca = CertificateAuthority(workdir, "flood-ca")
    serving = ca.issue("server", "qgpu-extender", server=True, hosts=("127.0.0.1",))
    scheduler = ca.issue("scheduler", "system:kube-scheduler", client=True)
    limits = ServerLimits()
    server = JsonServer("127.0.0.1", 0, Routes(post={"/filter": filter_like}, get={}), str(serving.cert), str(serving.key),
                        limits=limits, client_ca_file=str(ca.cert_path))
    server.start()
    ctx = ssl.create_default_context(cafile=str(ca.cert_path))
    ctx.load_cert_chain(str(scheduler.cert), str(scheduler.key))
    body = json.dumps({"Pod": {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}},
                       "NodeNames": [f"node-{i:05d}" for i in range(args.nodes)]}).encode()
    result: dict = {"limits": {"max_connections": limits.max_connections, "max_in_flight": limits.max_in_flight,
                               "header_timeout_s": limits.header_timeout_s, "body_timeout_s": limits.body_timeout_s},
                    "idle": args.idle, "slow": args.slow, "body_bytes": len(body), "phases": []}
    try:
        result["phases"].append(phase("quiet", server.port, ctx, body, args.calls, server))
        with ExitStack() as flood:
            opened = 0
            for _ in range(args.idle):
                try:
                    flood.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=5))
                    opened += 1
                except OSError:
                    break
            time.sleep(0.5)
            result["idle_opened"] = opened
            result["phases"].append(phase("idle flood", server.port, ctx, body, args.calls, server))
            slow_opened = 0
            for first in [SLOW_HEADERS] * args.slow + [SLOW_BODY] * args.slow:
                try:
                    raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                    sock = flood.enter_context(ctx.wrap_socket(raw, server_hostname="127.0.0.1"))
                    sock.sendall(first)
                    slow_opened += 1
                except OSError:
                    continue
            result["slow_opened"] = slow_opened
            result["phases"].append(phase("idle + slow flood", server.port, ctx, body, args.calls, server))
        connections = server.connections
        result["refused"] = getattr(connections, "refused", None)
        result["evicted"] = getattr(connections, "evicted", None)
        result["expired"] = getattr(connections, "expired", None)
    finally:
        server.stop()
    result["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(json.dumps(result, indent=2))
    if args.markdown:
        append_markdown(result, args)
    return 0


def append_markdown(r: dict, args: argparse.Namespace) -> None:
    lines = [f"\n### Legitimate calls during a connection flood ({r['date']})\n",
             f"    .venv/bin/python bench/flood_bench.py --idle {args.idle} --slow {args.slow} --calls {args.calls}\n",
             f"HTTPS with client certificates and the production limits ({r['limits']['max_connections']} connections, "
             f"{r['limits']['max_in_flight']} in flight, {r['limits']['header_timeout_s']:g} s header and body deadlines); "
             f"each legitimate call opens a new TLS connection with kube-scheduler's certificate and posts a "
             f"{r['body_bytes'] // 1024} KiB filter body. Flood: {r.get('idle_opened')} idle TCP connections, then "
             f"{r.get('slow_opened')} authenticated slow-header/slow-body ones on top.\n",
             "| phase | calls | failed | p50 ms | p99 ms | max ms | connections the server held |",
             "|---|---|---|---|---|---|---|"]
    for p in r["phases"]:
        lines.append(f"| {p['phase']} | {p['calls']} | {p['failed']} | {p['p50_ms']} | {p['p99_ms']} | {p['max_ms']} | {p['server_connections']} |")
    lines.append(f"\nConnections refused at the cap: {r.get('refused')}; idle ones evicted for newcomers: {r.get('evicted')}; "
                 f"closed at a deadline: {r.get('expired')}.\n")
    with (ROOT / "docs" / "benchmarks.md").open("a") as handle:
        handle.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
