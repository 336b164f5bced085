"""The real kube-scheduler placing GPU pods through qgpu's extender (HTTPS, nodeCacheCapable)."""

from __future__ import annotations

from tests.k8s.kubeobjects import bound, cards, gpu_node, gpu_pod, read_pod, record, scheduling_failure

QGPU_CORE = "tke.cloud.tencent.com/qgpu-core"
QGPU_MEMORY = "tke.cloud.tencent.com/qgpu-memory"


def test_qgpu_pod_is_bound_with_a_record_naming_its_cards(cluster, ns, label):
    gpu_node(cluster.api, f"{ns}-a", cards(2, node=f"{ns}-a"), label)
    cluster.api.create_namespaced_pod(ns, gpu_pod("p", {QGPU_CORE: 30, QGPU_MEMORY: 5}, selector=label))
    pod = bound(cluster.api, ns, "p")
    rec = record(pod)
    assert rec is not None and rec.node == pod["spec"]["nodeName"] == f"{ns}-a"
    (container,) = rec.containers
    (share,) = container.shares
    assert (share.core_milli, share.memory_mib) == (300, 5 * 1024)
    assert share.uuid == f"GPU-{ns}-a-{share.index:02d}"
    assert pod["metadata"]["annotations"]["qgpu.io/bind-time"].isdigit()


def test_pod_that_fits_nowhere_stays_pending_with_an_event_saying_why(cluster, ns, label):
    gpu_node(cluster.api, f"{ns}-a", cards(1, memory_mib=16384, node=f"{ns}-a"), label)
    cluster.api.create_namespaced_pod(ns, gpu_pod("big", {QGPU_CORE: 200}, selector=label))
    scheduling_failure(cluster.api, ns, "big", "whole free cards")
    assert not read_pod(cluster.api, ns, "big")["spec"].get("nodeName")


def test_kube_scheduler_calls_the_extender_over_one_http2_connection(cluster, ns, label):
    """The extender offers HTTP/2 (ALPN); kube-scheduler's client takes it, and then filter,
    prioritize and the concurrent binds share one connection instead of a TLS handshake each."""
    import urllib.request

    def counters() -> dict[str, float]:
        with urllib.request.urlopen(cluster.extender.url + "/metrics", timeout=10, context=cluster.extender.ssl_context()) as r:
            lines = r.read().decode().splitlines()
        return {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("qgpu_extender_http2_connections_total ")}

    gpu_node(cluster.api, f"{ns}-a", cards(2, node=f"{ns}-a"), label)
    for i in range(6):
        cluster.api.create_namespaced_pod(ns, gpu_pod(f"p{i}", {QGPU_CORE: 10, QGPU_MEMORY: 1}, selector=label))
    for i in range(6):
        bound(cluster.api, ns, f"p{i}")
    assert counters()["qgpu_extender_http2_connections_total"] >= 1  # this test's own calls are HTTP/1.1
