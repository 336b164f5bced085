"""The deployed node manager on a real node: not privileged, and the very token the kubelet mounted
into its container (bound to its pod, carrying its node) can write only what its code writes."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from tests.polling import poll
from tests.realnode import kube
from tests.realnode.localcluster import NODE, QGPU_NAMESPACE, LocalCluster
from tests.realnode.test_e2e_isolation import host_pid

MERGE = "application/merge-patch+json"


def manager_pod(cluster: LocalCluster) -> dict:
    api = kube.core(cluster)
    (pod,) = api.list_namespaced_pod(QGPU_NAMESPACE, label_selector="app.kubernetes.io/name=qgpu-manager").items
    return api.api_client.sanitize_for_serialization(pod)


@pytest.fixture(scope="module")
def manager(local_cluster: LocalCluster) -> client.CoreV1Api:
    """A client with the token inside the running manager container (read through its /proc root)."""
    root = Path(f"/proc/{host_pid(local_cluster, manager_pod(local_cluster))}/root")
    # /var/run is a symlink to /run in the image; read through /proc it would resolve on the host.
    (token_file,) = [p for p in (root / "run/secrets/kubernetes.io/serviceaccount/token",
                                 root / "var/run/secrets/kubernetes.io/serviceaccount/token") if p.is_file()][:1]
    token = token_file.read_text().strip()
    conf = client.Configuration()
    conf.host = local_cluster.server
    conf.ssl_ca_cert = str(local_cluster.pki / "ca.crt")
    conf.api_key = {"authorization": f"Bearer {token}"}
    return client.CoreV1Api(client.ApiClient(conf))


def refused(call) -> str:
    try:
        call()
    except ApiException as exc:
        assert exc.status == 403, f"{exc.status}: {exc.body}"
        return str(json.loads(exc.body or "{}").get("message"))
    raise AssertionError("the write was allowed")


def test_manager_container_is_not_privileged(local_cluster: LocalCluster) -> None:
    spec = manager_pod(local_cluster)["spec"]
    ctx = spec["containers"][0]["securityContext"]
    assert ctx["privileged"] is False and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}
    assert spec["hostPID"] is True  # host PIDs from NVML are read in /proc and signalled
    assert not any(v.get("hostPath", {}).get("path") == "/dev" for v in spec["volumes"])


def test_managers_own_token_cannot_lift_a_taint_or_change_an_image(local_cluster: LocalCluster, manager) -> None:
    api = kube.core(local_cluster)
    taint = {"key": f"qgpu-test/{uuid.uuid4().hex[:6]}", "effect": "NoSchedule"}
    node = api.read_node(NODE)
    taints = [api.api_client.sanitize_for_serialization(t) for t in (node.spec.taints or [])]
    api.patch_node(NODE, {"spec": {"taints": taints + [taint]}})
    try:
        message = refused(lambda: manager.patch_node(NODE, {"spec": {"taints": taints}}))
        assert "spec changed" in message, message
    finally:
        api.patch_node(NODE, {"spec": {"taints": taints}})
    webhook = api.list_namespaced_pod(QGPU_NAMESPACE, label_selector="app.kubernetes.io/name=qgpu-webhook").items[0]
    patch = {"spec": {"containers": [{"name": "webhook", "image": "evil.example/miner:1"}]}}
    message = refused(lambda: manager.patch_namespaced_pod(webhook.metadata.name, QGPU_NAMESPACE, patch, dry_run="All"))
    assert "spec changed" in message, message


def test_managers_own_token_cannot_write_another_node(local_cluster: LocalCluster, manager) -> None:
    api = kube.core(local_cluster)
    other = f"other-{uuid.uuid4().hex[:6]}"
    api.create_node({"metadata": {"name": other}})
    try:
        message = refused(lambda: manager.patch_node(other, {"metadata": {"annotations": {"qgpu.io/gpus": "[]"}}},
                                                      _content_type=MERGE))
        assert f"Node {other} is not its own" in message, message
    finally:
        api.delete_node(other)


def test_managers_own_token_writes_its_nodes_qgpu_annotations(local_cluster: LocalCluster, manager) -> None:
    current = kube.core(local_cluster).read_node(NODE).metadata.annotations["qgpu.io/isolation-policy"]
    manager.patch_node(NODE, {"metadata": {"annotations": {"qgpu.io/isolation-policy": current}}},
                       _content_type=MERGE, dry_run="All")


def test_admission_policies_type_check_without_warnings(local_cluster: LocalCluster) -> None:
    """kube-controller-manager type-checks every expression against the kinds the policy matches; a
    warning means an expression that can fail at run time, which failurePolicy Fail turns into
    refusals of the components' own writes. (The tests/k8s control plane runs no controller-manager.)"""
    policies = DynamicClient(kube.core(local_cluster).api_client).resources.get(
        api_version="admissionregistration.k8s.io/v1", kind="ValidatingAdmissionPolicy")
    for name in ("qgpu-manager-own-node", "qgpu-kubelet-pod-annotations", "qgpu-scheduler-allocation-only",
                 "qgpu-pod-placed-by-extender"):
        status = poll(lambda: (policies.get(name=name).to_dict().get("status") or {}).get("typeChecking") is not None
                      and policies.get(name=name).to_dict()["status"], timeout=60, what=f"{name} type-checked")
        assert not status["typeChecking"].get("expressionWarnings"), (name, status)
