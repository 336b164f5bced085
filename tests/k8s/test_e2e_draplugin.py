"""The DRA kubelet plugin against the real kube-apiserver: ResourceClaims created through the API,
their allocation written through the status subresource as kube-scheduler writes it, and a test
kubelet calling the plugin over its real unix sockets (a real kubelet driving it is another test).
"""

from __future__ import annotations

import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from kubernetes import client

from qgpu_runtime.contract.dra import DRIVER, SHARED_CLASS, pool_name
from qgpu_runtime.contract.names import MIXED_LABEL
from qgpu_runtime.contract.store import read_status
from qgpu_runtime.gpu.simulated import build_cards, parse_spec
from qgpu_runtime.node.dra import cdi
from qgpu_runtime.node.dra.plugin import DraKubeletPlugin
from qgpu_runtime.node.dra.preparer import ClaimPreparer
from qgpu_runtime.node.dra.settings import DraSettings
from qgpu_runtime.node.kube_client import MERGE_PATCH, KubePodSource
from qgpu_runtime.node.store import Store

sys.path.insert(0, str(Path(__file__).parents[1] / "node"))
from drakubelet import Kubelet  # noqa: E402

NODE = "dra-node-1"
CARDS = {c.index: c for c in build_cards(parse_spec("2xT4-16G"), NODE)}


class Node:
    """One node's DRA plugin over a store and CDI folder that outlive a restart."""

    def __init__(self, root: Path, kubeconfig: Path) -> None:
        self.root = root
        self.kubeconfig = kubeconfig
        self.settings = DraSettings(NODE, root / "plugins", root / "registry", root / "cdi")
        self.kubelet = Kubelet(self.settings)
        self.start()

    def start(self) -> None:
        self.store = Store(self.root / "meta.db")
        self.store.sync_cards(list(CARDS.values()))
        source = KubePodSource(str(self.kubeconfig))
        preparer = ClaimPreparer(self.settings, CARDS, self.store, source, lambda: "burst-share", device_exists=lambda path: False,
                                 node_labels=lambda: source.node_labels(NODE))
        self.plugin = DraKubeletPlugin(self.settings, preparer)
        self.plugin.serve()

    def stop(self) -> None:
        self.plugin.stop()
        self.store.close()

    def spec(self, uid: str) -> dict | None:
        return cdi.read_spec(cdi.spec_path(self.settings.cdi_dir, uid))

    def shares(self, uid: str) -> list[tuple[int, int, int]]:
        return [(s.card_index, s.core_milli, s.memory_mib) for s in self.store.shares() if s.workload_id == uid]


@pytest.fixture
def node(cluster) -> Iterator[Node]:
    with tempfile.TemporaryDirectory(prefix="qgpu-dra-", dir="/tmp") as d:
        n = Node(Path(d), cluster.cp.admin_kubeconfig)
        yield n
        n.stop()


@pytest.fixture
def resource(cluster) -> client.ResourceV1Api:
    return client.ResourceV1Api(cluster.api_client)


def create_claim(api: client.ResourceV1Api, ns: str, name: str, core: int = 300, memory: int = 4096) -> dict[str, Any]:
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": ns},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": SHARED_CLASS, "capacity": {"requests": {"core": str(core), "memory": str(memory)}}}}]}}}
    return api.api_client.sanitize_for_serialization(api.create_namespaced_resource_claim(ns, body))


def allocate(api: client.ResourceV1Api, ns: str, name: str, device: str = "gpu-0",
             consumed: dict[str, str] | None = None) -> str:
    """Write status.allocation the way kube-scheduler does (consumable capacity, a share ID)."""
    share_id = str(uuid.uuid4())
    result: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": pool_name(NODE), "device": device,
                              "shareID": share_id}
    if consumed is not None:
        result["consumedCapacity"] = consumed
    selector = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}
    api.patch_namespaced_resource_claim_status(
        name, ns, {"status": {"allocation": {"devices": {"results": [result]}, "nodeSelector": selector}}},
        _content_type=MERGE_PATCH)
    return share_id


def test_prepare_reads_the_claim_books_it_and_writes_the_cdi_spec(node, resource, ns):
    uid = create_claim(resource, ns, "train")["metadata"]["uid"]
    share_id = allocate(resource, ns, "train", consumed={"core": "300", "memory": "4096"})
    answer = node.kubelet.prepare((ns, uid, "train"))[uid]
    assert answer.error == ""
    (device,) = answer.devices
    assert (device.device_name, device.pool_name, list(device.request_names)) == ("gpu-0", NODE, ["gpu"])
    assert list(device.cdi_device_ids) == [f"gpu.qgpu.io/claim={uid}-0"] and device.share_id == share_id
    (spec_device,) = node.spec(uid)["devices"]
    env = set(spec_device["containerEdits"]["env"])
    assert {f"NVIDIA_VISIBLE_DEVICES={CARDS[0].uuid}", "QGPU_CORE_MILLI=300", "QGPU_MEMORY_MIB=4096",
            "QGPU_POLICY=burst-share", "QGPU_CLASS=normal"} <= env
    assert "deviceNodes" not in spec_device["containerEdits"]  # this host has no /dev/nvidia*
    assert node.shares(uid) == [(0, 300, 4096)]
    assert (ns, "train", "gpu", 0, 300, 4096, "normal") in read_status(node.store.path).shares


def test_a_whole_card_is_read_from_the_apiservers_own_quantity_form(node, resource, ns):
    uid = create_claim(resource, ns, "whole", core=1000, memory=16384)["metadata"]["uid"]
    allocate(resource, ns, "whole", device="gpu-1", consumed={"core": "1000", "memory": "16384"})
    stored = json.loads(resource.read_namespaced_resource_claim("whole", ns, _preload_content=False).data)
    assert stored["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["core"] == "1k"
    answer = node.kubelet.prepare((ns, uid, "whole"))[uid]
    assert answer.error == ""
    assert node.shares(uid) == [(1, 1000, 16384)]


def test_a_claim_with_another_uid_is_refused(node, resource, ns):
    create_claim(resource, ns, "train")
    allocate(resource, ns, "train", consumed={"core": "300", "memory": "4096"})
    stale = str(uuid.uuid4())
    error = node.kubelet.prepare((ns, stale, "train"))[stale].error
    assert "not the one kubelet asked for" in error
    assert node.store.shares() == [] and node.spec(stale) is None


def test_prepare_twice_is_idempotent_and_unprepare_frees(node, resource, ns):
    uid = create_claim(resource, ns, "train")["metadata"]["uid"]
    allocate(resource, ns, "train", consumed={"core": "300", "memory": "4096"})
    first = node.kubelet.prepare((ns, uid, "train"))[uid]
    assert node.kubelet.prepare((ns, uid, "train"))[uid] == first
    assert node.shares(uid) == [(0, 300, 4096)]
    assert node.kubelet.unprepare((ns, uid, "train"))[uid].error == ""
    assert node.shares(uid) == [] and node.spec(uid) is None


def test_a_restarted_plugin_unprepares_and_an_unknown_claim_unprepares(node, resource, ns):
    uid = create_claim(resource, ns, "train")["metadata"]["uid"]
    allocate(resource, ns, "train", consumed={"core": "300", "memory": "4096"})
    assert node.kubelet.prepare((ns, uid, "train"))[uid].error == ""
    node.stop()
    node.start()
    assert node.kubelet.get_info().name == DRIVER
    assert node.kubelet.unprepare((ns, uid, "train"))[uid].error == ""
    assert node.store.shares() == [] and node.spec(uid) is None
    unknown = str(uuid.uuid4())
    assert node.kubelet.unprepare((ns, unknown, "never"))[unknown].error == ""


def test_a_malformed_allocation_is_refused_naming_the_field(node, resource, ns):
    uid = create_claim(resource, ns, "train")["metadata"]["uid"]
    allocate(resource, ns, "train", consumed={"core": "300", "memory": "4Gi"})
    error = node.kubelet.prepare((ns, uid, "train"))[uid].error
    assert f"ResourceClaim {ns}/train: status.allocation.devices.results[0]" in error
    assert "consumedCapacity.memory='4Gi': must be a non-negative whole number" in error
    assert node.store.shares() == [] and node.spec(uid) is None


def test_an_allocation_without_consumed_capacity_is_refused(node, resource, ns):
    uid = create_claim(resource, ns, "train")["metadata"]["uid"]
    allocate(resource, ns, "train")
    assert "consumedCapacity is missing" in node.kubelet.prepare((ns, uid, "train"))[uid].error


def test_the_node_manager_with_dra_prepares_through_its_own_api_client(cluster, resource, ns):
    from qgpu_runtime.gpu.simulated import SimulatedBackend
    from qgpu_runtime.node.manager import ManagerConfig, NodeManager

    uid = create_claim(resource, ns, "train")["metadata"]["uid"]
    allocate(resource, ns, "train", consumed={"core": "300", "memory": "4096"})
    with tempfile.TemporaryDirectory(prefix="qgpu-dra-", dir="/tmp") as d:
        root = Path(d)
        config = ManagerConfig(node=NODE, resources=(), plugin_dir=root / "dp", pod_resources_socket=root / "none.sock",
                               state_dir=root / "state", isolation_policy="fixed-share", label_node=False,
                               dra=True, cdi_dir=root / "cdi", kubelet_plugins_dir=root / "plugins",
                               plugins_registry_dir=root / "registry")
        store = Store(root / "meta.db")
        from qgpu_runtime.node.kube_client import KubeSlices

        pods = KubePodSource(str(cluster.cp.admin_kubeconfig))
        manager = NodeManager(config, SimulatedBackend(tuple(CARDS.values())), store, pods, slice_api=KubeSlices(pods))
        try:
            assert manager.start()
            kubelet = Kubelet(manager.registration.settings)
            answer = kubelet.prepare((ns, uid, "train"))[uid]
            assert answer.error == "" and answer.devices[0].device_name == "gpu-0"
            manager.release_gone()  # the pods' release leaves the claim's shares alone
            assert [(s.workload, s.core_milli) for s in store.shares()] == [("train", 300)]
            spec = cdi.read_spec(cdi.spec_path(root / "cdi", uid))
            assert "QGPU_POLICY=fixed-share" in spec["devices"][0]["containerEdits"]["env"]
        finally:
            manager.stop()
            store.close()


def test_the_share_config_and_reserved_pod_reach_the_store_and_the_isolation_tenant(node, resource, cluster, ns):
    """A claim with the webhook's opaque ShareConfig, reserved for a real pod through the status
    subresource: the store carries the class and the pod, and the isolation loop's tenant for
    that pod's container holds the claim's share as offline work."""
    from qgpu_runtime.contract.draclaim import share_config
    from qgpu_runtime.node.tenants import tenants_of

    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "batch", "namespace": ns},
            "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": SHARED_CLASS,
                                                         "capacity": {"requests": {"core": "400", "memory": "2048"}}}}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": share_config("offline", True)}}]}}}
    uid = resource.create_namespaced_resource_claim(ns, body).metadata.uid
    core = client.CoreV1Api(cluster.api_client)
    pod = core.create_namespaced_pod(ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "batch-0"},
        "spec": {"nodeName": NODE, "resourceClaims": [{"name": "gpu", "resourceClaimName": "batch"}],
                 "containers": [{"name": "main", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}},
                                {"name": "sidecar", "image": "busybox"}]}})
    selector = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}
    resource.patch_namespaced_resource_claim_status("batch", ns, {"status": {
        "allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": pool_name(NODE), "device": "gpu-1",
                                                "shareID": str(uuid.uuid4()), "consumedCapacity": {"core": "400", "memory": "2048"}}]},
                       "nodeSelector": selector},
        "reservedFor": [{"resource": "pods", "name": "batch-0", "uid": pod.metadata.uid}]}}, _content_type=MERGE_PATCH)

    # offline work only on a node labelled mixed-qgpu-enable=enable, read from the apiserver's Node
    core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    try:
        assert f"is not labelled {MIXED_LABEL}=enable" in node.kubelet.prepare((ns, uid, "batch"))[uid].error
        core.patch_node(NODE, {"metadata": {"labels": {MIXED_LABEL: "enable"}}})
        assert node.kubelet.prepare((ns, uid, "batch"))[uid].error == ""
    finally:
        core.delete_node(NODE)
    assert (ns, "batch", "gpu", 1, 400, 2048, "offline") in read_status(node.store.path).shares
    (booked,) = node.store.prepared_claims()
    assert [(p.uid, p.name) for p in booked.pods] == [(pod.metadata.uid, "batch-0")]
    assert "QGPU_CLASS=offline" in node.spec(uid)["devices"][0]["containerEdits"]["env"]

    live = json.loads(core.read_namespaced_pod("batch-0", ns, _preload_content=False).data)
    ((ref, workload),) = tenants_of(node.store.shares(), node.store.prepared_claims(), {pod.metadata.uid: live}).values()
    assert [(m.pod, m.container) for m in ref.members] == [("batch-0", "main")]  # the sidecar holds nothing
    assert (workload.klass.value, [(q.index, q.core_milli, q.memory_mib) for q in workload.cards]) == ("offline", [(1, 400, 2048)])
