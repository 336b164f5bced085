"""The real-node benchmark's stage split (issue 23 §3): which stage a pod shows, how a pod's time is
cut into stages when the watch shows several at once or a later one first, and the arms' order."""

from __future__ import annotations

import pytest

from bench.realnode_bench import STAGES, arm_order, split, stages_seen, summarize


def pod(node: str = "", start: str = "", sandbox: str = "", running: bool = False, phase: str = "Pending") -> dict:
    status: dict = {"phase": phase, "conditions": []}
    if start:
        status["startTime"] = start
    if sandbox:
        status["conditions"].append({"type": "PodReadyToStartContainers", "status": sandbox})
    status["containerStatuses"] = [{"name": "main", "state": {"running": {"startedAt": "t"}} if running else {"waiting": {}}}]
    return {"spec": {"nodeName": node} if node else {}, "status": status}


@pytest.mark.parametrize("p, expected", [
    (pod(), set()),
    (pod(node="n"), {"scheduled"}),
    (pod(node="n", start="t"), {"scheduled", "admitted"}),
    (pod(node="n", start="t", sandbox="False"), {"scheduled", "admitted"}),
    (pod(node="n", start="t", sandbox="True"), {"scheduled", "admitted", "sandbox"}),
    (pod(node="n", start="t", sandbox="True", running=True), {"scheduled", "admitted", "sandbox", "started"}),
    (pod(node="n", start="t", sandbox="True", running=True, phase="Running"), set(STAGES)),
])
def test_each_stage_is_read_from_the_pod(p, expected):
    assert stages_seen(p) == expected


def test_stages_add_up_to_the_total_and_each_counts_from_the_one_before():
    seen = {"scheduled": 10.5, "admitted": 11.0, "sandbox": 13.0, "started": 14.0, "running": 14.25}
    cut = split(10.0, seen)
    assert cut == {"scheduled": 0.5, "admitted": 0.5, "sandbox": 2.0, "started": 1.0, "running": 0.25}
    assert sum(cut.values()) == pytest.approx(seen["running"] - 10.0)


def test_stages_shown_together_or_out_of_order_take_no_time_of_their_own():
    # admitted and sandbox arrived in one event with started; scheduled was only seen after it
    seen = {"started": 12.0, "admitted": 12.0, "scheduled": 13.0, "running": 13.5}
    cut = split(10.0, seen)
    assert cut == {"scheduled": 2.0, "admitted": 0.0, "sandbox": 0.0, "started": 0.0, "running": 1.5}
    assert sum(cut.values()) == pytest.approx(3.5)


def test_arms_alternate_and_swap_every_round():
    assert [arm_order(r, ("plain", "gpu")) for r in range(3)] == [("plain", "gpu"), ("gpu", "plain"), ("plain", "gpu")]


def test_the_summary_has_every_stage_and_the_total():
    rows = [{"total": float(i), **{s: i / 5 for s in STAGES}} for i in range(1, 101)]
    out = summarize(rows)
    assert out["pods"] == 100 and out["total"] == {"p50_s": 50.0, "p99_s": 99.0}
    assert set(out) == {"pods", "total", *STAGES}


KUBELET_PAGE = """# HELP kubelet_device_plugin_alloc_duration_seconds [ALPHA] Duration in seconds to serve a device plugin Allocation request.
# TYPE kubelet_device_plugin_alloc_duration_seconds histogram
kubelet_device_plugin_alloc_duration_seconds_bucket{resource_name="tke.cloud.tencent.com/qgpu-core",le="0.005"} 3
kubelet_device_plugin_alloc_duration_seconds_bucket{resource_name="tke.cloud.tencent.com/qgpu-core",le="+Inf"} 4
kubelet_device_plugin_alloc_duration_seconds_sum{resource_name="tke.cloud.tencent.com/qgpu-core"} 0.04
kubelet_device_plugin_alloc_duration_seconds_count{resource_name="tke.cloud.tencent.com/qgpu-core"} 4
# HELP kubelet_running_pods [ALPHA] Number of pods that have a running pod sandbox
# TYPE kubelet_running_pods gauge
kubelet_running_pods 7
"""


def test_admission_histograms_are_read_by_series_and_differenced_per_round():
    from prometheus_client.parser import text_string_to_metric_families

    from bench.realnode_bench import admission_delta, histogram_totals

    before = histogram_totals(s for family in text_string_to_metric_families(KUBELET_PAGE) for s in family.samples)
    key = "kubelet_device_plugin_alloc_duration_seconds{resource_name=tke.cloud.tencent.com/qgpu-core}"
    assert before == {key: (0.04, 4.0)}  # other families (a gauge) are not read
    after = {key: (0.24, 14.0)}
    assert admission_delta(before, after) == {key: {"calls": 10.0, "mean_ms": 20.0, "total_ms": 200.0}}
    assert admission_delta(after, after) == {}  # no call in the round: nothing reported
