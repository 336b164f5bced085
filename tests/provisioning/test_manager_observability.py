"""Seeing the node managers (issue 26 §1): the metrics Service by gpu-manager's name, a
ServiceMonitor where the Prometheus Operator's CRD exists (scrape annotations otherwise), and the
Grafana dashboard as a ConfigMap the Grafana sidecar loads.

The manifest is rendered by the role itself (qgpu_manager_apply: false); the decision "auto" is
taken by the role's own tasks against the real kube-apiserver of tests/k8s, with and without the
CRD. That the applied objects are accepted by the apiserver and select the managers is checked
in test_k8s_half.py, which runs site.yml's Kubernetes plays.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ansible_tools import REPO, Run, ansible_playbook
from kubernetes import client
from kubernetes.client.rest import ApiException
from test_dra_roles import by_kind, render_manager

from tests.k8s.conftest import Cluster
from tests.k8s.kubeobjects import wait_for

POOL = {"qgpu_pool_training": (["gpu-v100-1"], {"qgpu_node_pool_isolation_policy": "fixed-share"})}
DASHBOARD = REPO / "templates" / "grafana-dashboard.json"
SCRAPE = {"prometheus.io/scrape": "true", "prometheus.io/scheme": "http", "prometheus.io/port": "5678",
          "prometheus.io/path": "/metrics"}
CRD_NAME = "servicemonitors.monitoring.coreos.com"
DECIDE = REPO / "tests/provisioning/playbooks/decide-service-monitor.yml"


def rendered(tmp_path: Path, **extra: Any) -> list[dict[str, Any]]:
    run, docs = render_manager(tmp_path, POOL, **extra)
    assert run.returncode == 0, run.output[-4000:]
    return docs


def test_the_default_manifest_has_gpu_managers_service_with_scrape_annotations_and_the_dashboard(tmp_path: Path) -> None:
    docs = rendered(tmp_path)
    service = by_kind(docs, "Service")["gpu-manager-metric"]
    assert service["metadata"]["namespace"] == "qgpu-system"
    assert service["metadata"]["annotations"] == SCRAPE
    assert service["spec"]["clusterIP"] == "None"  # headless: every manager pod is an endpoint
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 5678, "targetPort": "metrics", "protocol": "TCP"}]
    # the Service selects every manager DaemonSet's pods, and each of them names the port
    for name, ds in by_kind(docs, "DaemonSet").items():
        labels = ds["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), name
        (container,) = ds["spec"]["template"]["spec"]["containers"]
        assert {"name": "metrics", "containerPort": 5678, "protocol": "TCP"} in container["ports"], name
    assert "ServiceMonitor" not in {d["kind"] for d in docs}  # a render-only run cannot know the CRD
    dashboard = by_kind(docs, "ConfigMap")["qgpu-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["qgpu.json"]) == json.loads(DASHBOARD.read_text())


def test_an_operator_cluster_gets_a_service_monitor_selecting_the_service_and_no_annotations(tmp_path: Path) -> None:
    docs = rendered(tmp_path, qgpu_manager_service_monitor="always",
                    qgpu_manager_service_monitor_labels={"release": "kube-prometheus-stack"},
                    qgpu_manager_metrics_port=9400, qgpu_manager_grafana_dashboard_namespace="monitoring",
                    qgpu_manager_grafana_dashboard_labels={"grafana_dashboard": "qgpu"})
    service = by_kind(docs, "Service")["gpu-manager-metric"]
    assert "annotations" not in service["metadata"]
    assert service["spec"]["ports"][0]["port"] == 9400
    monitor = by_kind(docs, "ServiceMonitor")["qgpu-manager"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["qgpu-system"]}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    dashboard = by_kind(docs, "ConfigMap")["qgpu-grafana-dashboard"]
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "qgpu"


def test_each_part_can_be_turned_off(tmp_path: Path) -> None:
    docs = rendered(tmp_path, qgpu_manager_metrics_service_name="", qgpu_manager_service_monitor="always",
                    qgpu_manager_grafana_dashboard=False)
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"Service", "ServiceMonitor", "ConfigMap"}, kinds


def test_a_mistyped_service_monitor_choice_is_refused_naming_the_choices(tmp_path: Path) -> None:
    run, _ = render_manager(tmp_path, POOL, qgpu_manager_service_monitor="yes")
    assert run.returncode != 0
    assert "qgpu_manager_service_monitor" in run.output and "auto, always, never" in run.output, run.output[-3000:]


# --- "auto" and "always" against a real kube-apiserver ----------------------------------------------

def service_monitor_crd() -> dict[str, Any]:
    """The Prometheus Operator's CRD as far as this decision reads it: its name and kind (the
    schema keeps every field, as an installed operator's would accept the ServiceMonitor)."""
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": CRD_NAME},
            "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                     "names": {"plural": "servicemonitors", "singular": "servicemonitor", "kind": "ServiceMonitor",
                               "listKind": "ServiceMonitorList"},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


def decide(cluster: Cluster, tmp_path: Path, choice: str) -> tuple[Run, bool | None]:
    out = tmp_path / f"decision-{choice}.json"
    run = ansible_playbook("-i", "localhost,", str(DECIDE), "-e", json.dumps({
        "qgpu_kubeconfig": str(cluster.cp.admin_kubeconfig), "qgpu_manager_service_monitor": choice,
        "decision_file": str(out)}))
    return run, (json.loads(out.read_text()) if out.exists() else None)


def crd_gone(extensions: client.ApiextensionsV1Api) -> bool:
    try:
        extensions.read_custom_resource_definition(CRD_NAME)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def delete_service_monitor_crd(cluster: Cluster) -> None:
    """Delete the CRD and wait until it is gone: deletion is asynchronous, and a CRD left
    terminating refuses the ServiceMonitor of the next module on this worker's cluster."""
    extensions = client.ApiextensionsV1Api(cluster.api_client)
    try:
        extensions.delete_custom_resource_definition(CRD_NAME)
    except ApiException as exc:
        if exc.status != 404:
            raise
    wait_for(f"the CRD {CRD_NAME} gone", lambda: crd_gone(extensions) or None, timeout=60, interval=0.5)


def create_service_monitor_crd(cluster: Cluster) -> None:
    extensions = client.ApiextensionsV1Api(cluster.api_client)
    extensions.create_custom_resource_definition(service_monitor_crd())
    wait_for("the CRD established", lambda: any(
        c.type == "Established" and c.status == "True"
        for c in (extensions.read_custom_resource_definition(CRD_NAME).status.conditions or [])) or None, timeout=30)


def test_auto_follows_the_crd_and_always_refuses_a_cluster_without_it(cluster: Cluster, tmp_path: Path) -> None:
    run, decision = decide(cluster, tmp_path, "auto")
    assert run.returncode == 0, run.output[-3000:]
    assert decision is False
    run, decision = decide(cluster, tmp_path, "always")
    assert run.returncode != 0 and decision is None
    assert f"no CustomResourceDefinition {CRD_NAME}" in " ".join(run.output.split()), run.output[-3000:]
    create_service_monitor_crd(cluster)
    try:
        for choice, expected in (("auto", True), ("always", True), ("never", False)):
            run, decision = decide(cluster, tmp_path, choice)
            assert run.returncode == 0, run.output[-3000:]
            assert decision is expected, choice
    finally:
        delete_service_monitor_crd(cluster)


def test_a_crd_being_deleted_is_absent_for_auto_and_refused_by_always(cluster: Cluster, tmp_path: Path) -> None:
    """The Prometheus Operator being uninstalled: its CRD waits for its objects to go, and the
    apiserver refuses every new ServiceMonitor meanwhile (CI met this: 'create not allowed while
    custom resource definition is terminating' stopped a rollout). A ServiceMonitor holding a
    finalizer keeps the CRD in that state for as long as the test needs."""
    create_service_monitor_crd(cluster)
    objects = client.CustomObjectsApi(cluster.api_client)
    held = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": "held", "namespace": "default", "finalizers": ["qgpu.test/held"]}, "spec": {}}
    objects.create_namespaced_custom_object("monitoring.coreos.com", "v1", "default", "servicemonitors", held)
    extensions = client.ApiextensionsV1Api(cluster.api_client)
    try:
        extensions.delete_custom_resource_definition(CRD_NAME)
        wait_for("the CRD terminating", lambda: extensions.read_custom_resource_definition(CRD_NAME)
                 .metadata.deletion_timestamp or None, timeout=30)
        run, decision = decide(cluster, tmp_path, "auto")
        assert run.returncode == 0, run.output[-3000:]
        assert decision is False  # scrape annotations, the apply goes through
        run, decision = decide(cluster, tmp_path, "always")
        assert run.returncode != 0 and decision is None
        said = " ".join(run.output.split())
        assert f"the CustomResourceDefinition {CRD_NAME} is being deleted" in said, run.output[-3000:]
    finally:
        try:
            objects.patch_namespaced_custom_object("monitoring.coreos.com", "v1", "default", "servicemonitors", "held",
                                                   {"metadata": {"finalizers": None}})
        except ApiException as exc:
            if exc.status != 404:
                raise
        delete_service_monitor_crd(cluster)
