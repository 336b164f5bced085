"""The device plugin against the test kubelet, over real unix sockets."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from podfactory import pod, qgpu

from qgpu_runtime.contract.names import ASSIGNED

CORE = "tke.cloud.tencent.com/qgpu-core"
MEM = "tke.cloud.tencent.com/qgpu-memory"
T9K_PCT = "tensorstack.dev/nvidia-gpu-percent"
T9K_GPU = "tensorstack.dev/nvidia-gpu"
T9K_NODE = "tensorstack.dev/nvidia-gpu-node"
NANO_PCT = "nano-gpu/gpu-percent"
NANO_CORE = "nano-gpu.io/gpu-core"
NANO_MEM = "nano-gpu.io/gpu-memory"
EGPU_CORE = "elasticgpu.io/gpu-core"
EGPU_MEM = "elasticgpu.io/gpu-memory"


def test_registers_every_resource_the_extender_places_by_default(node):
    assert sorted(node.kubelet.registrations) == sorted([
        CORE, MEM, "tke.cloud.tencent.com/qgpu-core-greedy", "tencent.com/vcuda-core", "tencent.com/vcuda-memory",
        T9K_GPU, T9K_PCT, T9K_NODE, "nvidia.com/gpu", NANO_PCT, NANO_CORE, NANO_MEM, EGPU_CORE, EGPU_MEM])


def test_the_default_resources_are_every_resource_the_extender_places():
    """All but HAMi's gpumem, gpumem-percentage and gpucores: they size the shares the kubelet
    counts as nvidia.com/gpu, and the kubelet leaves out of its fit any extended resource no plugin
    advertises (docs/migration.md, "HAMi")."""
    from qgpu_runtime.model.requests import GPU_RESOURCES, HAMI_RESOURCES
    from qgpu_runtime.node.deviceplugin.resources import DEFAULT_RESOURCES

    assert sorted(DEFAULT_RESOURCES) == sorted(GPU_RESOURCES - HAMI_RESOURCES)


def test_nvidia_gpu_counts_one_device_per_gib_so_shares_of_a_card_each_get_one():
    """HAMi's vGPUs and KAI's fractions ask nvidia.com/gpu: 1 per card they share; a card must
    offer the kubelet as many devices as the extender may place shares on it (issue 22 §3)."""
    from qgpu_runtime.gpu.types import CardInfo
    from qgpu_runtime.node.deviceplugin.resources import CATALOG

    card = CardInfo(index=1, uuid="GPU-x", model="T4", memory_mib=16 * 1024, minor=1)
    assert len(CATALOG["nvidia.com/gpu"].device_ids(card)) == 16


def test_each_resource_advertises_its_units_per_card(node):
    assert len(node.kubelet.devices(CORE)) == 200  # 2 cards x 100 percent
    assert len(node.kubelet.devices(MEM)) == 32  # 2 cards x 16 GiB
    assert len(node.kubelet.devices(T9K_GPU)) == 2  # whole cards
    assert len(node.kubelet.devices(NANO_PCT)) == len(node.kubelet.devices(EGPU_CORE)) == 200  # percent
    assert len(node.kubelet.devices(NANO_MEM)) == len(node.kubelet.devices(EGPU_MEM)) == 32  # GiB
    assert set(node.kubelet.devices(CORE).values()) == {"Healthy"}
    assert node.kubelet.plugins[CORE].options.pre_start_required


def test_allocate_returns_cards_quota_mounts_and_devices_from_the_record(node):
    p = pod("infer", "gpu-node-1", [("main", qgpu(30, 5), [(1, node.uuid(1), 300, 5120)])])
    node.set_pods([p])
    envs = node.kubelet.admit(p)["main"]
    assert envs["NVIDIA_VISIBLE_DEVICES"] == node.uuid(1)
    assert envs["QGPU_CORE_MILLI"] == "300"
    assert envs["QGPU_MEMORY_MIB"] == "5120"
    assert envs["QGPU_CLASS"] == "normal" and envs["QGPU_POLICY"] == "fixed-share"
    c = node.kubelet.responses[("default", "infer", "main", CORE)]
    assert c.mounts[0].container_path == "/etc/qgpu" and c.mounts[0].read_only
    quota = json.loads((node.root / "state" / "containers" / p["metadata"]["uid"] / "main" / "quota.json").read_text())
    assert quota["cards"] == [{"index": 1, "uuid": node.uuid(1), "core_milli": 300, "memory_mib": 5120}]
    assert [d.host_path for d in c.devices][-1] == "/dev/nvidia1"
    assert c.annotations["qgpu.io/pod"] == "default/infer"


def test_each_granted_card_is_named_by_a_read_only_dev_null_mount_in_grant_order(node):
    """Where the nvidia_container_toolkit role made the toolkit ignore NVIDIA_VISIBLE_DEVICES of
    unprivileged containers, these mounts are what gives the container its cards; the variable
    stays for runtimes still configured to read it."""
    p = pod("two-cards", "gpu-node-1", [("main", {T9K_GPU: "2"}, [(1, node.uuid(1), 1000, 16384),
                                                                   (0, node.uuid(0), 1000, 16384)])])
    node.set_pods([p])
    envs = node.kubelet.admit(p)["main"]
    c = node.kubelet.responses[("default", "two-cards", "main", T9K_GPU)]
    assert c.mounts[0].container_path == "/etc/qgpu"
    assert [(m.container_path, m.host_path, m.read_only) for m in c.mounts[1:]] == [
        (f"/var/run/nvidia-container-devices/{node.uuid(1)}", "/dev/null", True),
        (f"/var/run/nvidia-container-devices/{node.uuid(0)}", "/dev/null", True)]
    assert envs["NVIDIA_VISIBLE_DEVICES"] == f"{node.uuid(1)},{node.uuid(0)}"


def test_preferred_allocation_steers_kubelet_to_the_recorded_card(node):
    p = pod("a", "gpu-node-1", [("main", qgpu(30, 5), [(1, node.uuid(1), 300, 5120)])])
    node.set_pods([p])
    node.kubelet.admit(p)
    held = node.kubelet.held[("default", "a")]["main"]
    assert all(d.startswith("qgpu-core-1-") for d in held[CORE])
    assert all(d.startswith("qgpu-memory-1-") for d in held[MEM])


def test_same_size_pending_pods_are_served_in_bind_order_each_with_its_own_cards(node):
    early = pod("early", "gpu-node-1", [("main", qgpu(50, 4), [(1, node.uuid(1), 500, 4096)])], bind_time=100)
    late = pod("late", "gpu-node-1", [("main", qgpu(50, 4), [(0, node.uuid(0), 500, 4096)])], bind_time=200)
    node.set_pods([late, early])
    assert node.kubelet.admit(early)["main"]["NVIDIA_VISIBLE_DEVICES"] == node.uuid(1)
    assert node.kubelet.admit(late)["main"]["NVIDIA_VISIBLE_DEVICES"] == node.uuid(0)
    assigned = {p["metadata"]["name"]: json.loads(p["metadata"]["annotations"][ASSIGNED]) for p in node.pods()}
    assert assigned == {"early": ["main"], "late": ["main"]}


def test_second_resource_of_a_container_goes_to_the_container_in_flight(node):
    # 'old' was bound first but kubelet is admitting 'new' (core already served): memory must follow 'new'.
    old = pod("old", "gpu-node-1", [("main", qgpu(20, 2), [(0, node.uuid(0), 200, 2048)])], bind_time=1)
    new = pod("new", "gpu-node-1", [("main", qgpu(30, 2), [(1, node.uuid(1), 300, 2048)])], bind_time=2)
    node.set_pods([old, new])
    node.kubelet.allocate(CORE, [f"qgpu-core-1-{i}" for i in range(30)])
    resp = node.kubelet.allocate(MEM, ["qgpu-memory-1-0", "qgpu-memory-1-1"])
    assert resp.container_responses[0].envs["QGPU_CORE_MILLI"] == "300"


def test_containers_of_one_pod_are_served_in_spec_order(node):
    p = pod("two", "gpu-node-1", [("first", qgpu(20, 2), [(0, node.uuid(0), 200, 2048)]),
                                   ("second", qgpu(20, 2), [(1, node.uuid(1), 200, 2048)])])
    node.set_pods([p])
    envs = node.kubelet.admit(p)
    assert envs["first"]["NVIDIA_VISIBLE_DEVICES"] == node.uuid(0)
    assert envs["second"]["NVIDIA_VISIBLE_DEVICES"] == node.uuid(1)


def test_unmatched_allocate_fails_and_says_why(node):
    p = pod("small", "gpu-node-1", [("main", qgpu(10, 1), [(0, node.uuid(0), 100, 1024)])])
    node.set_pods([p])
    with pytest.raises(grpc.RpcError) as err:
        node.kubelet.allocate(CORE, [f"qgpu-core-0-{i}" for i in range(40)])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "default/small: next container 'main' asks for 10 tke.cloud.tencent.com/qgpu-core, kubelet sent 40" in err.value.details()
    assert node.store.grants() == []


def test_a_served_container_is_not_served_twice(node):
    p = pod("once", "gpu-node-1", [("main", qgpu(10, 1), [(0, node.uuid(0), 100, 1024)])])
    node.set_pods([p])
    node.kubelet.admit(p)
    with pytest.raises(grpc.RpcError) as err:
        node.kubelet.allocate(CORE, [f"qgpu-core-0-{i}" for i in range(50, 60)])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_allocate_without_any_record_is_refused(node):
    with pytest.raises(grpc.RpcError) as err:
        node.kubelet.allocate(CORE, ["qgpu-core-0-0"])
    assert "no pending pod on this node carries a qgpu.io/allocation record" in err.value.details()


@pytest.mark.parametrize("signed", [False, True], ids=["tenant-written", "signed-but-larger-than-asked"])
def test_a_tenant_s_own_record_taking_a_whole_card_grants_nothing_and_books_nothing(node, signed):
    """Issue 21: a pod asking for 10% and 1 GiB, created with spec.nodeName and its own record
    granting card 0 whole, got QGPU_CORE_MILLI=1000 and QGPU_MEMORY_MIB=16384 and was booked."""
    greedy = pod("greedy", "gpu-node-1", [("main", qgpu(10, 1), [(0, node.uuid(0), 1000, 16384)])], signed=signed)
    node.set_pods([greedy])
    with pytest.raises(grpc.RpcError) as err:
        node.kubelet.admit(greedy)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "record not trusted, nothing granted" in err.value.details()
    assert node.store.grants() == [] and node.store.shares() == []
    refused = [node.manager.metrics.registry.get_sample_value("qgpu_untrusted_records_total", {"resource": r}) or 0
               for r in (CORE, MEM)]  # the test kubelet allocates a container's resources in random order
    assert sum(refused) == 1


def test_t9k_percent_request_gets_t9k_variables(node):
    p = pod("t9k", "gpu-node-1", [("main", {T9K_PCT: "25"}, [(0, node.uuid(0), 0, 4096)])])
    node.set_pods([p])
    envs = node.kubelet.admit(p)["main"]
    t9k = {k: v for k, v in envs.items() if k.startswith("T9K_")}
    assert t9k == {"T9K_GPU_MODE": "sgn", "T9K_GPU_COUNT": "1", "T9K_GPU_PERCENT": "25", "T9K_GPU_MEMORY": "4096"}
    assert envs["NVIDIA_VISIBLE_DEVICES"] == node.uuid(0)


@pytest.mark.parametrize("resources,share", [
    ({NANO_PCT: "25"}, (250, 4096)),  # a quarter of a 16 GiB card's compute and memory
    ({NANO_CORE: "20", NANO_MEM: "2"}, (200, 2048)),
    ({EGPU_CORE: "30", EGPU_MEM: "3"}, (300, 3072)),
    ({EGPU_MEM: "2"}, (0, 2048)),  # memory alone: no compute reserved
], ids=["nano-percent", "nano-core-memory", "elasticgpu-core-memory", "elasticgpu-memory-only"])
def test_nano_gpu_and_elastic_gpu_requests_get_their_share_of_the_recorded_card(node, resources, share):
    """nano-gpu's and elastic GPU's extended resources are served like qGPU's: kubelet's device
    count for each resource matches the container's own quantity, the card is the record's."""
    p = pod("egpu", "gpu-node-1", [("main", resources, [(1, node.uuid(1), *share)])])
    node.set_pods([p])
    envs = node.kubelet.admit(p)["main"]
    assert envs["NVIDIA_VISIBLE_DEVICES"] == node.uuid(1)
    assert (envs["QGPU_CORE_MILLI"], envs["QGPU_MEMORY_MIB"]) == (str(share[0]), str(share[1]))


def test_t9k_whole_card_request_gets_t9k_variables(node):
    p = pod("xgn", "gpu-node-1", [("main", {T9K_GPU: "1"}, [(1, node.uuid(1), 1000, 16384)])])
    node.set_pods([p])
    envs = node.kubelet.admit(p)["main"]
    assert {k: v for k, v in envs.items() if k.startswith("T9K_")} == {"T9K_GPU_MODE": "xgn", "T9K_GPU_COUNT": "1"}
    assert envs["NVIDIA_VISIBLE_DEVICES"] == node.uuid(1)


def test_the_whole_node_is_one_device(node):
    assert node.kubelet.devices(T9K_NODE) == {"t9k-gpu-node-node-0": "Healthy"}


def test_t9k_whole_node_request_gets_every_card_and_t9k_variables(node):
    p = pod("node", "gpu-node-1", [("main", {T9K_NODE: "1"}, [(0, node.uuid(0), 1000, 16384),
                                                              (1, node.uuid(1), 1000, 16384)])])
    node.set_pods([p])
    envs = node.kubelet.admit(p)["main"]
    assert {k: v for k, v in envs.items() if k.startswith("T9K_")} == {"T9K_GPU_MODE": "node", "T9K_GPU_COUNT": "2"}
    assert envs["NVIDIA_VISIBLE_DEVICES"] == f"{node.uuid(0)},{node.uuid(1)}"
    assert [(g.pod, g.resource, g.device_ids) for g in node.store.grants()] == [("node", T9K_NODE, ("t9k-gpu-node-node-0",))]


def test_the_whole_node_device_turns_unhealthy_with_any_card(node):
    before = node.kubelet.plugins[T9K_NODE].updates
    node.control_write({"unhealthy": {"1": "XID 79"}})
    node.kubelet.wait_for(lambda: node.kubelet.plugins[T9K_NODE].updates > before)
    assert node.kubelet.devices(T9K_NODE) == {"t9k-gpu-node-node-0": "Unhealthy"}


@pytest.mark.parametrize(("resource", "ids", "says"), [
    (CORE, ["qgpu-memory-0-0"], "'qgpu-memory-0-0' is not one this node advertises for tke.cloud.tencent.com/qgpu-core: "
                                "IDs are 'qgpu-core-<card index>-<unit>'"),
    (CORE, ["qgpu-core-2-0"], "'qgpu-core-2-0' of tke.cloud.tencent.com/qgpu-core names card 2; this node has cards [0, 1]"),
    (MEM, ["qgpu-memory-0-16"], "'qgpu-memory-0-16' of tke.cloud.tencent.com/qgpu-memory: unit 16 is out of range; "
                                "card 0 has units 0..15"),
    (CORE, ["qgpu-core-0-3", "qgpu-core-0-3"], "'qgpu-core-0-3' is named twice in one Allocate"),
    (T9K_NODE, ["t9k-gpu-node-0-0"], "the node has one device, 't9k-gpu-node-node-0'"),
    # spellings int() and isdigit() take, never advertised: before, they passed the check and
    # Allocate failed on a KeyError (gRPC UNKNOWN), or two spellings named one device twice
    (CORE, ["qgpu-core-0-3", "qgpu-core-0-03"], "'qgpu-core-0-03' is not one this node advertises"),
    (CORE, ["qgpu-core-00-3"], "'qgpu-core-00-3' is not one this node advertises"),
    (CORE, ["qgpu-core-0-\u0663"], "is not one this node advertises for tke.cloud.tencent.com/qgpu-core: IDs are "
                                   "'qgpu-core-<card index>-<unit>' in plain decimal"),
], ids=["other-resource", "no-such-card", "unit-out-of-range", "duplicate", "whole-node", "leading-zero-unit",
        "leading-zero-card", "non-ascii-digit"])
def test_allocate_refuses_device_ids_never_advertised(node, resource, ids, says):
    p = pod("a", "gpu-node-1", [("main", {resource: str(len(ids))}, [(0, node.uuid(0), 100, 1024)])])
    node.set_pods([p])
    with pytest.raises(grpc.RpcError) as err:
        node.kubelet.allocate(resource, ids)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert says in err.value.details()
    assert node.store.grants() == []


def test_each_pod_on_a_card_that_turns_unhealthy_gets_a_warning_event_and_the_others_none(node):
    on_1 = pod("on-1", "gpu-node-1", [("main", qgpu(30, 2), [(1, node.uuid(1), 300, 2048)])], bind_time=1)
    also_1 = pod("also-1", "gpu-node-1", [("main", qgpu(20, 1), [(1, node.uuid(1), 200, 1024)])], bind_time=2)
    on_0 = pod("on-0", "gpu-node-1", [("main", qgpu(40, 3), [(0, node.uuid(0), 400, 3072)])], bind_time=3)
    node.set_pods([on_1, also_1, on_0])
    for p in (on_1, also_1, on_0):
        node.kubelet.admit(p)
    node.control_write({"unhealthy": {"1": "XID 79"}})
    events = node.root / "pods.events.jsonl"

    def written():
        return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    node.kubelet.wait_for(lambda: len([e for e in written() if e.get("reason") == "GPUCardUnhealthy"]) >= 2)
    time.sleep(0.5)  # an Event for the healthy card's pod, or a second one per pod, would land by now
    got = [e for e in written() if e.get("reason") == "GPUCardUnhealthy"]
    assert sorted((e["pod"], e["uid"]) for e in got) == sorted((p["metadata"]["name"], p["metadata"]["uid"]) for p in (on_1, also_1))
    assert all(f"card 1 ({node.uuid(1)}) of node gpu-node-1 is unhealthy (XID 79)" in e["message"] for e in got), got


def test_xid_marks_the_cards_devices_unhealthy_and_allocate_refuses_them(node):
    before = node.kubelet.plugins[CORE].updates
    node.control_write({"unhealthy": {"1": "XID 79"}})
    node.kubelet.wait_for(lambda: node.kubelet.plugins[CORE].updates > before
                          and node.kubelet.devices(CORE)["qgpu-core-1-0"] == "Unhealthy")
    devices = node.kubelet.devices(CORE)
    assert devices["qgpu-core-0-0"] == "Healthy"
    assert sum(h == "Unhealthy" for h in devices.values()) == 100
    p = pod("x", "gpu-node-1", [("main", qgpu(10, 1), [(1, node.uuid(1), 100, 1024)])])
    node.set_pods([p])
    with pytest.raises(grpc.RpcError) as err:
        node.kubelet.allocate(CORE, [f"qgpu-core-0-{i}" for i in range(10)])
    assert "unhealthy (XID 79)" in err.value.details()
    assert node.store.cards()[1][1] == "XID 79"


def test_a_card_reset_returns_its_devices_without_a_manager_restart(node):
    node.control_write({"unhealthy": {"1": "XID 79"}})
    node.kubelet.wait_for(lambda: node.kubelet.devices(CORE)["qgpu-core-1-0"] == "Unhealthy")
    before = node.kubelet.plugins[CORE].updates
    node.control_write({"unhealthy": {}})  # the card was reset
    node.kubelet.wait_for(lambda: node.kubelet.plugins[CORE].updates > before
                          and all(h == "Healthy" for h in node.kubelet.devices(CORE).values()))
    p = pod("after-reset", "gpu-node-1", [("main", qgpu(10, 1), [(1, node.uuid(1), 100, 1024)])])
    node.set_pods([p])
    assert node.kubelet.admit(p)["main"]["NVIDIA_VISIBLE_DEVICES"] == node.uuid(1)
    assert node.store.cards()[1][1] == ""


def test_plugin_re_registers_after_kubelet_restart(node):
    first = len(node.kubelet.registrations)
    node.kubelet.restart()
    node.kubelet.wait_for(lambda: len(node.kubelet.registrations) >= first + 3
                          and all(p.devices for p in node.kubelet.plugins.values()), timeout=15)
    p = pod("after", "gpu-node-1", [("main", qgpu(10, 1), [(0, node.uuid(0), 100, 1024)])])
    node.set_pods([p])
    assert node.kubelet.admit(p)["main"]["NVIDIA_VISIBLE_DEVICES"] == node.uuid(0)


def test_node_labels_and_annotations_describe_the_cards(node):
    written = json.loads(node.pods_file.with_suffix(".node.json").read_text())["metadata"]
    assert written["labels"] == {"qgpu.io/gpu-count": "2", "qgpu.io/gpu-model": "T4", "qgpu.io/gpu-memory-mib": "16384"}
    cards = json.loads(written["annotations"]["qgpu.io/gpus"])
    assert [c["uuid"] for c in cards] == [node.uuid(0), node.uuid(1)]


def test_concurrent_allocates_serve_every_pending_pod_exactly_once(node):
    from concurrent.futures import ThreadPoolExecutor

    pods = [pod(f"c{i:02d}", "gpu-node-1", [("main", qgpu(5, 1), [(i % 2, node.uuid(i % 2), 50, 1024)])], bind_time=i + 1)
            for i in range(16)]
    node.set_pods(pods)
    batches = [[f"qgpu-core-{i % 2}-{5 * (i // 2) + k}" for k in range(5)] for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        envs = list(pool.map(lambda ids: node.kubelet.allocate(CORE, ids).container_responses[0].envs, batches))
    served = sorted(g.pod for g in node.store.grants())
    assert served == sorted(p["metadata"]["name"] for p in pods)
    assert sorted(e["NVIDIA_VISIBLE_DEVICES"] for e in envs) == sorted([node.uuid(0)] * 8 + [node.uuid(1)] * 8)


def test_restart_releases_pods_deleted_while_the_manager_was_down(node):
    from qgpu_runtime.gpu.simulated import SimulatedBackend
    from qgpu_runtime.node.manager import NodeManager
    from qgpu_runtime.node.pods import FilePodSource

    keep = pod("keep", "gpu-node-1", [("main", qgpu(10, 1), [(0, node.uuid(0), 100, 1024)])], bind_time=1)
    gone = pod("gone", "gpu-node-1", [("main", qgpu(10, 1), [(1, node.uuid(1), 100, 1024)])], bind_time=2)
    node.set_pods([keep, gone])
    node.kubelet.admit(keep)
    node.kubelet.admit(gone)
    node.manager.stop()
    keep["status"]["phase"] = "Running"
    node.set_pods([keep])
    node.kubelet.forget("default", "gone")
    backend = SimulatedBackend(node.manager.backend.cards(), node.control)
    node.manager = NodeManager(node.manager.config, backend, node.store, FilePodSource(node.pods_file))
    node.manager.start()
    assert {g.pod for g in node.store.grants()} == {"keep"}
    assert {s.workload for s in node.store.shares()} == {"keep"}
    quota_dirs = {d.name for d in (node.root / "state" / "containers").iterdir()}
    assert quota_dirs == {keep["metadata"]["uid"]}


def _admit_late_before_early(node) -> None:
    """Two same-size pods; kubelet admits the later-bound one first, so Allocate (which cannot tell
    them apart) serves it the older record: 50 qgpu-core and 4 qgpu-memory devices each, which the
    real kubelet lists in pod-resources as 54 one-ID entries."""
    early = pod("early", "gpu-node-1", [("main", qgpu(50, 4), [(1, node.uuid(1), 500, 4096)])], bind_time=100)
    late = pod("late", "gpu-node-1", [("main", qgpu(50, 4), [(0, node.uuid(0), 500, 4096)])], bind_time=200)
    node.set_pods([early, late])
    assert node.kubelet.admit(late)["main"]["NVIDIA_VISIBLE_DEVICES"] == node.uuid(1)


def test_prestart_detects_the_wrong_owner_of_a_multi_device_grant(node):
    from prometheus_client import generate_latest

    _admit_late_before_early(node)
    text = generate_latest(node.manager.metrics.registry).decode()
    assert 'qgpu_allocation_owner_mismatch_total{resource="tke.cloud.tencent.com/qgpu-core"} 1.0' in text
    assert 'qgpu_allocation_owner_mismatch_total{resource="tke.cloud.tencent.com/qgpu-memory"} 1.0' in text


def test_reconciliation_moves_a_multi_device_grant_to_the_owner_kubelet_lists(node):
    from qgpu_runtime.gpu.simulated import SimulatedBackend
    from qgpu_runtime.node.manager import NodeManager
    from qgpu_runtime.node.pods import FilePodSource

    _admit_late_before_early(node)
    node.manager.stop()
    backend = SimulatedBackend(node.manager.backend.cards(), node.control)
    node.manager = NodeManager(node.manager.config, backend, node.store, FilePodSource(node.pods_file))
    node.manager.start()
    # The store now says what kubelet really did: 'late' holds card 1, for both resources.
    assert {(g.pod, g.resource) for g in node.store.grants()} == {("late", CORE), ("late", MEM)}
    assert {(s.workload, s.card_index) for s in node.store.shares()} == {("late", 1)}


def test_a_pod_deleted_while_the_manager_runs_is_released_without_a_restart(node):
    """Its shares used to stay until the next start: metrics showed a card over 100 %."""
    import dataclasses

    from tests.polling import poll

    keep = pod("keep", "gpu-node-1", [("main", qgpu(10, 1), [(0, node.uuid(0), 100, 1024)])], bind_time=1)
    gone = pod("gone", "gpu-node-1", [("main", qgpu(10, 1), [(1, node.uuid(1), 100, 1024)])], bind_time=2)
    done = pod("done", "gpu-node-1", [("main", qgpu(10, 1), [(1, node.uuid(1), 100, 1024)])], bind_time=3)
    node.set_pods([keep, gone, done])
    for p in (keep, gone, done):
        node.kubelet.admit(p)
    done["status"]["phase"] = "Succeeded"
    node.set_pods([keep, done])
    node.manager.config = dataclasses.replace(node.manager.config, release_interval_s=0.05)
    poll(lambda: {s.workload for s in node.store.shares()} == {"keep"}, timeout=10,
         what="the deleted and the finished pod released by the running manager")
    assert {g.pod for g in node.store.grants()} == {"keep"}
    # the folders go just after the rows, outside the store's transaction: wait for them too
    poll(lambda: {d.name for d in (node.root / "state" / "containers").iterdir()} == {keep["metadata"]["uid"]},
         timeout=10, what="the quota folders of the released pods removed")


# -- the node as the last line of defence against over-commitment (issue 11 §5) -----------------

def test_allocate_refuses_a_record_that_would_put_a_card_over_100_percent_core(node):
    first = pod("first", "gpu-node-1", [("main", qgpu(60, 4), [(0, node.uuid(0), 600, 4096)])], bind_time=1)
    second = pod("second", "gpu-node-1", [("main", qgpu(60, 4), [(0, node.uuid(0), 600, 4096)])], bind_time=2)
    node.set_pods([first, second])
    node.kubelet.admit(first)
    with pytest.raises(grpc.RpcError) as err:
        node.kubelet.admit(second)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "default/second container main: its record would over-commit this node: card 0: core 1200‰ committed > 1000‰" \
        in err.value.details()
    assert {s.workload for s in node.store.shares()} == {"first"}


def test_allocate_refuses_a_record_that_would_put_a_card_over_its_memory(node):
    first = pod("first", "gpu-node-1", [("main", qgpu(10, 10), [(1, node.uuid(1), 100, 10240)])], bind_time=1)
    second = pod("second", "gpu-node-1", [("main", qgpu(10, 10), [(1, node.uuid(1), 100, 10240)])], bind_time=2)
    node.set_pods([first, second])
    node.kubelet.admit(first)
    with pytest.raises(grpc.RpcError) as err:
        node.kubelet.admit(second)
    assert "card 1: memory 20480 MiB committed > 16384 MiB" in err.value.details()
    assert {g.pod for g in node.store.grants()} == {"first"}


def test_shares_of_deleted_and_finished_pods_do_not_count_against_a_new_allocate(node):
    gone = pod("gone", "gpu-node-1", [("main", qgpu(60, 8), [(0, node.uuid(0), 600, 8192)])], bind_time=1)
    done = pod("done", "gpu-node-1", [("main", qgpu(40, 8), [(0, node.uuid(0), 400, 8192)])], bind_time=2)
    node.set_pods([gone, done])
    node.kubelet.admit(gone)
    node.kubelet.admit(done)
    done["status"]["phase"] = "Succeeded"
    new = pod("new", "gpu-node-1", [("main", qgpu(100, 16), [(0, node.uuid(0), 1000, 16384)])], bind_time=3)
    node.set_pods([done, new])  # 'gone' deleted, 'done' finished; their rows are still in the store
    assert {s.workload for s in node.store.shares()} >= {"gone", "done"}
    assert node.kubelet.admit(new)["main"]["NVIDIA_VISIBLE_DEVICES"] == node.uuid(0)


def test_allocate_counts_the_shares_of_prepared_resource_claims(node):
    from qgpu_runtime.node.store import PreparedClaim, Share

    claim = PreparedClaim("claim-uid", "team-a", "train", (), "/nowhere.json", 1)
    node.store.book_claim(claim, [Share("claim-uid", "team-a", "train", "gpu", 0, node.uuid(0), 600, 4096, "normal", 1)],
                          lambda others: None)
    second = pod("second", "gpu-node-1", [("main", qgpu(60, 4), [(0, node.uuid(0), 600, 4096)])], bind_time=2)
    node.set_pods([second])
    with pytest.raises(grpc.RpcError) as err:
        node.kubelet.admit(second)
    assert "card 0: core 1200‰ committed > 1000‰" in err.value.details()


def test_allocate_is_served_while_many_list_and_watch_streams_are_open(node):
    # Issue 21 §5: 8 workers, each ListAndWatch stream pinning one, left Allocate none.
    from streamflood import OPEN, Streams

    from qgpu_runtime import protos
    from qgpu_runtime.node.streams import MAX_STREAMS

    api = protos.deviceplugin()
    target = f"unix://{node.kubelet.dir / node.kubelet.plugins[CORE].endpoint}"
    streams = Streams(target, lambda ch: api.grpc.DevicePluginStub(ch).ListAndWatch(api.pb2.Empty()), 8)
    try:
        fates = streams.settled()
        # kubelet's own stream holds one slot; the crowd gets the rest and is refused past them
        assert fates.count(OPEN) == MAX_STREAMS - 1
        assert fates.count("RESOURCE_EXHAUSTED") == 8 - (MAX_STREAMS - 1)
        p = pod("crowded", "gpu-node-1", [("main", qgpu(30, 5), [(1, node.uuid(1), 300, 5120)])])
        node.set_pods([p])
        assert node.kubelet.admit(p)["main"]["NVIDIA_VISIBLE_DEVICES"] == node.uuid(1)
    finally:
        streams.close()


def test_a_closed_stream_frees_its_slot(node):
    from streamflood import OPEN, Streams

    from qgpu_runtime import protos
    from qgpu_runtime.node.streams import MAX_STREAMS
    from tests.polling import poll

    api = protos.deviceplugin()
    target = f"unix://{node.kubelet.dir / node.kubelet.plugins[CORE].endpoint}"
    start = lambda ch: api.grpc.DevicePluginStub(ch).ListAndWatch(api.pb2.Empty())  # noqa: E731
    first = Streams(target, start, MAX_STREAMS - 1)
    assert first.settled() == [OPEN] * (MAX_STREAMS - 1)
    first.close()  # each server-side stream ends at its next wake-up (at most 0.5 s): its slot then returns

    def all_open() -> Streams | None:
        batch = Streams(target, start, MAX_STREAMS - 1)
        if batch.settled() == [OPEN] * (MAX_STREAMS - 1):
            return batch
        batch.close()  # its open streams hold their slots until their next wake-up too
        return None

    # Between tries, longer than a server-side stream takes to see its client gone (0.5 s): a try
    # that found some slots still taken must not hold them against the next one (on a loaded
    # machine a 0.2 s interval kept every try behind the previous one's streams).
    poll(all_open, timeout=30, interval=1.0, what="the closed streams' slots to return").close()
