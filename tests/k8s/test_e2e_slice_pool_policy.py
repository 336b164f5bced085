"""The admission policy ``qgpu-slices-own-pool`` (templates/kubernetes/qgpu-manager.yaml.j2, rendered
with DRA pools) on the real kube-apiserver v1.37: a ResourceSlice of qgpu's driver whose pool is not
its node's is refused whoever writes it (here the cluster admin; a node's kubelet credentials or the
manager's token alike), since kube-scheduler's allocator accounts devices by pool: a compromised node
naming another node's pool would have its allocations use up that node's cards."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient

from qgpu_runtime.contract.dra import DRIVER, slice_device, slice_name
from tests.k8s.kubeobjects import cards
from tests.k8s.rbac import render_template

POLICY = "qgpu-slices-own-pool"


def _slice(node: str, pool: str, driver: str = DRIVER) -> dict[str, Any]:
    devices = [slice_device(c, "burst-share") for c in cards(1, model="Tesla-T4", memory_mib=16384, node=node)]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": slice_name(node)},
            "spec": {"driver": driver, "nodeName": node, "devices": devices,
                     "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1}}}


@pytest.fixture(scope="module")
def policy(cluster) -> Iterator[client.ResourceV1Api]:
    dynamic = DynamicClient(cluster.api_client)
    docs = [d for d in render_template("qgpu-manager.yaml.j2", qgpu_manager_profiles=[], qgpu_manager_dra=True)
            if d["metadata"]["name"] == POLICY]
    assert [d["kind"] for d in docs] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    for doc in docs:
        dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"]).create(body=doc)
    try:
        yield client.ResourceV1Api(cluster.api_client)
    finally:
        for doc in reversed(docs):
            dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"]).delete(name=POLICY)


def _refusal(resource: client.ResourceV1Api, body: dict[str, Any]) -> str | None:
    """The apiserver's refusal of a dry-run CREATE of ``body``, or None when it would be created."""
    try:
        resource.create_resource_slice(body, dry_run="All")
    except ApiException as exc:
        assert exc.status == 403, exc.body  # reason Forbidden, as the policy says
        return str(json.loads(exc.body)["message"])
    return None


def test_a_slice_naming_another_nodes_pool_is_refused_whoever_writes_it(policy):
    node, other = f"pool-{uuid.uuid4().hex[:6]}", f"victim-{uuid.uuid4().hex[:6]}"
    deadline = time.monotonic() + 30  # the apiserver picks the policy up through a watch
    while (refused := _refusal(policy, _slice(node, other))) is None:
        assert time.monotonic() < deadline, "policy never became active"
        time.sleep(0.5)
    assert f'pool "{other}" is not its node "{node}"; rule: a {DRIVER} slice is in the pool named after its node' in refused
    assert _refusal(policy, _slice(node, node)) is None  # its own pool: written
    assert _refusal(policy, _slice(node, other, driver="gpu.example.com")) is None  # another driver's: not qgpu's to judge
