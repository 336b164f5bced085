"""Only kube-scheduler may call the extender, and it cannot be tricked (issue 11 §3), under the real
control plane: the session's extender serves HTTPS with client certificates and kube-scheduler
calls it with the certificate of its rendered ``tlsConfig``.

The attacks of the issue, each replayed: an unauthenticated ``/bind`` of another namespace's pod
onto a tainted node, fake ``/filter`` calls reserving every card, and a forged filter body carrying
a real pod's identity to set its allocation record. Where a test needs a caller that passed the TLS
check (a stolen scheduler certificate), it uses the scheduler's own certificate: the trust rules
behind TLS must hold on their own.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import ssl
import subprocess
import sys
from typing import Any

import pytest

from tests.k8s.controlplane import ROOT, QgpuServer, extender_server
from tests.k8s.kubeobjects import bound, cards, gpu_node, gpu_pod, read_pod, record, wait_for
from tests.k8s.pki import CertificateAuthority

QGPU_CORE = "tke.cloud.tencent.com/qgpu-core"
QGPU_MEMORY = "tke.cloud.tencent.com/qgpu-memory"
NOBODY = "nobody-schedules-this"  # a schedulerName no scheduler serves: the pod stays pending


def call(server: QgpuServer, verb: str, body: dict[str, Any], ctx: ssl.SSLContext | None) -> tuple[int, dict[str, Any]]:
    host, port = "127.0.0.1", server.port
    conn = (http.client.HTTPSConnection(host, port, context=ctx, timeout=30) if server.scheme == "https"
            else http.client.HTTPConnection(host, port, timeout=30))
    try:
        conn.request("POST", f"/{verb}", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def bind_args(pod: dict[str, Any], node: str) -> dict[str, str]:
    meta = pod["metadata"]
    return {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}


def pending_pod(cluster: Any, ns: str, name: str, limits: dict[str, Any], label: dict[str, str]) -> dict[str, Any]:
    cluster.api.create_namespaced_pod(ns, gpu_pod(name, limits, selector=label, scheduler_name=NOBODY))
    return read_pod(cluster.api, ns, name)


def metric(server: QgpuServer, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10, context=server.ssl_context()) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_without_the_schedulers_certificate_nobody_can_filter_or_bind(cluster, ns, label, tmp_path):
    node = f"{ns}-tainted"
    gpu_node(cluster.api, node, cards(1, node=node), label)
    cluster.api.patch_node(node, {"spec": {"taints": [{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]}})
    victim = pending_pod(cluster, ns, "victim", {"cpu": "100m"}, label)
    ext = cluster.extender
    # no certificate at all: refused before the body is read
    for verb, body in (("bind", bind_args(victim, node)), ("filter", {"Pod": victim, "NodeNames": [node]})):
        status, doc = call(ext, verb, body, ext.ssl_context(client_cert=False))
        assert status == 401 and "client certificate" in doc["Error"], (verb, status, doc)
    # a certificate of another CA — the cluster's own admin certificate included — fails the handshake
    stranger = CertificateAuthority(tmp_path / "stranger").issue("client", "system:kube-scheduler", client=True)
    for pair in (stranger, cluster.cp.admin):
        ctx = ext.ssl_context(client_cert=False)
        assert ctx is not None
        ctx.load_cert_chain(str(pair.cert), str(pair.key))
        with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
            call(ext, "bind", bind_args(victim, node), ctx)
    assert not read_pod(cluster.api, ns, "victim")["spec"].get("nodeName")


def test_a_bind_that_no_filter_passed_is_refused_even_with_the_certificate(cluster, ns, label):
    node = f"{ns}-tainted"
    gpu_node(cluster.api, node, cards(1, node=node), label)
    cluster.api.patch_node(node, {"spec": {"taints": [{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]}})
    for name, limits in (("plain", {"cpu": "100m"}), ("gpu", {QGPU_CORE: 100})):
        victim = pending_pod(cluster, ns, name, limits, label)
        status, doc = call(cluster.extender, "bind", bind_args(victim, node), cluster.extender.ssl_context())
        assert status == 200 and "no filter of this extender passed it" in doc["Error"], doc
        assert not read_pod(cluster.api, ns, name)["spec"].get("nodeName")


def test_a_forged_filter_body_cannot_set_a_real_pods_record(cluster, ns, label):
    node = f"{ns}-a"
    gpu_node(cluster.api, node, cards(2, node=node), label)
    real = pending_pod(cluster, ns, "two-cards", {QGPU_CORE: 200}, label)
    forged = copy.deepcopy(real)
    forged["spec"]["containers"][0]["resources"] = {"limits": {QGPU_CORE: "10", QGPU_MEMORY: "1"},
                                                    "requests": {QGPU_CORE: "10", QGPU_MEMORY: "1"}}
    ext, ctx = cluster.extender, cluster.extender.ssl_context()
    status, doc = call(ext, "filter", {"Pod": forged, "NodeNames": [node]}, ctx)
    assert status == 200 and "asks for other resources than the pod in the apiserver" in doc["Error"], doc
    status, doc = call(ext, "bind", bind_args(real, node), ctx)
    assert "no filter of this extender passed it" in doc["Error"], doc
    assert record(read_pod(cluster.api, ns, "two-cards")) is None
    # the real pod, filtered and bound as kube-scheduler would: its record is its own two cards
    assert call(ext, "filter", {"Pod": real, "NodeNames": [node]}, ctx)[1]["NodeNames"] == [node]
    assert call(ext, "bind", bind_args(real, node), ctx)[1]["Error"] == ""
    rec = record(bound(cluster.api, ns, "two-cards"))
    assert rec is not None and sorted(s.core_milli for c in rec.containers for s in c.shares) == [1000, 1000]


def test_fake_filters_cannot_reserve_every_card(cluster, ns, label):
    """A second extender (plain HTTP on loopback, --max-holds 2, all of them for one namespace) against the same apiserver, so the
    session's scheduler is undisturbed."""
    node = f"{ns}-a"
    gpu_node(cluster.api, node, cards(2, node=node), label)
    second = extender_server(cluster.cp, tls=False, extra_args=("--max-holds", "2", "--max-holds-per-namespace", "2"))
    second.start()
    try:
        # invented pods (the issue's four fake filters, each asking for every card) hold nothing
        for i in range(4):
            ghost = gpu_pod(f"ghost-{i}", {QGPU_CORE: 200}, selector=label)
            ghost["metadata"].update(namespace=ns, uid=f"00000000-0000-0000-0000-00000000000{i}")
            status, doc = call(second, "filter", {"Pod": ghost, "NodeNames": [node]}, None)
            assert status == 200 and "is not an unbound pod the apiserver has" in doc["Error"], doc
        assert metric(second, "qgpu_extender_holds") == 0
        # real pods hold one node each, at most two at once
        pods = [pending_pod(cluster, ns, f"p{i}", {QGPU_CORE: 50, QGPU_MEMORY: 4}, label) for i in range(3)]
        for p in pods[:2]:
            doc = call(second, "filter", {"Pod": p, "NodeNames": [node]}, None)[1]
            assert doc["NodeNames"] == [node], doc
        doc = call(second, "filter", {"Pod": pods[2], "NodeNames": [node]}, None)[1]
        assert "--max-holds" in doc["Error"], doc
        for _ in range(3):  # filtering again replaces the pod's hold: one per pod
            call(second, "filter", {"Pod": pods[0], "NodeNames": [node]}, None)
        assert metric(second, "qgpu_extender_holds") == 2
        # a deleted pod's hold goes with it, and the room is free again
        cluster.api.delete_namespaced_pod("p0", ns, grace_period_seconds=0)
        wait_for("hold of the deleted pod released", lambda: metric(second, "qgpu_extender_holds") == 1 or None)
        assert call(second, "filter", {"Pod": pods[2], "NodeNames": [node]}, None)[1]["NodeNames"] == [node]
    finally:
        second.stop()


def test_kube_scheduler_with_its_client_certificate_binds_through_the_https_extender(cluster, ns, label):
    (entry,) = cluster.scheduler_extenders()
    assert entry["enableHTTPS"] and set(entry["tlsConfig"]) == {"caFile", "certFile", "keyFile"}
    node = f"{ns}-a"
    gpu_node(cluster.api, node, cards(1, node=node), label)
    cluster.api.create_namespaced_pod(ns, gpu_pod("p", {QGPU_CORE: 30, QGPU_MEMORY: 2}, selector=label))
    rec = record(bound(cluster.api, ns, "p"))
    assert rec is not None and rec.node == node


def test_plain_http_on_every_interface_is_refused_at_startup(cluster):
    run = subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "extender", "serve", "--insecure-plain-http",
                          "--address", "0.0.0.0", "--port", "1", "--kubeconfig", str(cluster.cp.admin_kubeconfig)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode != 0
    assert "--address 0.0.0.0 with --insecure-plain-http: plain HTTP is served only on a loopback address" in run.stderr


def test_the_default_is_https_with_client_certificates(cluster):
    run = subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "extender", "serve", "--port", "1",
                          "--kubeconfig", str(cluster.cp.admin_kubeconfig)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode != 0 and "--tls-cert-file, --tls-private-key-file, --client-ca-file missing" in run.stderr
