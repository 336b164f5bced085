"""kill -9 of the extender in the middle of a burst of 500 pods, then a restart.

Afterwards every pod is bound exactly once with a record naming its node, or pending with a
FailedScheduling reason; no unbound pod keeps a record; and no card is over-committed, checked from
the records alone. Capacity is exact (480 shared slots for 480 feasible pods), so one leaked
booking would leave a feasible pod pending and fail the test.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.k8s.kubeobjects import card_usage, cards, events_for, gpu_node, gpu_pod, list_pods, record, wait_for

NODES, CARDS_PER_NODE, PODS_PER_CARD = 40, 4, 3
FEASIBLE = NODES * CARDS_PER_NODE * PODS_PER_CARD  # 480
IMPOSSIBLE = 20


@pytest.mark.slow
def test_kill_9_mid_burst_then_restart_leaves_no_double_binding_and_no_over_commit(cluster, ns, label):
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: gpu_node(cluster.api, f"{ns}-{i:02d}", cards(CARDS_PER_NODE, node=f"{ns}-{i:02d}"), label), range(NODES)))
    pods = [gpu_pod(f"p{i:03d}", {"tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 4}, selector=label)
            for i in range(FEASIBLE)]
    pods += [gpu_pod(f"x{i:02d}", {"tke.cloud.tencent.com/qgpu-core": 800}, selector=label) for i in range(IMPOSSIBLE)]
    with ThreadPoolExecutor(8) as pool:
        creating = pool.map(lambda p: cluster.api.create_namespaced_pod(ns, p, _preload_content=False), pods)

        def some_bound() -> int:
            n = sum(1 for p in list_pods(cluster.api, ns) if p["spec"].get("nodeName"))
            return n if n >= 60 else 0

        at_kill = wait_for("the burst to be under way", some_bound, timeout=120, interval=0.05)
        cluster.extender.kill9()
        assert at_kill < FEASIBLE, "the burst finished before the kill; the test proves nothing"
        list(creating)
    time.sleep(1.0)
    cluster.restart_extender(assume_timeout=5.0)

    def settled() -> list[dict] | None:
        items = list_pods(cluster.api, ns)
        bound = [p for p in items if p["spec"].get("nodeName")]
        stale = [p for p in items if not p["spec"].get("nodeName") and record(p) is not None]
        return items if len(bound) == FEASIBLE and not stale else None

    items = wait_for(f"{FEASIBLE} pods bound and no stale record", settled, timeout=240, interval=1.0)
    for pod in items:
        rec = record(pod)
        if pod["metadata"]["name"].startswith("p"):
            assert rec is not None and rec.node == pod["spec"]["nodeName"], pod["metadata"]["name"]
        else:
            assert not pod["spec"].get("nodeName") and rec is None
    for name in (p["metadata"]["name"] for p in items if p["metadata"]["name"].startswith("x")):
        events = wait_for(f"FailedScheduling of {name}", lambda: [e for e in events_for(cluster.api, ns, name)
                                                                  if e.get("reason") == "FailedScheduling"], timeout=60)
        assert "whole free cards" in events[-1]["message"] or "nodes are available" in events[-1]["message"]
    usage = card_usage(items)
    assert len(usage) == NODES * CARDS_PER_NODE
    for (node, index), u in usage.items():
        assert u["core_milli"] <= 1000 and u["memory_mib"] <= 32768 and u["containers"] <= 8, (node, index, u)
