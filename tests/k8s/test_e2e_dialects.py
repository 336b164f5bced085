"""Every request dialect, placed by the real kube-scheduler through the extender onto fake nodes,
lands on the right node with the right cards and shares in its record."""

from __future__ import annotations

import pytest

from tests.k8s.kubeobjects import (
    MANAGED_RESOURCES,
    bound,
    cards,
    events_for,
    gpu_node,
    gpu_pod,
    list_pods,
    read_pod,
    record,
    scheduling_failure,
    wait_for,
)

MIXED = {"mixed-qgpu-enable": "enable"}
XGN = {"sched.tensorstack.dev/node-alloc-mode": "xgn"}
SGN = {"sched.tensorstack.dev/node-alloc-mode": "sgn"}


def shares(pod):
    rec = record(pod)
    assert rec is not None, pod["metadata"]
    return rec, [(s.index, s.core_milli, s.memory_mib) for c in rec.containers for s in c.shares]


@pytest.mark.parametrize("limits, expected", [
    ({"tke.cloud.tencent.com/qgpu-core": 25, "tke.cloud.tencent.com/qgpu-memory": 3}, [(250, 3072)]),
    ({"tke.cloud.tencent.com/qgpu-core": 200}, [(1000, 32768), (1000, 32768)]),
    ({"tencent.com/vcuda-core": 50, "tencent.com/vcuda-memory": 8}, [(500, 2048)]),
    ({"tencent.com/vcuda-core": 100}, [(1000, 32768)]),
    ({"nvidia.com/gpu": 2}, [(1000, 32768), (1000, 32768)]),
])
def test_qgpu_vcuda_and_nvidia_dialects(cluster, ns, label, limits, expected):
    gpu_node(cluster.api, f"{ns}-n", cards(4, node=f"{ns}-n"), label)
    cluster.api.create_namespaced_pod(ns, gpu_pod("p", limits, selector=label))
    rec, got = shares(bound(cluster.api, ns, "p"))
    assert rec.node == f"{ns}-n"
    assert [(core, mem) for _, core, mem in got] == expected
    assert len({index for index, _, _ in got}) == len(got)


def test_t9k_whole_cards_go_to_xgn_nodes_and_percent_to_sgn_nodes(cluster, ns, label):
    gpu_node(cluster.api, f"{ns}-x", cards(2, node=f"{ns}-x"), {**label, **XGN})
    gpu_node(cluster.api, f"{ns}-s", cards(2, node=f"{ns}-s"), {**label, **SGN})
    cluster.api.create_namespaced_pod(ns, gpu_pod("whole", {"tensorstack.dev/nvidia-gpu": 1}, selector=label))
    cluster.api.create_namespaced_pod(ns, gpu_pod("pct", {"tensorstack.dev/nvidia-gpu-percent": 25}, selector=label))
    whole, got_whole = shares(bound(cluster.api, ns, "whole"))
    pct, got_pct = shares(bound(cluster.api, ns, "pct"))
    assert whole.node == f"{ns}-x" and [c for _, c, _ in got_whole] == [1000]
    assert pct.node == f"{ns}-s" and [m for _, _, m in got_pct] == [32768 // 4]


def test_t9k_whole_node_takes_every_card_of_a_free_xgn_node_and_admits_no_other_gpu_pod(cluster, ns, label):
    """nvidia-gpu-node: only an xgn node (T9k's node-exclusive mode), and every card of it. Free sgn
    and unlabelled nodes are passed over; while it runs, no other GPU pod is admitted there."""
    gpu_node(cluster.api, f"{ns}-busy", cards(2, node=f"{ns}-busy"), {**label, **XGN})
    gpu_node(cluster.api, f"{ns}-free", cards(3, node=f"{ns}-free"), {**label, **XGN})
    gpu_node(cluster.api, f"{ns}-sgn", cards(4, node=f"{ns}-sgn"), {**label, **SGN})
    gpu_node(cluster.api, f"{ns}-plain", cards(4, node=f"{ns}-plain"), label)
    cluster.api.create_namespaced_pod(ns, gpu_pod("first", {"tke.cloud.tencent.com/qgpu-core": 10, "tke.cloud.tencent.com/qgpu-memory": 1},
                                                  selector={**label, "kubernetes.io/hostname": f"{ns}-busy"}))
    bound(cluster.api, ns, "first")
    cluster.api.create_namespaced_pod(ns, gpu_pod("node", {"tensorstack.dev/nvidia-gpu-node": 1}, selector=label))
    rec, got = shares(bound(cluster.api, ns, "node"))
    assert rec.node == f"{ns}-free" and sorted(i for i, _, _ in got) == [0, 1, 2]
    assert [(core, mem) for _, core, mem in got] == [(1000, 32768)] * 3
    cluster.api.create_namespaced_pod(ns, gpu_pod("after", {"tensorstack.dev/nvidia-gpu": 1},
                                                  selector={**label, "kubernetes.io/hostname": f"{ns}-free"}))
    wait_for("the pod asking a card of the taken node refused", lambda: any(
        "the whole node is not free" in e["message"] or "not enough whole free cards" in e["message"]
        for e in events_for(cluster.api, ns, "after")) or None)
    assert not read_pod(cluster.api, ns, "after")["spec"].get("nodeName")


def test_multi_container_pod_gets_a_record_per_container(cluster, ns, label):
    gpu_node(cluster.api, f"{ns}-n", cards(2, node=f"{ns}-n"), label)
    cluster.api.create_namespaced_pod(ns, gpu_pod("two", {"tke.cloud.tencent.com/qgpu-core": 40, "tke.cloud.tencent.com/qgpu-memory": 4},
                                                  selector=label, containers=2))
    rec = record(bound(cluster.api, ns, "two"))
    assert [c.name for c in rec.containers] == ["c0", "c1"]


def test_online_and_offline_pods_only_go_to_mixed_nodes(cluster, ns, label):
    gpu_node(cluster.api, f"{ns}-plain", cards(1, node=f"{ns}-plain"), label)
    gpu_node(cluster.api, f"{ns}-mixed", cards(1, node=f"{ns}-mixed"), {**label, **MIXED})
    online = gpu_pod("online", {"tke.cloud.tencent.com/qgpu-memory": 8}, selector=label,
                     annotations={"tke.cloud.tencent.com/app-class": "online"})
    offline = gpu_pod("offline", {"tke.cloud.tencent.com/qgpu-core-greedy": 60, "tke.cloud.tencent.com/qgpu-memory": 8},
                      selector=label, annotations={"tke.cloud.tencent.com/app-class": "offline"})
    cluster.api.create_namespaced_pod(ns, online)
    cluster.api.create_namespaced_pod(ns, offline)
    on, on_shares = shares(bound(cluster.api, ns, "online"))
    off, off_shares = shares(bound(cluster.api, ns, "offline"))
    assert on.node == off.node == f"{ns}-mixed"
    assert on.klass.value == "online" and on_shares == [(0, 0, 8192)]
    assert off.klass.value == "offline" and off_shares[0][1] == 600


def test_online_pod_without_a_mixed_node_is_pending_with_the_reason(cluster, ns, label):
    gpu_node(cluster.api, f"{ns}-plain", cards(1, node=f"{ns}-plain"), label)
    cluster.api.create_namespaced_pod(ns, gpu_pod("online", {"tke.cloud.tencent.com/qgpu-memory": 8}, selector=label,
                                                  annotations={"tke.cloud.tencent.com/app-class": "online"}))
    scheduling_failure(cluster.api, ns, "online", "mixed-qgpu-enable")
    assert not read_pod(cluster.api, ns, "online")["spec"].get("nodeName")


def test_spread_and_binpack_place_the_same_pods_differently(cluster, ns, label):
    placed = {}
    try:
        for policy in ("binpack", "spread"):
            cluster.restart_extender(priority=policy)
            for node in ("a", "b"):
                gpu_node(cluster.api, f"{ns}-{policy}-{node}", cards(2, node=f"{ns}-{policy}-{node}"), {**label, "pol": policy})
            for i in range(2):
                cluster.api.create_namespaced_pod(ns, gpu_pod(f"{policy}-{i}", {"tke.cloud.tencent.com/qgpu-core": 20, "tke.cloud.tencent.com/qgpu-memory": 2},
                                                              selector={**label, "pol": policy}))
                bound(cluster.api, ns, f"{policy}-{i}")
            placed[policy] = {(record(p).node, s.index) for p in list_pods(cluster.api, ns) if p["metadata"]["name"].startswith(policy)
                              for c in record(p).containers for s in c.shares}
    finally:
        cluster.restart_extender(priority="binpack")
    assert len(placed["binpack"]) == 1, placed  # both on one card of one node
    assert len({node for node, _ in placed["spread"]}) == 2, placed  # one per node


def test_extender_works_when_the_scheduler_sends_full_node_objects(cluster, ns, label):
    cluster.cp.start_scheduler(cluster.scheduler_extenders(node_cache_capable=False))
    try:
        gpu_node(cluster.api, f"{ns}-n", cards(1, node=f"{ns}-n"), label)
        cluster.api.create_namespaced_pod(ns, gpu_pod("p", {"nvidia.com/gpu": 1}, selector=label))
        assert record(bound(cluster.api, ns, "p")).node == f"{ns}-n"
    finally:
        cluster.cp.start_scheduler(cluster.scheduler_extenders())


def test_best_only_filter_without_prioritize_binds_where_the_engine_chose(cluster, ns, label):
    try:
        cluster.restart_extender(filter_result="best")
        cluster.cp.start_scheduler([cluster.extender.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s",
                                                                      prioritize=False)])
        for node in ("a", "b"):
            gpu_node(cluster.api, f"{ns}-{node}", cards(2, node=f"{ns}-{node}"), label)
        for i in range(3):
            cluster.api.create_namespaced_pod(ns, gpu_pod(f"p{i}", {"tke.cloud.tencent.com/qgpu-core": 20, "tke.cloud.tencent.com/qgpu-memory": 2},
                                                          selector=label))
            bound(cluster.api, ns, f"p{i}")
        cards_used = {(record(p).node, s.index) for p in list_pods(cluster.api, ns) for c in record(p).containers for s in c.shares}
        assert len(cards_used) == 1, cards_used  # binpack: one card of one node, chosen by the engine alone
    finally:
        cluster.restart_extender()
        cluster.cp.start_scheduler(cluster.scheduler_extenders())
