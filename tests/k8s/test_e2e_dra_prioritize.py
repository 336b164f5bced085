"""DRA prioritize under the real kube-scheduler: pods asking qgpu's shared DeviceClass through
ResourceClaims (consumable capacity), cards published as ResourceSlices of fake nodes. The DRA
allocator picks the cards; a second kube-scheduler with qgpu's extender as a prioritize-only entry
(``--dra-prioritize``, policy binpack) fills one node before the next, and the extender's prioritize
was asked for every pod. (The default scheduler's choice for the same pods is not asserted: with
equal nodes it depends on its tie-breaking and on what else the session's cluster holds; it put all
six on one node in one full run and spread them in others.)
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

import pytest
from kubernetes import client

from qgpu_runtime.contract.dra import DRIVER, SHARED_CLASS, slice_device, slice_name
from tests.k8s.controlplane import QgpuServer, extender_config, extender_server
from tests.k8s.kubeobjects import PAUSE, cards, gpu_node, qgpu_device_classes, wait_for

NODES = 3
PODS = 6
DRA_SCHEDULER = "qgpu-dra"


def publish_slice(resource: client.ResourceV1Api, node: str, n_cards: int = 4) -> None:
    devices = [slice_device(c, "burst-share") for c in cards(n_cards, model="Tesla-T4", memory_mib=16384, node=node)]
    resource.create_resource_slice({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                                    "metadata": {"name": slice_name(node)},
                                    "spec": {"driver": DRIVER, "nodeName": node, "devices": devices,
                                             "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}}})


def share_claim(name: str, core: int = 250, memory: int = 4096) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": SHARED_CLASS, "capacity": {"requests": {"core": str(core), "memory": str(memory)}}}}]}}}


def claim_pod(name: str, claim: str, selector: dict[str, str], scheduler: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0, "nodeSelector": selector,
        "containers": [{"name": "c", "image": PAUSE, "resources": {"claims": [{"name": "gpu"}]}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
    }
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="module")
def dra_scheduler(cluster) -> Iterator[QgpuServer]:
    """qgpu's extender with --dra-prioritize, and a kube-scheduler profile calling only its prioritize."""
    extender = extender_server(cluster.cp, tls=False, extra_args=["--dra-prioritize"], name="qgpu-extender-dra")
    extender.start()
    entry = extender_config(extender.url, ca_file=None, timeout="10s", weight=10)
    entry.update(filterVerb="", bindVerb="", ignorable=True)
    config = cluster.cp._write_yaml("scheduler-dra.yaml", {
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(cluster.cp.scheduler_kubeconfig)},
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": DRA_SCHEDULER}],
        "extenders": [entry],
    })
    try:
        cluster.cp.start_scheduler_from_file(config, name="kube-scheduler-dra")
        with qgpu_device_classes(client.ResourceV1Api(cluster.api_client)):
            yield extender
    finally:
        cluster.cp.stop_scheduler("kube-scheduler-dra")
        extender.stop()


def place_one_by_one(cluster, ns: str, scheduler: str | None) -> list[str]:
    """Create PODS claim pods one after the other on fresh nodes; the node each was bound to."""
    resource = client.ResourceV1Api(cluster.api_client)
    label = {"qgpu-test": uuid.uuid4().hex[:10]}
    for i in range(NODES):
        name = f"dra-{label['qgpu-test']}-{i}"
        gpu_node(cluster.api, name, [], labels=label)
        publish_slice(resource, name)
    nodes = []
    for i in range(PODS):
        resource.create_namespaced_resource_claim(ns, share_claim(f"c{i}"))
        cluster.api.create_namespaced_pod(ns, claim_pod(f"p{i}", f"c{i}", label, scheduler))

        def bound_node(i: int = i) -> str | None:
            pod = json.loads(cluster.api.read_namespaced_pod(f"p{i}", ns, _preload_content=False).data)
            return pod["spec"].get("nodeName")

        nodes.append(wait_for(f"pod p{i} bound", bound_node, timeout=60))
        # the claim's allocation (written before the binding) reaches the extender's watch
        wait_for(f"claim c{i} allocated", lambda i=i: (resource.read_namespaced_resource_claim(f"c{i}", ns).status or
                                                       client.V1ResourceClaimStatus()).allocation, timeout=30)
    return nodes


def test_binpack_through_prioritize_fills_one_node_first(cluster, ns, dra_scheduler) -> None:
    before = dra_scheduler.requests_by_verb().get("prioritize", 0)
    nodes = place_one_by_one(cluster, ns, DRA_SCHEDULER)
    assert len(set(nodes)) == 1, nodes
    assert dra_scheduler.requests_by_verb().get("prioritize", 0) - before >= PODS


def test_a_nominated_claim_pod_binds_on_its_nominated_node_without_asking_prioritize(cluster, ns, dra_scheduler) -> None:
    """issue 25 §3: qgpu's prioritize entry does not fight a nomination. Two pods fill one node first
    (binpack); a third, held by a scheduling gate, is given ``status.nominatedNodeName`` of an
    empty node (where kube-scheduler's preemption would have made room for it) and released:
    kube-scheduler tries the nominated node first (KEP-1923), binds it there, and does not call
    the prioritize entry, which would have preferred the fuller node."""
    resource = client.ResourceV1Api(cluster.api_client)
    label = {"qgpu-test": uuid.uuid4().hex[:10]}
    names = [f"dra-{label['qgpu-test']}-{i}" for i in range(2)]
    for name in names:
        gpu_node(cluster.api, name, [], labels=label)
        publish_slice(resource, name)
    first = []
    for i in range(2):
        resource.create_namespaced_resource_claim(ns, share_claim(f"n{i}"))
        cluster.api.create_namespaced_pod(ns, claim_pod(f"n{i}", f"n{i}", label, DRA_SCHEDULER))
        first.append(wait_for(f"pod n{i} bound", lambda i=i: json.loads(cluster.api.read_namespaced_pod(
            f"n{i}", ns, _preload_content=False).data)["spec"].get("nodeName"), timeout=60))
        wait_for(f"claim n{i} allocated", lambda i=i: (resource.read_namespaced_resource_claim(f"n{i}", ns).status or
                                                       client.V1ResourceClaimStatus()).allocation, timeout=30)
    assert first[0] == first[1], first  # binpack through prioritize
    other = next(n for n in names if n != first[0])
    resource.create_namespaced_resource_claim(ns, share_claim("n2"))
    pod = claim_pod("n2", "n2", label, DRA_SCHEDULER)
    pod["spec"]["schedulingGates"] = [{"name": "qgpu.io/test-hold"}]
    cluster.api.create_namespaced_pod(ns, pod)
    cluster.api.patch_namespaced_pod_status("n2", ns, {"status": {"nominatedNodeName": other}})
    before = dra_scheduler.requests_by_verb().get("prioritize", 0)
    cluster.api.patch_namespaced_pod("n2", ns, {"spec": {"schedulingGates": None}})
    node = wait_for("pod n2 bound", lambda: json.loads(cluster.api.read_namespaced_pod(
        "n2", ns, _preload_content=False).data)["spec"].get("nodeName"), timeout=60)
    assert node == other
    assert dra_scheduler.requests_by_verb().get("prioritize", 0) == before


def deep_claim(name: str, depth: int) -> bytes:
    """A claim for another driver whose opaque parameters nest ``depth`` arrays, as raw JSON (the
    client would encode a Python value that deep with json.dumps, which stops too): kube-apiserver
    keeps JSON up to 10,000 levels (3,000 levels are 6 KB, inside its 10 KiB limit); Python's decoder
    stops near 1,000."""
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
             "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "other.example.com"}}],
                                  "config": [{"opaque": {"driver": "other.example.com", "parameters": {"a": "TOWER"}}}]}}}
    return json.dumps(claim).replace('"TOWER"', "[" * depth + "]" * depth).encode()


def test_a_tenants_claim_nested_past_the_decoders_reach_stops_neither_the_watch_nor_a_relist(cluster, ns, dra_scheduler) -> None:
    """A tenant with `edit` creates a ResourceClaim nested 3,000 levels deep. The running
    extender's claim watch decodes its event (the tower read as null, a warning), and does not
    break; a freshly started extender lists every claim and becomes ready. Before, the event broke
    the watch into a relist loop and the list never decoded (/readyz 503 for ever)."""
    log = dra_scheduler.workdir / f"{dra_scheduler.name}.log"

    def count(text: str) -> int:
        return log.read_text(errors="replace").count(text)

    decoded, broke = count("nests past the decoder's recursion limit"), count("watch resourceclaims broke")
    created = cluster.api.api_client.rest_client.pool_manager.request(
        "POST", f"{cluster.api.api_client.configuration.host}/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims",
        body=deep_claim("tower", 3000), headers={"Content-Type": "application/json"})
    assert created.status == 201, created.data[:300]
    try:
        wait_for("the extender's claim watch to decode the tower",
                 lambda: count("nests past the decoder's recursion limit") > decoded, timeout=30)
        assert count("watch resourceclaims broke") == broke
        fresh = extender_server(cluster.cp, tls=False, extra_args=["--dra-prioritize"], name="qgpu-extender-dra-fresh")
        try:
            fresh.start()  # waits for /readyz: every kind listed, the tower's claim included
        finally:
            fresh.stop()
    finally:
        # the answer carries the claim: not decoded (the client's own decoding would stop on it)
        client.ResourceV1Api(cluster.api_client).delete_namespaced_resource_claim("tower", ns, _preload_content=False)
