"""gpu_preflight's cluster checks (issue 22 §6): the apiserver is at least the oldest release that
serves what the roles render, and no NVIDIA device plugin (standalone, Helm chart, GPU Operator)
serves nvidia.com/gpu on a node of qgpu's pools; each refusal names the way out.

The filter plugin's decisions, then the role against the real kube-apiserver v1.37 (its DaemonSets,
pods and nodes written here: no controller runs), then the minimum derived from the manifests the
roles render, so a new kind in a template cannot outgrow the check."""

from __future__ import annotations

import importlib.util
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from ansible_tools import BIN, REPO, run_tool

_spec = importlib.util.spec_from_file_location("cluster_preflight", REPO / "roles/gpu_preflight/filter_plugins/cluster_preflight.py")
assert _spec and _spec.loader
preflight = importlib.util.module_from_spec(_spec)
sys.modules["cluster_preflight"] = preflight
_spec.loader.exec_module(preflight)

PLAYBOOK = REPO / "tests/provisioning/playbooks/preflight.yml"
NVIDIA_IMAGE = "nvcr.io/nvidia/k8s-device-plugin:v0.17.0"
OPERATOR_LABEL = "nvidia.com/gpu.deploy.device-plugin"


def one_line(text: str) -> str:
    return " ".join(text.split())


# what NVIDIA's device plugin mounts to register with kubelet
PLUGIN_FOLDER = {"name": "device-plugin", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}}


def daemonset(ns: str, name: str, image: str, labels: dict | None = None,
              volumes: list | None = None, **pod_fields: Any) -> dict[str, Any]:
    pod_spec = {"containers": [{"name": "plugin", "image": image}],
                "volumes": [PLUGIN_FOLDER] if volumes is None else volumes, **pod_fields}
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
            "spec": {"selector": {"matchLabels": {"name": name}}, "template": {
                "metadata": {"labels": {"name": name}}, "spec": pod_spec}}}


def pod_of(ds: dict[str, Any], node: str, uid: str = "u") -> dict[str, Any]:
    meta = ds["metadata"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{meta['name']}-{node}", "namespace": meta["namespace"], "labels": {"name": meta["name"]},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": meta["name"], "uid": uid, "controller": True}]},
        "spec": {"nodeName": node, "containers": [{"name": "plugin", "image": ds["spec"]["template"]["spec"]["containers"][0]["image"]}]}}


def node(name: str, labels: dict | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}


# --- kubernetes_version -------------------------------------------------------------------------------


@pytest.mark.parametrize("version, ok", [("v1.29.9", False), ("v1.30.0", True), ("v1.37.2", True), ("1.28", False)])
def test_an_apiserver_older_than_the_rendered_objects_need_is_refused_with_the_way_out(version, ok):
    result = preflight.kubernetes_version_result(version, "1.30")
    assert result["check"] == "kubernetes_version" and result["ok"] is ok
    if not ok:
        assert f"kube-apiserver {version} is older than 1.30" in result["detail"]
        assert "ValidatingAdmissionPolicy" in result["detail"] and "matchConditions" in result["detail"]
        assert "Way out: upgrade the cluster to 1.30 or later" in result["detail"]


def test_an_unreadable_version_is_an_error_naming_it():
    with pytest.raises(Exception, match="the apiserver's version='garbage': expected vMAJOR.MINOR"):
        preflight.kubernetes_version_result("garbage", "1.30")


# --- device_plugin_conflict ----------------------------------------------------------------------------


def test_nvidias_device_plugin_is_found_by_its_image_and_qgpus_own_daemonsets_are_not():
    found = preflight.device_plugin_daemonsets([
        daemonset("kube-system", "nvidia-device-plugin-daemonset", NVIDIA_IMAGE),
        daemonset("gpu-operator", "nvidia-device-plugin-daemonset", "nvcr.io/nvidia/k8s-device-plugin@sha256:abc"),
        daemonset("qgpu-system", "qgpu-manager", "registry.example.com/k8s-device-plugin:1", {"app.kubernetes.io/part-of": "qgpu"}),
        daemonset("monitoring", "node-exporter", "quay.io/prometheus/node-exporter:v1.8.0"),
    ])
    assert [(f["namespace"], f["name"], f["selector"]) for f in found] == [
        ("kube-system", "nvidia-device-plugin-daemonset", "name=nvidia-device-plugin-daemonset"),
        ("gpu-operator", "nvidia-device-plugin-daemonset", "name=nvidia-device-plugin-daemonset")]


def test_a_daemonset_named_like_the_plugin_without_host_access_is_not_one():
    """A tenant with ``edit`` creates a DaemonSet of any image name, tolerating every taint; under
    Pod Security ``baseline`` it gets no hostPath, privilege or host PIDs, so it cannot register
    with kubelet. Counted, it stopped every cluster.yml and site.yml run."""
    tenant = daemonset("team-a", "metrics", "registry.example.com/team-a/k8s-device-plugin:latest",
                       volumes=[{"name": "scratch", "emptyDir": {}}], tolerations=[{"operator": "Exists"}])
    assert preflight.device_plugin_daemonsets([tenant]) == []
    result = preflight.device_plugin_conflict_result([], [pod_of(tenant, "gpu-1")], [], ["gpu-1"])
    assert result["ok"] is True
    privileged = daemonset("team-a", "privileged", NVIDIA_IMAGE, volumes=[])
    privileged["spec"]["template"]["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    host_pids = daemonset("team-a", "host-pids", NVIDIA_IMAGE, volumes=[], hostPID=True)
    assert [f["name"] for f in preflight.device_plugin_daemonsets([privileged, host_pids])] == ["privileged", "host-pids"]


def test_a_device_plugin_pod_on_a_pool_node_is_refused_naming_it_and_the_way_out():
    ds = daemonset("kube-system", "nvidia-device-plugin", NVIDIA_IMAGE)
    plugins = preflight.device_plugin_daemonsets([ds])
    result = preflight.device_plugin_conflict_result(plugins, [pod_of(ds, "gpu-1"), pod_of(ds, "cpu-1")], [], ["gpu-1", "gpu-2"])
    assert result["ok"] is False
    assert ("DaemonSet kube-system/nvidia-device-plugin runs NVIDIA's device plugin on qgpu's nodes gpu-1: both would serve "
            "nvidia.com/gpu") in result["detail"]
    assert "Way out: delete it, or keep it off qgpu's pools" in result["detail"]


def test_a_device_plugin_elsewhere_is_reported_and_passes():
    ds = daemonset("kube-system", "nvidia-device-plugin", NVIDIA_IMAGE)
    result = preflight.device_plugin_conflict_result(preflight.device_plugin_daemonsets([ds]), [pod_of(ds, "other-gpu")], [], ["gpu-1"])
    assert result["ok"] is True and "elsewhere: kube-system/nvidia-device-plugin" in result["detail"]


def test_the_gpu_operator_told_to_serve_a_pool_node_is_refused_and_false_is_the_way_out():
    nodes = [node("gpu-1", {OPERATOR_LABEL: "true"}), node("gpu-2", {OPERATOR_LABEL: "false"}), node("cpu-1", {OPERATOR_LABEL: "true"})]
    result = preflight.device_plugin_conflict_result([], [], nodes, ["gpu-1", "gpu-2"])
    assert result["ok"] is False
    assert f"the GPU Operator is told to run its device plugin on qgpu's nodes gpu-1 (label {OPERATOR_LABEL})" in result["detail"]
    assert f"Way out: label them {OPERATOR_LABEL}=false" in result["detail"] and "devicePlugin.enabled=false" in result["detail"]
    assert preflight.device_plugin_conflict_result([], [], nodes[1:], ["gpu-1", "gpu-2"])["ok"] is True


# --- the role against the real apiserver ---------------------------------------------------------------


def run_preflight(tmp_path: Path, cluster: Any, pool_nodes: list[str], mode: str = "report") -> tuple[Any, dict[str, dict]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    results = tmp_path / "results.json"
    extra = {"gpu_preflight_checks": ["kubernetes_version", "device_plugin_conflict"], "gpu_preflight_mode": mode,
             "gpu_preflight_kubeconfig": str(cluster.cp.admin_kubeconfig), "gpu_preflight_pool_nodes": pool_nodes,
             "results_file": str(results)}
    run = run_tool([str(BIN / "ansible-playbook"), "-i", "localhost,", str(PLAYBOOK), "-e", json.dumps(extra)])
    by_check = {r["check"]: r for r in json.loads(results.read_text())} if results.exists() else {}
    return run, by_check


def test_the_role_reads_the_real_apiserver_and_refuses_a_pool_served_by_nvidias_plugin(cluster, tmp_path):
    from kubernetes import client

    suffix = uuid.uuid4().hex[:6]
    pool = [f"gpu-a-{suffix}", f"gpu-b-{suffix}"]
    ns = cluster.namespace()
    apps = client.AppsV1Api(cluster.api_client)
    run, results = run_preflight(tmp_path / "clean", cluster, pool, mode="enforce")
    assert run.returncode == 0, run.output[-3000:]
    assert results["kubernetes_version"]["ok"] is True and "kube-apiserver v1.37" in results["kubernetes_version"]["detail"]
    assert results["device_plugin_conflict"]["ok"] is True

    ds = daemonset(ns, f"nvidia-device-plugin-{suffix}", NVIDIA_IMAGE)
    created = apps.create_namespaced_daemon_set(ns, ds)
    cluster.api.create_namespaced_pod(ns, pod_of(ds, pool[1], created.metadata.uid))
    cluster.api.create_node(node(pool[0], {OPERATOR_LABEL: "true"}))
    try:
        run, results = run_preflight(tmp_path / "served", cluster, pool)
        assert run.returncode == 0, run.output[-3000:]  # report mode: every check printed, nothing stops
        assert results["device_plugin_conflict"]["ok"] is False
        detail = one_line(results["device_plugin_conflict"]["detail"])
        assert f"DaemonSet {ns}/nvidia-device-plugin-{suffix} runs NVIDIA's device plugin on qgpu's nodes {pool[1]}" in detail
        assert f"the GPU Operator is told to run its device plugin on qgpu's nodes {pool[0]}" in detail
        run, _ = run_preflight(tmp_path / "enforced", cluster, pool, mode="enforce")
        assert run.returncode != 0
        assert f"device_plugin_conflict: DaemonSet {ns}/nvidia-device-plugin-{suffix}" in one_line(run.output)
    finally:
        cluster.api.delete_node(pool[0])
        apps.delete_namespaced_daemon_set(ds["metadata"]["name"], ns)


# --- the minimum, from what the roles render -------------------------------------------------------------

# The first release serving each rendered kind at its apiVersion (GA), and each field newer than its kind.
SERVED_FROM = {
    ("v1", "ServiceAccount"): "1.0", ("v1", "Secret"): "1.0", ("v1", "Service"): "1.0", ("v1", "ConfigMap"): "1.0",
    ("v1", "Namespace"): "1.0",
    ("apps/v1", "Deployment"): "1.9", ("apps/v1", "DaemonSet"): "1.9",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "1.8", ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "1.8",
    ("rbac.authorization.k8s.io/v1", "Role"): "1.8", ("rbac.authorization.k8s.io/v1", "RoleBinding"): "1.8",
    ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration"): "1.16",
    ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration"): "1.16",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): "1.30",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): "1.30",
    ("coordination.k8s.io/v1", "Lease"): "1.14",
    ("policy/v1", "PodDisruptionBudget"): "1.21",
}
MATCH_CONDITIONS_FROM = "1.30"  # webhooks' matchConditions: GA in 1.30


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def test_the_minimum_is_what_the_rendered_device_plugin_objects_need(tmp_path):
    """The webhook manifest of a device-plugin pool as the role renders it by default (the one with
    webhook configurations and admission policies; the extender's and manager's policies are the
    same kind): every kind is in the table above, and the newest need is the role's minimum."""
    import yaml
    from test_webhook_dra_render import render
    docs = render(tmp_path / "dp", "device-plugin")
    needs = []
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        assert key in SERVED_FROM, f"{key}: a kind the preflight table does not know; add when it is served"
        needs.append(SERVED_FROM[key])
        if any("matchConditions" in hook for hook in doc.get("webhooks") or []):
            needs.append(MATCH_CONDITIONS_FROM)
    minimum = yaml.safe_load((REPO / "roles/gpu_preflight/vars/main.yml").read_text())["__gpu_preflight_kubernetes_from"]
    assert max(needs, key=_version) == minimum
