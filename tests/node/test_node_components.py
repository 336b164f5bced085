"""The node manager's parts on their own seams (node/deviceplugin/allocator.py, node/health.py,
node/reconciler.py, node/publisher.py): each built from a real store and a pod list, without a
NodeManager, gRPC or a kubelet."""

from __future__ import annotations

import pytest
from podfactory import pod, qgpu

from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.node.deviceplugin.allocator import Allocator
from qgpu_runtime.node.deviceplugin.devices import AllocateRefused, DeviceService, wait_devices
from qgpu_runtime.node.deviceplugin.resources import CATALOG
from qgpu_runtime.node.health import CardHealth
from qgpu_runtime.node.manager import ManagerConfig, NodeManager
from qgpu_runtime.node.metrics import ManagerMetrics
from qgpu_runtime.node.publisher import NodePublisher
from qgpu_runtime.node.reconciler import Reconciler
from qgpu_runtime.node.store import Share, Store
from tests.recordkeys import VERIFIER

NODE = "gpu-node-1"
CORE = CATALOG["tke.cloud.tencent.com/qgpu-core"]
CARDS = {i: CardInfo(i, f"GPU-{i}", "Tesla T4", 16384, i) for i in range(2)}


class Pods:
    """A PodSource over a list; records what was written."""

    def __init__(self, pods: list[dict]) -> None:
        self.pods, self.patches, self.nodes, self.capacity = pods, [], [], []
        self.conditions: list[tuple[str, dict]] = []
        self.node_events: list[tuple[str, str, str, str]] = []

    def pods_on_node(self, node):
        return list(self.pods)

    def patch_pod_annotations(self, namespace, name, values):
        self.patches.append((namespace, name, dict(values)))

    def patch_node(self, node, labels, annotations):
        self.nodes.append((node, dict(labels), dict(annotations)))

    def patch_node_capacity(self, node, capacity):
        self.capacity.append((node, dict(capacity)))

    def node_labels(self, node):
        return {}

    def record_event(self, *args):
        pass

    def set_node_condition(self, node, condition):
        self.conditions.append((node, dict(condition)))

    def record_node_event(self, node, event_type, reason, message):
        self.node_events.append((node, event_type, reason, message))


@pytest.fixture()
def parts(tmp_path):
    config = ManagerConfig(NODE, (CORE,), plugin_dir=tmp_path / "plugins", state_dir=tmp_path / "state", record_verifier=VERIFIER)
    store = Store(tmp_path / "meta.db")
    store.sync_cards(list(CARDS.values()))
    health = CardHealth(CARDS)
    yield config, store, health
    store.close()


def _units(card: int, first: int, count: int) -> tuple[str, ...]:
    return tuple(f"qgpu-core-{card}-{i}" for i in range(first, first + count))


def _allocator(parts, pods: Pods) -> Allocator:
    config, store, health = parts
    return Allocator(config, CARDS, health, store, pods, ManagerMetrics.create(NODE), lambda: Policy.FIXED_SHARE,
                     clock_ns=lambda: 7)


def test_the_allocator_grants_a_record_and_writes_it_to_the_store_first(parts):
    first = pod("first", NODE, [("main", qgpu(30, 4), [(0, "GPU-0", 300, 4096)])])
    pods = Pods([first])
    allocator = _allocator(parts, pods)
    grant = allocator.allocate(CORE, _units(0, 0, 30))
    assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"
    assert [(s.workload, s.card_index, s.core_milli) for s in parts[1].shares()] == [("first", 0, 300)]
    assert pods.patches == []  # no API write on kubelet's admission path: the annotation is queued
    assert allocator.writer.run_once()
    assert pods.patches == [("default", "first", {"qgpu.io/assigned": '["main"]'})]


def test_the_allocator_refuses_an_over_commit_naming_the_card_without_a_manager(parts):
    first = pod("first", NODE, [("main", qgpu(60, 4), [(0, "GPU-0", 600, 4096)])], bind_time=1)
    second = pod("second", NODE, [("main", qgpu(60, 4), [(0, "GPU-0", 600, 4096)])], bind_time=2)
    allocator = _allocator(parts, Pods([first, second]))
    allocator.allocate(CORE, _units(0, 0, 60))
    with pytest.raises(AllocateRefused, match=r"default/second container main: its record would over-commit this node: "
                                              r"card 0: core 1200‰ committed > 1000‰"):
        allocator.allocate(CORE, _units(1, 0, 60))  # kubelet's choice of units does not matter


def test_the_allocator_refuses_devices_on_an_unhealthy_card(parts):
    _, _, health = parts
    health.mark(1, "XID 79")
    with pytest.raises(AllocateRefused, match=r"card 1, which is unhealthy \(XID 79\)"):
        _allocator(parts, Pods([])).allocate(CORE, ("qgpu-core-1-0",))


def test_health_marks_once_and_moves_the_device_list_version(parts):
    _, _, health = parts
    version, devices = wait_devices(health, CORE, -1, 0)
    assert health.mark(0, "XID 48") and not health.mark(0, "again") and not health.mark(9, "no such card")
    moved, after = wait_devices(health, CORE, version, 0)
    assert moved == version + 1
    assert all(not ok for d, ok in after if d.startswith("qgpu-core-0-")) and all(ok for _, ok in devices)


def test_a_card_cleared_is_healthy_again_and_moves_the_device_list_version(parts):
    _, _, health = parts
    health.mark(0, "XID 48")
    version, _ = wait_devices(health, CORE, -1, 0)
    assert health.clear(0) and not health.clear(0) and not health.clear(1)
    moved, devices = wait_devices(health, CORE, version, 0)
    assert moved == version + 1 and all(ok for _, ok in devices) and health.unhealthy() == {}


def test_the_reconciler_releases_pods_that_are_gone(parts):
    config, store, _ = parts
    gone = pod("gone", NODE, [("main", qgpu(30, 4), [(0, "GPU-0", 300, 4096)])])
    pods = Pods([gone])
    allocator = _allocator(parts, pods)
    allocator.allocate(CORE, _units(0, 0, 30))
    pods.pods = []
    assert list(Reconciler(config, store, pods, allocator.lock).release_gone()) == [gone["metadata"]["uid"]]
    assert store.shares() == [] and store.grants() == []


def test_the_publisher_retries_until_the_node_patch_lands(parts):
    config, _, health = parts

    class Failing(Pods):
        def patch_node(self, node, labels, annotations):
            raise RuntimeError("apiserver away")

    publisher = NodePublisher(config, CARDS, health, Failing([]), lambda: Policy.BEST_EFFORT)
    publisher.publish()
    assert publisher.due is not None
    working = Pods([])
    publisher.pods, publisher.due = working, 0.0
    publisher.retry_if_due()
    assert publisher.due is None and working.nodes[0][1]["qgpu.io/gpu-count"] == "2"


@pytest.mark.parametrize(("resources", "dra", "published"), [
    (("nvidia.com/gpu",), False, True),
    (("tke.cloud.tencent.com/qgpu-core",), False, False),  # HAMi's pods do not come to this node's plugin
    ((), True, False),  # DRA pools: the claims carry the shares
])
def test_hamis_share_sizes_are_published_as_node_capacity_where_nvidia_gpu_is_served(tmp_path, resources, dra, published):
    """Where a DeviceClass maps nvidia.com/gpu (KEP-5004), kube-scheduler refuses a HAMi pod on any
    node that lacks gpumem / gpumem-percentage / gpucores in its capacity; the node's totals go there."""
    config = ManagerConfig(NODE, tuple(CATALOG[r] for r in resources), plugin_dir=tmp_path / "p", state_dir=tmp_path / "s",
                           record_verifier=VERIFIER, dra=dra)
    pods = Pods([])
    NodePublisher(config, CARDS, CardHealth(CARDS), pods, lambda: Policy.BEST_EFFORT).publish()
    expected = [(NODE, {"nvidia.com/gpumem": "32768", "nvidia.com/gpumem-percentage": "200", "nvidia.com/gpucores": "200"})]
    assert pods.capacity == (expected if published else [])


@pytest.mark.parametrize(("policy", "isolation", "backend", "enforced", "reason"), [
    (Policy.FIXED_SHARE, True, "nvml", True, "Enforced"),
    (Policy.BURST_SHARE, True, "nvml", True, "Enforced"),
    (Policy.BEST_EFFORT, True, "nvml", False, "PolicyBestEffort"),
    (Policy.FIXED_SHARE, False, "nvml", False, "IsolationOff"),
    (Policy.FIXED_SHARE, True, "simulated", False, "SimulatedGPUs"),
    (Policy.BEST_EFFORT, False, "simulated", False, "IsolationOff"),  # the first missing piece is named
])
def test_whether_shares_are_enforced_follows_the_isolation_loop_the_backend_and_the_policy(policy, isolation, backend,
                                                                                          enforced, reason):
    from qgpu_runtime.node.enforcer import enforcement

    got = enforcement(policy, isolation, backend, 0.05)
    assert (got.enforced, got.reason) == (enforced, reason)
    assert policy.value in got.message or reason == "SimulatedGPUs" and backend in got.message


def test_the_node_says_once_whether_its_shares_are_enforced_and_warns_when_not(parts):
    """The condition lands with the labels (retried with them); the Warning Event is written once
    per change of what the condition says, not on every publish."""
    from qgpu_runtime.node.enforcer import enforcement

    config, _, health = parts
    pods = Pods([])
    publisher = NodePublisher(config, CARDS, health, pods, lambda: Policy.BEST_EFFORT)
    publisher.publish()
    assert pods.conditions == [] and pods.node_events == []  # nothing known yet: nothing claimed
    publisher.enforcement = enforcement(Policy.BEST_EFFORT, True, "nvml", 0.05)
    publisher.publish()
    publisher.publish()
    ((node, condition),) = pods.conditions
    assert node == NODE and {k: condition[k] for k in ("type", "status", "reason")} == {
        "type": "QGPUSharesEnforced", "status": "False", "reason": "PolicyBestEffort"}
    assert pods.node_events == [(NODE, "Warning", "SharesNotEnforced", f"PolicyBestEffort: {condition['message']}")]
    publisher.enforcement = enforcement(Policy.FIXED_SHARE, True, "nvml", 0.05)
    publisher.publish()
    assert [c["status"] for _, c in pods.conditions] == ["False", "True"] and len(pods.node_events) == 1


def test_a_refused_condition_is_retried_with_the_labels(parts):
    from qgpu_runtime.node.enforcer import enforcement

    config, _, health = parts

    class Refusing(Pods):
        def set_node_condition(self, node, condition):
            raise RuntimeError("denied by the admission policy")

    publisher = NodePublisher(config, CARDS, health, Refusing([]), lambda: Policy.FIXED_SHARE)
    publisher.enforcement = enforcement(Policy.FIXED_SHARE, False, "nvml", 0.05)
    publisher.publish()
    assert publisher.due is not None and publisher.pods.node_events == []
    working = Pods([])
    publisher.pods, publisher.due = working, 0.0
    publisher.retry_if_due()
    assert publisher.due is None and working.conditions[0][1]["reason"] == "IsolationOff" and len(working.node_events) == 1


def test_the_manager_is_what_the_device_plugin_talks_to():
    assert isinstance(NodeManager, type) and all(hasattr(NodeManager, m) for m in DeviceService.__dict__ if not m.startswith("_"))


def test_the_pods_file_source_keeps_the_nodes_other_conditions_and_appends_node_events(tmp_path):
    import json

    from qgpu_runtime.node.pods import FilePodSource

    source = FilePodSource(tmp_path / "pods.json")
    (tmp_path / "pods.node.json").write_text(json.dumps({"metadata": {"name": NODE}, "status": {"conditions": [
        {"type": "Ready", "status": "True"}, {"type": "QGPUSharesEnforced", "status": "True", "reason": "Enforced"}]}}))
    source.set_node_condition(NODE, {"type": "QGPUSharesEnforced", "status": "False", "reason": "IsolationOff"})
    conditions = json.loads((tmp_path / "pods.node.json").read_text())["status"]["conditions"]
    assert conditions == [{"type": "Ready", "status": "True"},
                          {"type": "QGPUSharesEnforced", "status": "False", "reason": "IsolationOff"}]
    source.record_node_event(NODE, "Warning", "SharesNotEnforced", "IsolationOff: off")
    events = [json.loads(line) for line in (tmp_path / "pods.events.jsonl").read_text().splitlines()]
    assert events == [{"node": NODE, "type": "Warning", "reason": "SharesNotEnforced", "message": "IsolationOff: off"}]


def test_the_pods_of_a_card_are_its_device_plugin_pods_and_the_pods_of_its_claims():
    from qgpu_runtime.node.health import pods_on_card
    from qgpu_runtime.node.store import PreparedClaim, ReservedPod, Share

    shares = [Share("uid-a", "team", "a", "c1", 1, "GPU-1", 300, 2048, "normal", 1),
              Share("uid-a", "team", "a", "c2", 1, "GPU-1", 200, 2048, "normal", 1),  # a second container: one pod
              Share("uid-b", "team", "b", "main", 0, "GPU-0", 300, 2048, "normal", 2),  # another card
              Share("claim-1", "ml", "train-gpu", "share", 1, "GPU-1", 500, 4096, "normal", 3)]
    claims = [PreparedClaim("claim-1", "ml", "train-gpu", (), "", 3, (ReservedPod("uid-t", "train"), ReservedPod("uid-u", "eval"))),
              PreparedClaim("claim-2", "ml", "idle", (), "", 4, (ReservedPod("uid-i", "idle"),))]
    assert pods_on_card(1, shares, claims) == [("ml", "eval", "uid-u"), ("ml", "train", "uid-t"), ("team", "a", "uid-a")]
    assert pods_on_card(0, shares, claims) == [("team", "b", "uid-b")]
    assert pods_on_card(2, shares, claims) == []


def test_rows_of_a_pod_the_watched_view_does_not_show_yet_still_hold_their_card():
    """X was allocated by a LIST ahead of the watch; Y is then matched on the watched view, which
    does not show X yet: X's rows were dropped as a gone pod's, and Y's record got X's card (helper
    audit, 2026-12-01). On a view, a pod it does not show holds its rows; a LIST decides."""
    from qgpu_runtime.node.deviceplugin.allocator import over_commit
    from qgpu_runtime.node.deviceplugin.matching import match

    x = pod("x", NODE, [("main", qgpu(60, 4), [(0, "GPU-0", 600, 4096)])], bind_time=1)
    y = pod("y", NODE, [("main", qgpu(60, 4), [(0, "GPU-0", 600, 4096)])], bind_time=2)
    x_rows = [Share(x["metadata"]["uid"], "default", "x", "main", 0, "GPU-0", 600, 4096, "normal", 1)]
    m = match(NODE, CORE.name, 60, [y], set(), VERIFIER, cards=CARDS)
    assert over_commit(m, CARDS, x_rows, [y], unseen_hold=True)  # the view: X unseen, still holds card 0
    assert over_commit(m, CARDS, x_rows, [y]) == []  # a LIST without X: X is gone
    assert over_commit(m, CARDS, x_rows, [x, y], unseen_hold=True)  # both seen: X live
    done = {**x, "status": {"phase": "Succeeded"}}
    assert over_commit(m, CARDS, x_rows, [done, y], unseen_hold=True) == []  # seen finished: released


def test_after_one_refusal_for_a_pod_with_no_record_the_next_allocate_is_served(parts):
    """Kubelet refused one Allocate for the stranger's sake (rule 5) and failed that pod, but the
    stranger still read Pending when the next recorded pod's Allocate came: it was refused too,
    for good (review, 2026-12-01). A stranger a refusal was made for is not counted again."""
    victim = pod("victim", NODE, [("main", qgpu(30, 4), [(0, "GPU-0", 300, 4096)])], bind_time=1)
    stranger = {"metadata": {"name": "intruder", "namespace": "tenant", "uid": "uid-intruder", "annotations": {}},
                "spec": {"nodeName": NODE, "containers": [{"name": "main", "resources": {"limits": {CORE.name: "30"}}}]},
                "status": {"phase": "Pending"}}
    allocator = _allocator(parts, Pods([victim, stranger]))
    with pytest.raises(AllocateRefused, match="may be for tenant/intruder"):
        allocator.allocate(CORE, _units(0, 0, 30))  # kubelet fails the pod it was for
    grant = allocator.allocate(CORE, _units(0, 30, 30))  # the next call: served
    assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"
