"""Metrics: TKEStack gpu-manager series and qgpu's own, requested against used."""

from __future__ import annotations

from podfactory import pod, qgpu
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qgpu_runtime.node.cgroups import pod_and_container

CID = "a" * 64


def samples(registry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def tke(pod_name, container, extra):
    return frozenset({"pod_name": pod_name, "namespace": "default", "node": "gpu-node-1",
                      "container_name": container, **extra}.items())


def test_cgroup_layouts_map_to_pod_and_container():
    uid = "0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"
    cgroupfs = f"12:devices:/kubepods/burstable/pod{uid}/{CID}\n"
    systemd = f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n"
    assert pod_and_container(cgroupfs) == (uid, CID)
    assert pod_and_container(systemd) == (uid, CID)
    assert pod_and_container("0::/user.slice/session-1.scope\n") is None


def serve_one_container(node):
    p = pod("infer", "gpu-node-1", [("main", qgpu(30, 5), [(1, node.uuid(1), 300, 5120)])],
            container_ids={"main": CID})
    node.set_pods([p])
    node.kubelet.admit(p)
    uid = p["metadata"]["uid"]
    node.control_write({"processes": [{"pid": 4242, "card_index": 1, "memory_mib": 3000, "sm_util_pct": 27,
                                       "cgroup": f"0::/kubepods/pod{uid}/{CID}"}]})
    node.manager.sample_once()


def test_requested_and_used_per_container_with_tkestack_names(node):
    serve_one_container(node)
    got = samples(node.manager.metrics.registry)
    assert got[("container_gpu_utilization", tke("infer", "main", {"gpu": "gpu1"}))] == 27
    assert got[("container_gpu_utilization", tke("infer", "main", {"gpu": "total"}))] == 27
    assert got[("container_gpu_memory_total", tke("infer", "main", {"gpu_memory": "total"}))] == 3000
    assert got[("container_request_gpu_utilization", tke("infer", "main", {"req_of_gpu": "total"}))] == 0.3
    assert got[("container_request_gpu_memory", tke("infer", "main", {"req_of_gpu_memory": "total"}))] == 5120
    card1 = frozenset({"node": "gpu-node-1", "card": "1"}.items())
    assert got[("qgpu_card_core_allocated_ratio", card1)] == 0.3
    assert got[("qgpu_card_memory_used_bytes", card1)] == 3000 * 1024 * 1024
    assert got[("qgpu_card_healthy", card1)] == 1
    ok = frozenset({"resource": "tke.cloud.tencent.com/qgpu-core", "result": "ok"}.items())
    assert got[("qgpu_allocate_total", ok)] == 1


def test_unhealthy_card_shows_in_metrics(node):
    node.manager.mark_unhealthy(0, "XID 48")
    node.manager.sample_once()
    got = samples(node.manager.metrics.registry)
    assert got[("qgpu_card_healthy", frozenset({"node": "gpu-node-1", "card": "0"}.items()))] == 0


def test_grafana_dashboard_uses_only_series_the_manager_exports(node):
    import json
    import re
    from pathlib import Path

    serve_one_container(node)
    node.manager.metrics.allocations.labels("r", "refused").inc()
    node.manager.metrics.allocate_seconds.labels("r").observe(0.01)
    node.manager.metrics.mismatches.labels("r").inc()
    exported = {name for name, _ in samples(node.manager.metrics.registry)}
    dashboard = json.loads((Path(__file__).parents[2] / "templates" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {m for e in exprs for m in re.findall(r"\b((?:container|qgpu)_[a-z_]+)", e)}
    assert used and used <= exported, used - exported
