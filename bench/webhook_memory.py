#!/usr/bin/env python3
"""Peak memory of `qgpu webhook serve` under concurrent maximum-size bodies (issue 21 §2).

The webhook runs as it does in its pod: a child process with TLS and ``--client-ca-file`` (plus
``--dra`` off: its paths share the same server and limits). Each scenario gets a fresh process, and
its peak resident memory is the kernel's high-water mark (``VmHWM`` in /proc/<pid>/status), read
after the scenario, against the container limit of templates/kubernetes/qgpu-webhook.yaml.j2
(256 Mi). The server's own accounting (``ServerStats``: refusals, peak body bytes) comes from the
in-process variant of each check in tests/webhook/test_webhook_serving.py; here only memory.

Scenarios (``--clients`` concurrent callers each):
- idle: started, one /healthz;
- unauthenticated 8 MiB: callers without a client certificate send 8 MiB bodies;
- authenticated 8 MiB: the apiserver's certificate, 8 MiB bodies (over the cap);
- at the cap, plain: reviews of exactly the cap (a GPU pod with a long annotation);
- at the cap, worst decode: reviews of the cap whose object holds as many empty objects as the
  token limit allows (the shape that decodes to the most Python objects per byte).
Also: how much json.loads of 3 MiB of each shape takes in this process (the expansion factor).

Run: .venv/bin/python bench/webhook_memory.py [--clients 8] [--markdown]
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import platform
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qgpu_runtime.webhook.cli import MAX_REVIEW_BYTES, MAX_REVIEW_TOKENS, WEBHOOK_LIMITS  # noqa: E402
from tests.k8s.pki import CertificateAuthority, KeyPair  # noqa: E402

EIGHT_MIB = 8 * 1024 * 1024
CONTAINER_LIMIT_MIB = 256
GPU_POD = {"metadata": {"name": "p", "namespace": "ns"},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {"tke.cloud.tencent.com/qgpu-core": "40",
                                                                          "tke.cloud.tencent.com/qgpu-memory": "4"}}}]}}


def review(obj: dict) -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE", "namespace": "ns", "object": obj}}


def padded_review() -> bytes:
    doc = review(json.loads(json.dumps(GPU_POD)))
    base = len(json.dumps(doc).encode())
    doc["request"]["object"]["metadata"]["annotations"] = {"pad": "x" * (MAX_REVIEW_BYTES - base - 32)}
    return json.dumps(doc).encode()


def worst_decode_review() -> bytes:
    """The cap's worth of bytes with the most decoded objects the token limit lets through."""
    doc = review(json.loads(json.dumps(GPU_POD)))
    body = json.dumps(doc).encode()
    spare = MAX_REVIEW_TOKENS - (body.count(b"{") + body.count(b"[") + body.count(b",") + body.count(b":")) - 16
    empties = "[" + ",".join(["{}"] * (spare // 2)) + "]"
    doc["request"]["object"]["spec"]["containers"][0]["env"] = "@@"
    compact = (",", ":")
    text = json.dumps(doc, separators=compact).replace('"@@"', empties)
    pad = MAX_REVIEW_BYTES - len(text.encode()) - 64
    doc2 = json.loads(text)
    doc2["request"]["object"]["metadata"]["annotations"] = {"pad": "x" * max(0, pad)}
    return json.dumps(doc2, separators=compact).encode()


def hwm_mib(pid: int) -> tuple[float, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["VmHWM"].split()[0]) / 1024, int(fields["VmRSS"].split()[0]) / 1024


class Webhook:
    def __init__(self, workdir: Path, server: KeyPair, client_ca: Path):
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qgpu_runtime.cli", "webhook", "serve", "--address", "127.0.0.1", "--port", str(self.port),
             "--tls-cert-file", str(server.cert), "--tls-private-key-file", str(server.key), "--client-ca-file", str(client_ca),
             "--log-level", "WARNING"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL, stderr=open(workdir / "webhook.log", "ab"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def send(port: int, ctx: ssl.SSLContext, body: bytes, announced: int | None = None) -> str:
    """POST ``body`` (all of it, as a greedy client does, whatever the server answers first)."""
    try:
        raw = socket.create_connection(("127.0.0.1", port), timeout=60)
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            length = len(body) if announced is None else announced
            sock.sendall(f"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {length}\r\n\r\n".encode())
            try:
                sock.sendall(body)
            except OSError:
                pass  # refused and closed before the body: what we want
            answer = sock.recv(64)
            return answer.split(b" ", 2)[1].decode() if answer else "closed"
    except (OSError, ssl.SSLError) as exc:
        return type(exc).__name__


def scenario(name: str, pki: dict, workdir: Path, clients: int, body: bytes | None, authenticated: bool) -> dict:
    hook = Webhook(workdir, pki["server"], pki["client_ca"])
    try:
        ctx = ssl.create_default_context(cafile=str(pki["ca"]))
        if authenticated:
            ctx.load_cert_chain(str(pki["client"].cert), str(pki["client"].key))
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = http.client.HTTPSConnection("127.0.0.1", hook.port, context=ssl.create_default_context(cafile=str(pki["ca"])), timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        statuses: list[str] = []
        if body is not None:
            lock = threading.Lock()

            def one() -> None:
                status = send(hook.port, ctx, body)
                with lock:
                    statuses.append(status)

            threads = [threading.Thread(target=one) for _ in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        gc.collect()
        peak, now = hwm_mib(hook.proc.pid)
        return {"scenario": name, "clients": clients if body is not None else 0, "body_bytes": len(body) if body else 0,
                "answers": {s: statuses.count(s) for s in sorted(set(statuses))}, "peak_rss_mib": round(peak, 1),
                "rss_after_mib": round(now, 1), "headroom_mib": round(CONTAINER_LIMIT_MIB - peak, 1)}
    finally:
        hook.stop()


def decode_expansion() -> list[dict]:
    """RSS growth of json.loads on 3 MiB of each shape, in this process; and its token count."""
    shapes = {"env entries {\"name\":\"x\",\"value\":\"y\"}": '{"name":"x","value":"y"},', "empty objects {}": "{},",
              "one-key objects {\"a\":0}": '{"a":0},', "short strings \"ab\"": '"ab",', "floats 1.5": "1.5,"}
    rows = []
    for label, unit in shapes.items():
        n = 3 * 1024 * 1024 // len(unit)
        body = ("[" + unit * n).rstrip(",").encode() + b"]"
        tokens = body.count(b"{") + body.count(b"[") + body.count(b",") + body.count(b":")
        gc.collect()
        before = hwm_current()
        obj = json.loads(body)
        after = hwm_current()
        del obj
        gc.collect()
        rows.append({"shape": label, "body_mib": round(len(body) / 2**20, 2), "tokens": tokens,
                     "decoded_mib": round(after - before, 1), "factor": round((after - before) / (len(body) / 2**20), 1),
                     "within_token_limit": tokens <= MAX_REVIEW_TOKENS})
    return rows


def hwm_current() -> float:
    return hwm_mib(os.getpid())[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--markdown", action="store_true", help="append a section to docs/benchmarks.md")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="qgpu-webhook-mem-"))
    serving = CertificateAuthority(workdir / "serving", "qgpu-webhook-ca")
    clients = CertificateAuthority(workdir / "clients", "qgpu-webhook-client-ca")
    pki = {"ca": serving.cert_path, "server": serving.issue("tls", "qgpu-webhook", server=True, hosts=("127.0.0.1",)),
           "client_ca": clients.cert_path, "client": clients.issue("apiserver", "kube-apiserver", client=True)}
    eight = b"[" + b"{}," * (EIGHT_MIB // 3 - 1) + b"{}]"
    runs = [scenario("idle", pki, workdir, args.clients, None, True),
            scenario("unauthenticated 8 MiB", pki, workdir, args.clients, eight, False),
            scenario("authenticated 8 MiB (over the cap)", pki, workdir, args.clients, eight, True),
            scenario("authenticated at the cap, plain", pki, workdir, args.clients, padded_review(), True),
            scenario("authenticated at the cap, worst decode", pki, workdir, args.clients, worst_decode_review(), True)]
    result = {"limits": {"body_cap_bytes": MAX_REVIEW_BYTES, "token_limit": MAX_REVIEW_TOKENS,
                         "body_budget_bytes": WEBHOOK_LIMITS.body_budget, "max_in_flight": WEBHOOK_LIMITS.max_in_flight,
                         "container_limit_mib": CONTAINER_LIMIT_MIB},
              "scenarios": runs, "decode_expansion": decode_expansion(),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": "python bench/webhook_memory.py " + " ".join(sys.argv[1:])}
    print(json.dumps(result, indent=2))
    if args.markdown:
        append_markdown(result)
    return 0


def append_markdown(r: dict) -> None:
    limits = r["limits"]
    lines = ["", f"## Webhook memory under maximum-size bodies (`bench/webhook_memory.py`), {r['date']}", "",
             f"`{r['command']}` on {r['machine']}. `qgpu webhook serve` as a child process with TLS and "
             f"`--client-ca-file`, a fresh process per scenario; peak = the kernel's `VmHWM` against the pod's "
             f"{limits['container_limit_mib']} Mi limit. Limits: body cap {limits['body_cap_bytes']} bytes, "
             f"{limits['token_limit']} JSON tokens, {limits['body_budget_bytes']} body bytes held at once, "
             f"{limits['max_in_flight']} decoded at once.", "",
             "| scenario | clients | body | answers | peak RSS | headroom to 256 Mi |", "|---|---|---|---|---|---|"]
    for s in r["scenarios"]:
        answers = ", ".join(f"{k}×{v}" for k, v in s["answers"].items()) or "—"
        lines.append(f"| {s['scenario']} | {s['clients']} | {s['body_bytes'] / 2**20:.2f} MiB | {answers} | "
                     f"{s['peak_rss_mib']} MiB | {s['headroom_mib']} MiB |")
    lines += ["", "What `json.loads` of 3 MiB of one shape costs (this process, RSS growth):", "",
              "| shape | tokens | decoded | × body | passes the token limit |", "|---|---|---|---|---|"]
    for d in r["decode_expansion"]:
        lines.append(f"| {d['shape']} | {d['tokens']} | {d['decoded_mib']} MiB | {d['factor']} | "
                     f"{'yes' if d['within_token_limit'] else 'no (413)'} |")
    with open(ROOT / "docs/benchmarks.md", "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
