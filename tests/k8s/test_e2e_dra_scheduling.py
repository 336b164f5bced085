"""qgpu as a DRA driver, the scheduler half, against the real kube-apiserver and kube-scheduler
(v1.37.2, DRAConsumableCapacity on by default there): the node's ResourceSlice as
node/dra/slices.py publishes it, qgpu's DeviceClasses, and ResourceClaims with
``capacity.requests`` that kube-scheduler allocates by itself, no extender involved.

Each test has its own Node (no kubelet: pods bind to it and stay Pending) with a publisher
thread, and direct ResourceClaims (templates would need kube-controller-manager). What the
scheduler writes is asserted as it is, e.g. consumed quantities in canonical form ("1k")."""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract import dra
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.node.dra.slices import SlicePublisher
from qgpu_runtime.node.health import CardHealth
from qgpu_runtime.node.kube_client import KubePodSource, KubeSlices
from tests.k8s.kubeobjects import PAUSE, qgpu_device_classes, wait_for
from tests.k8s.nodemanager import bare_node

GIB = 1024


@dataclass
class DraNode:
    name: str
    label: dict[str, str]
    cards: dict[int, CardInfo]
    health: CardHealth
    publisher: SlicePublisher
    stop: threading.Event
    thread: threading.Thread


@pytest.fixture(scope="module")
def resource(cluster) -> Iterator[client.ResourceV1Api]:
    """The ResourceV1Api, with qgpu's DeviceClasses applied for this module only: the whole-card
    class maps nvidia.com/gpu, which other tests' pods ask the extender for."""
    api = client.ResourceV1Api(cluster.api_client)
    with qgpu_device_classes(api):
        yield api


@pytest.fixture
def dra_node(cluster, resource) -> Iterator[Any]:
    """Factory: a Ready node with ``n`` 16 GiB cards whose ResourceSlice a running publisher keeps."""
    made: list[DraNode] = []

    def make(n: int = 2) -> DraNode:
        name = f"dra-{uuid.uuid4().hex[:8]}"
        label = {"qgpu-test": uuid.uuid4().hex[:10]}
        bare_node(cluster.api, name, label)
        cards = {i: CardInfo(i, f"GPU-{name}-{i}", "Tesla T4", 16 * GIB, i) for i in range(n)}
        health = CardHealth(cards)
        slices = KubeSlices(KubePodSource(str(cluster.cp.admin_kubeconfig)))
        publisher = SlicePublisher(slices, name, cards, health, lambda: Policy.FIXED_SHARE, retry_max_s=2.0)
        stop = threading.Event()
        thread = threading.Thread(target=publisher.serve, args=(stop,), name=f"slices-{name}", daemon=True)
        thread.start()
        node = DraNode(name, label, cards, health, publisher, stop, thread)
        made.append(node)
        wait_for(f"the ResourceSlice of {name}", lambda: read_slice(resource, name), timeout=20)
        return node

    yield make
    for node in made:
        node.stop.set()
        node.publisher.close()
        node.thread.join(5)
        for delete in (lambda: resource.delete_resource_slice(dra.slice_name(node.name), _preload_content=False),
                       lambda: cluster.api.delete_node(node.name, _preload_content=False)):
            try:
                delete()
            except ApiException as exc:
                if exc.status != 404:
                    raise


def read_slice(api: client.ResourceV1Api, node: str) -> dict[str, Any] | None:
    try:
        return json.loads(api.read_resource_slice(dra.slice_name(node), _preload_content=False).data)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def share_claim(name: str, *, core: str | None = None, memory: str | None = None, pods: str | None = None,
                device_class: str = dra.SHARED_CLASS) -> dict[str, Any]:
    """A ResourceClaim for one device of ``device_class`` asking these capacities (qgpu's units)."""
    requests = {k: v for k, v in ((dra.CORE, core), (dra.MEMORY, memory), (dra.PODS, pods)) if v is not None}
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if requests:
        exactly["capacity"] = {"requests": requests}
    return {"apiVersion": dra.API_VERSION, "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}


def claim_pod(name: str, claim: str, node: DraNode) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "nodeSelector": node.label, "terminationGracePeriodSeconds": 0, "automountServiceAccountToken": False,
        "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        "containers": [{"name": "c0", "image": PAUSE, "resources": {"claims": [{"name": "gpu"}]}}]}}


def submit(cluster, resource: client.ResourceV1Api, ns: str, node: DraNode, name: str, **capacity: str) -> None:
    """A claim ``name`` asking ``capacity`` and a pod ``name`` that uses it."""
    resource.create_namespaced_resource_claim(ns, share_claim(name, **capacity), _preload_content=False)
    cluster.api.create_namespaced_pod(ns, claim_pod(name, name, node), _preload_content=False)


def read_pod(cluster, ns: str, name: str) -> dict[str, Any]:
    return json.loads(cluster.api.read_namespaced_pod(name, ns, _preload_content=False).data)


def bound_to(cluster, ns: str, name: str, timeout: float = 30) -> str:
    return wait_for(f"pod {ns}/{name} bound", lambda: read_pod(cluster, ns, name)["spec"].get("nodeName"), timeout=timeout)


def unschedulable(cluster, ns: str, name: str, timeout: float = 30) -> str:
    """The message of the pod's PodScheduled=False condition, once the scheduler wrote it."""
    def probe() -> str | None:
        pod = read_pod(cluster, ns, name)
        assert not pod["spec"].get("nodeName"), f"pod {ns}/{name} was bound to {pod['spec']['nodeName']}"
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c["type"] == "PodScheduled" and c["status"] == "False":
                return f"{c.get('reason')}: {c.get('message')}"
        return None
    return wait_for(f"pod {ns}/{name} unschedulable", probe, timeout=timeout)


def allocation(resource: client.ResourceV1Api, ns: str, name: str) -> dict[str, Any]:
    """The claim's one device result (pool, device, consumedCapacity, shareID) once allocated."""
    def probe() -> dict[str, Any] | None:
        claim = json.loads(resource.read_namespaced_resource_claim(name, ns, _preload_content=False).data)
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
        return results[0] if results else None
    return wait_for(f"claim {ns}/{name} allocated", probe, timeout=30)


# ---- the slice ----------------------------------------------------------------------------------

def test_the_slice_has_one_shareable_device_per_card_in_the_nodes_pool_owned_by_the_node(cluster, resource, dra_node):
    node = dra_node(2)
    obj = read_slice(resource, node.name)
    uid = json.loads(cluster.api.read_node(node.name, _preload_content=False).data)["metadata"]["uid"]
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": uid, "controller": True}]
    spec = obj["spec"]
    assert (spec["driver"], spec["nodeName"]) == (dra.DRIVER, node.name)
    assert spec["pool"] == {"name": node.name, "generation": 1, "resourceSliceCount": 1}
    device = spec["devices"][0]
    assert [d["name"] for d in spec["devices"]] == ["gpu-0", "gpu-1"] and device["allowMultipleAllocations"] is True
    # The apiserver keeps quantities in canonical form: the core capacity 1000 reads back as "1k".
    assert device["capacity"] == {
        "core": {"value": "1k", "requestPolicy": {"default": "1k", "validRange": {"min": "10", "max": "1k", "step": "10"}}},
        "memory": {"value": "16384", "requestPolicy": {"default": "16384",
                                                       "validRange": {"min": "1024", "max": "16384", "step": "1024"}}},
        "pods": {"value": "4", "requestPolicy": {"default": "1", "validValues": ["1"]}}}
    assert node.publisher.sync() == "unchanged"  # read back in another form, still no write


def test_a_deleted_slice_is_published_again(cluster, resource, dra_node):
    node = dra_node(2)
    before = read_slice(resource, node.name)
    resource.delete_resource_slice(dra.slice_name(node.name), _preload_content=False)
    after = wait_for("the slice published again", lambda: (s := read_slice(resource, node.name))
                     and s["metadata"]["uid"] != before["metadata"]["uid"] and s, timeout=20)
    assert after["spec"]["pool"]["generation"] == 2
    assert [d["name"] for d in after["spec"]["devices"]] == ["gpu-0", "gpu-1"]


# ---- kube-scheduler allocating shares -----------------------------------------------------------

def test_two_pods_share_one_card_within_its_capacity_and_a_third_that_fits_nowhere_stays_pending(
        cluster, resource, dra_node, ns):
    node = dra_node(2)
    # One at a time: with both in flight, kube-scheduler's allocator put the second share on gpu-1
    # once in a full run (it did not count the first's consumed capacity as a share of gpu-0 yet).
    # What is asserted is that a card with room takes a second share, not the allocator's race.
    submit(cluster, resource, ns, node, "half-a", core="500", memory=str(8 * GIB))
    a = allocation(resource, ns, "half-a")
    submit(cluster, resource, ns, node, "half-b", core="500", memory=str(8 * GIB))
    assert bound_to(cluster, ns, "half-a") == bound_to(cluster, ns, "half-b") == node.name
    b = allocation(resource, ns, "half-b")
    assert (a["driver"], a["pool"], a["device"]) == (b["driver"], b["pool"], b["device"]) == (dra.DRIVER, node.name, "gpu-0")
    assert a["consumedCapacity"] == b["consumedCapacity"] == {"core": "500", "memory": "8192", "pods": "1"}
    assert a["shareID"] and b["shareID"] and a["shareID"] != b["shareID"]

    submit(cluster, resource, ns, node, "sixty", core="600", memory=str(4 * GIB))
    bound_to(cluster, ns, "sixty")
    assert allocation(resource, ns, "sixty")["device"] == "gpu-1"
    submit(cluster, resource, ns, node, "too-much", core="500", memory=str(4 * GIB))  # gpu-0 full, gpu-1 has 400
    reason = unschedulable(cluster, ns, "too-much")
    assert reason.startswith("Unschedulable:") and "cannot allocate all claims" in reason, reason


def test_the_pods_capacity_limits_the_claims_on_one_card(cluster, resource, dra_node, ns):
    node = dra_node(1)  # a 16 GiB card takes 4 shares
    for i in range(4):
        submit(cluster, resource, ns, node, f"small-{i}", core="10", memory=str(GIB))
    for i in range(4):
        bound_to(cluster, ns, f"small-{i}")
    submit(cluster, resource, ns, node, "fifth", core="10", memory=str(GIB))
    assert "cannot allocate all claims" in unschedulable(cluster, ns, "fifth")


def test_a_claim_without_capacity_requests_takes_the_whole_card(cluster, resource, dra_node, ns):
    node = dra_node(1)
    submit(cluster, resource, ns, node, "whole")
    bound_to(cluster, ns, "whole")
    assert allocation(resource, ns, "whole")["consumedCapacity"] == {"core": "1k", "memory": "16384", "pods": "1"}


def test_requests_off_the_policy_grid_are_rounded_up_by_the_scheduler(cluster, resource, dra_node, ns):
    node = dra_node(1)
    submit(cluster, resource, ns, node, "odd", core="15", memory="1500")
    submit(cluster, resource, ns, node, "tiny", core="10", memory="512")
    bound_to(cluster, ns, "odd")
    bound_to(cluster, ns, "tiny")
    assert allocation(resource, ns, "odd")["consumedCapacity"] == {"core": "20", "memory": "2048", "pods": "1"}
    assert allocation(resource, ns, "tiny")["consumedCapacity"] == {"core": "10", "memory": "1024", "pods": "1"}


def test_requests_above_the_policy_or_asking_two_pod_slots_are_never_allocated(cluster, resource, dra_node, ns):
    node = dra_node(1)
    submit(cluster, resource, ns, node, "huge", core="10", memory=str(17 * GIB))
    submit(cluster, resource, ns, node, "two-slots", core="10", memory=str(GIB), pods="2")
    assert "cannot allocate all claims" in unschedulable(cluster, ns, "huge")
    assert "cannot allocate all claims" in unschedulable(cluster, ns, "two-slots")


def test_an_unhealthy_cards_taint_keeps_new_claims_off_it(cluster, resource, dra_node, ns):
    node = dra_node(2)
    node.health.mark(0, "XID 79: fallen off the bus")
    assert node.publisher.sync() == "updated"
    tainted = read_slice(resource, node.name)["spec"]["devices"][0]
    assert [(t["key"], t["effect"]) for t in tainted["taints"]] == [(dra.UNHEALTHY_TAINT, "NoSchedule")]
    submit(cluster, resource, ns, node, "after-xid", core="100", memory=str(GIB))
    bound_to(cluster, ns, "after-xid")
    assert allocation(resource, ns, "after-xid")["device"] == "gpu-1"


# ---- the real process ---------------------------------------------------------------------------

def test_manager_serve_dra_publishes_the_slice_of_its_cards_and_stops_on_sigterm(cluster, resource, label):
    from tests.k8s.nodemanager import ManagedNode

    name = f"dra-nm-{uuid.uuid4().hex[:8]}"
    bare_node(cluster.api, name, label)
    node = ManagedNode(name, "2xT4-16G", cluster.cp.admin_kubeconfig, extra_args=("--dra",))
    try:
        node.start()
        obj = wait_for("the manager's ResourceSlice", lambda: read_slice(resource, name), timeout=30)
        attributes = [d["attributes"] for d in obj["spec"]["devices"]]
        assert [a[dra.ATTR_UUID]["string"] for a in attributes] == [c.uuid for c in node.cards]
        assert {a[dra.ATTR_POLICY]["string"] for a in attributes} == {"fixed-share"}
        assert node.stop(timeout=15) == 0
    finally:
        node.close()
        resource.delete_resource_slice(dra.slice_name(name), _preload_content=False)
        cluster.api.delete_node(name, _preload_content=False)
