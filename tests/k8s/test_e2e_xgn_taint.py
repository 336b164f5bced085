"""The xgn taint follows the xgn label on any Node, whoever writes the label (issue 22 §2): the
MutatingAdmissionPolicy qgpu_node_pool applies (templates/kubernetes/qgpu-node-pool.yaml.j2), loaded
into the real kube-apiserver. No qgpu identity writes Nodes for it."""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest
from kubernetes.dynamic import DynamicClient

from tests.k8s.conftest import Cluster
from tests.k8s.kubeobjects import cards, gpu_node, wait_for, xgn_taint_policy_active
from tests.k8s.rbac import render_template

ALLOC_MODE = "sched.tensorstack.dev/node-alloc-mode"
XGN_TAINT = {"key": "sched.tensorstack.dev/xgn-mode", "value": "true", "effect": "NoSchedule"}
FOREIGN_TAINT = {"key": "dedicated.example.com/team", "value": "a", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def policy(cluster: Cluster) -> Iterator[list[dict[str, Any]]]:
    dynamic = DynamicClient(cluster.api.api_client)
    docs = render_template("qgpu-node-pool.yaml.j2")
    assert [d["kind"] for d in docs] == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"]
    for doc in docs:
        dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"]).create(body=doc)
    # The apiserver loads and unloads policies asynchronously: probe with a labelled node each way,
    # so that no later test of the session meets a taint it did not ask for.
    wait_for("the xgn taint policy loaded", lambda: xgn_taint_policy_active(cluster.api) or None, timeout=60, interval=1.0)
    yield docs
    for doc in reversed(docs):
        dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"]).delete(name=doc["metadata"]["name"])
    wait_for("the xgn taint policy unloaded", lambda: not xgn_taint_policy_active(cluster.api) or None, timeout=60, interval=1.0)


def taints(cluster: Cluster, node: str) -> list[dict[str, str]]:
    return [{k: t[k] for k in ("key", "value", "effect") if t.get(k) is not None}
            for t in (cluster.api.api_client.sanitize_for_serialization(cluster.api.read_node(node)).get("spec") or {}).get("taints") or []]


def test_a_node_created_with_the_xgn_label_is_tainted(cluster: Cluster, policy: list) -> None:
    name = f"xgn-new-{uuid.uuid4().hex[:8]}"
    gpu_node(cluster.api, name, cards(2, node=name), {ALLOC_MODE: "xgn"})
    assert taints(cluster, name) == [XGN_TAINT]


def test_labelling_by_hand_taints_and_unlabelling_lifts_only_the_xgn_taint(cluster: Cluster, policy: list) -> None:
    """A person with `kubectl label` (here the cluster admin, not any qgpu role) sets and removes the
    label; foreign taints stay as they are."""
    name = f"xgn-hand-{uuid.uuid4().hex[:8]}"
    gpu_node(cluster.api, name, cards(2, node=name), {ALLOC_MODE: "sgn"})
    cluster.api.patch_node(name, {"spec": {"taints": [FOREIGN_TAINT]}})
    assert taints(cluster, name) == [FOREIGN_TAINT]
    cluster.api.patch_node(name, {"metadata": {"labels": {ALLOC_MODE: "xgn"}}})
    assert taints(cluster, name) == [FOREIGN_TAINT, XGN_TAINT]
    # removing the taint by hand while the label stays does not stick
    cluster.api.patch_node(name, {"spec": {"taints": [FOREIGN_TAINT]}})
    assert taints(cluster, name) == [FOREIGN_TAINT, XGN_TAINT]
    cluster.api.patch_node(name, {"metadata": {"labels": {ALLOC_MODE: None}}})
    assert taints(cluster, name) == [FOREIGN_TAINT]


def test_a_node_without_the_label_keeps_its_taints_untouched(cluster: Cluster, policy: list) -> None:
    name = f"xgn-none-{uuid.uuid4().hex[:8]}"
    gpu_node(cluster.api, name, cards(1, node=name))
    cluster.api.patch_node(name, {"spec": {"taints": [FOREIGN_TAINT]}})
    assert taints(cluster, name) == [FOREIGN_TAINT]
