"""The manager's metrics carry what operators need (node, namespace, pod, container, card, class,
model) and nothing more: a pod's environment, command line, tokens and annotations never become a
label or a value, however the pod is written."""

from __future__ import annotations

from podfactory import pod, qgpu
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

CID = "b" * 64
SECRET = "s3cr3t-token-value-9f8e7d"
# Label names a dashboard needs; anything new must be argued for here first.
ALLOWED_LABELS = {
    "node", "namespace", "pod", "container", "card", "class", "uuid", "model", "policy", "resource", "result",
    # TKEStack gpu-manager's series, kept by name for existing dashboards
    "pod_name", "container_name", "gpu", "gpu_memory", "req_of_gpu", "req_of_gpu_memory",
}


def test_metrics_expose_no_env_command_line_token_or_annotation(node):
    p = pod("infer", "gpu-node-1", [("main", qgpu(30, 5), [(1, node.uuid(1), 300, 5120)])], container_ids={"main": CID})
    container = p["spec"]["containers"][0]
    container["env"] = [{"name": "API_TOKEN", "value": SECRET}]
    container["command"] = ["python", "serve.py", f"--password={SECRET}"]
    p["metadata"]["annotations"]["example.com/credentials"] = SECRET
    p["metadata"]["labels"] = {"team": SECRET}
    node.set_pods([p])
    node.kubelet.admit(p)
    uid = p["metadata"]["uid"]
    node.control_write({"processes": [{"pid": 4343, "card_index": 1, "memory_mib": 1000, "sm_util_pct": 10,
                                       "cgroup": f"0::/kubepods/pod{uid}/{CID}"}]})
    node.manager.sample_once()

    text = generate_latest(node.manager.metrics.registry).decode()
    assert SECRET not in text
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert any(s.labels.get("pod") == "infer" for s in samples)  # the pod is there, by name only
    extra = {k for s in samples for k in s.labels if k not in ("le", "quantile")} - ALLOWED_LABELS
    assert extra == set(), f"metric labels beyond what operators need: {sorted(extra)}"
