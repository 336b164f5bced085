"""Issue 21 against the real control plane, with no admission policy in front: a tenant with `edit`
writes its own allocation records, and the code alone must believe none of them.

(a) a pod asking for 10% of a card and 1 GiB, created with spec.nodeName and its own record
    granting card 0 whole: the node manager used to grant QGPU_CORE_MILLI=1000 and
    QGPU_MEMORY_MIB=16384 and book it;
(b) two GPU-less pods nobody schedules, each with a record taking every card of a node and a
    bind-time of 9e18: the extender's cache booked every card past --assume-timeout, and another
    namespace's 10% pod stayed Pending.
The admission policy that refuses such writes in the first place is tested in
test_e2e_least_privilege.py (a tenant's pod with a qgpu.io/ annotation is refused).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import grpc
import pytest

from qgpu_runtime.contract.names import ALLOCATION, BIND_TIME
from tests.k8s.kubeobjects import bound, cards, gpu_node, gpu_pod, read_pod, record
from tests.k8s.nodemanager import CORE, MEMORY, ManagedNode, bare_node
from tests.k8s.rbac import edit_user

NOBODY = "qgpu-test-nobody"


def _record(node: str, shares: list[tuple[int, str, int, int]], container: str = "c0") -> str:
    """A record as a tenant writes it by hand: well-formed, unsigned."""
    return json.dumps({"version": 1, "node": node, "policy": "binpack", "class": "normal", "time": "2026-11-26T09:00:00Z",
                       "containers": [{"name": container, "cards": [
                           {"index": i, "uuid": u, "core_milli": core, "memory_mib": mem} for i, u, core, mem in shares]}]})


@pytest.fixture
def tenant(cluster, tmp_path) -> tuple[Any, str]:
    namespace = cluster.namespace()
    return edit_user(cluster, namespace, tmp_path / "tenant.kubeconfig"), namespace


def test_a_tenant_s_own_record_taking_a_whole_card_is_granted_nothing(cluster, tenant, label):
    api, namespace = tenant
    node = ManagedNode(f"rt-{uuid.uuid4().hex[:8]}", "1xT4-16G", cluster.cp.admin_kubeconfig)
    try:
        bare_node(cluster.api, node.name, label)
        node.start()
        card = node.cards[0]
        pod = gpu_pod("greedy", {CORE: 10, MEMORY: 1}, scheduler_name=NOBODY, annotations={
            ALLOCATION: _record(node.name, [(0, card.uuid, 1000, 16384)]), BIND_TIME: str(time.time_ns())})
        pod["spec"]["nodeName"] = node.name
        api.create_namespaced_pod(namespace, pod)
        with pytest.raises(grpc.RpcError) as err:
            node.kubelet.admit(read_pod(cluster.api, namespace, "greedy"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "qgpu.io/allocation-signature is missing" in err.value.details()
        assert "record not trusted, nothing granted" in err.value.details()
        assert node.grants() == []  # nothing booked in the store
        assert not (node.root / "state" / "containers").exists() or not any((node.root / "state" / "containers").iterdir())
        assert f"allocation record refused, nothing granted: {namespace}/greedy" in node.log()
    finally:
        node.close()
        cluster.api.delete_node(node.name)


def test_self_written_records_with_a_far_bind_time_book_nothing_and_another_namespace_schedules(cluster, tenant, label):
    api, namespace = tenant
    node = f"rt-{uuid.uuid4().hex[:8]}"
    inventory = cards(2, node=node)
    gpu_node(cluster.api, node, inventory, label)
    every_card = [(c.index, c.uuid, 1000, c.memory_mib) for c in inventory]
    for i in range(2):
        hog = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"hog-{i}", "annotations": {
            ALLOCATION: _record(node, every_card, "c"), BIND_TIME: "9000000000000000000"}},
            "spec": {"schedulerName": "nobody", "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}
        api.create_namespaced_pod(namespace, hog)
    def reported() -> bool:
        log = cluster.extender.process.tail(400) if cluster.extender.process else ""
        return all(f"pod {namespace}/hog-{i}: allocation record not trusted, booked nowhere" in log for i in range(2))

    # Let the extender's watch deliver both before the other namespace's pod comes: the refusal in
    # its log says so at once; an extender that believes the records says nothing, so after a few
    # seconds the test goes on (and its pod must then still find the cards free).
    deadline = time.monotonic() + 5
    while not reported() and time.monotonic() < deadline:
        time.sleep(0.1)
    other = cluster.namespace()
    cluster.api.create_namespaced_pod(other, gpu_pod("small", {CORE: 10, MEMORY: 1}, selector=label))
    placed = bound(cluster.api, other, "small", timeout=60)
    rec = record(placed)
    assert rec is not None and rec.node == node == placed["spec"]["nodeName"]
    assert reported()
