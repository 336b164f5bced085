"""bench/packing_breakdown.py: where the free GPU sits at arrived 100 %, and which pods failed."""

from __future__ import annotations

import pytest

from bench.packing_breakdown import Breakdown, free_gpu_breakdown
from qgpu_runtime.placement.state import CardShare, CardSpec, ClusterState, ContainerPlacement, NodeSpec, Placement
from qgpu_runtime.sim.replay import ReplayOptions, replay_arrivals
from qgpu_runtime.sim.trace import TracePod


def _node(name: str, cards: int, cpu_cores: int, memory_gib: int) -> NodeSpec:
    return NodeSpec(name, cpu_cores * 1000, memory_gib * 1024,
                    tuple(CardSpec(i, f"{name}-gpu{i}", "V100", 32768) for i in range(cards)))


def _share(node: str, index: int, core: int, cpu_milli: int, memory_mib: int) -> Placement:
    return Placement(node, (ContainerPlacement("main", (CardShare(index, f"{node}-gpu{index}", core, 0),)),),
                     cpu_milli=cpu_milli, memory_mib=memory_mib)


def _pod(name: str, num_gpu: int, gpu_milli: int, cpu_milli: int, memory_mib: int = 1024) -> TracePod:
    return TracePod(name, cpu_milli, memory_mib, num_gpu, gpu_milli, None, None, None)


def test_the_free_gpu_is_split_by_card_and_by_what_the_node_has_left():
    state = ClusterState([_node("a", 4, 32, 64), _node("b", 1, 4, 64), _node("c", 2, 64, 8)], enforce_pod_limit=False)
    state.commit("p1", _share("a", 0, 810, 4000, 1024))  # leaves the remainder, 190
    state.commit("p2", _share("a", 1, 950, 4000, 1024))  # 50 free
    state.commit("p3", _share("a", 2, 700, 4000, 1024))  # 300 free; card 3 stays whole
    state.commit("p4", _share("b", 0, 400, 4000, 1024))  # 600 free on a node with no CPU left
    state.commit("p5", _share("c", 0, 810, 1000, 7 * 1024))  # 190 free, and 1 GiB of memory left
    parts = free_gpu_breakdown(state, 190, (2000, 2048), (0.0, 0.0))
    assert parts == {"whole_cards": 2000, "remainder": 380, "partial_1_99": 50, "partial_100_499": 300,
                     "partial_500_999": 600, "cpu_short": 600, "memory_short": 190 + 1000,
                     "beyond_cpu": 0, "beyond_memory": 0, "total": 3330}
    # the buckets by card cover the whole; the ones by node overlap them
    assert sum(parts[k] for k in ("whole_cards", "remainder", "partial_1_99", "partial_100_499", "partial_500_999")) == parts["total"]
    # at 10 milli-CPU per thousandth of a card, only node b's 600 lack CPU (a's 20 cores feed 2000,
    # c's 63 feed 6300); at 1 MiB per thousandth, c's 1 GiB feeds 1024 of its 1190
    ratio = free_gpu_breakdown(state, None, (0, 0), (10.0, 1.0))
    assert (ratio["beyond_cpu"], ratio["beyond_memory"]) == (600, 1190 - 1024)
    assert ratio["remainder"] == 0 and ratio["partial_100_499"] == 300 + 190 + 190


def test_an_exclusively_held_card_is_not_free():
    state = ClusterState([_node("a", 2, 32, 64)], enforce_pod_limit=False)
    state.commit("x", Placement("a", (ContainerPlacement("main", (CardShare(0, "a-gpu0", 1000, 0),), exclusive=True),),
                                cpu_milli=1000, memory_mib=1024))
    assert free_gpu_breakdown(state, None, (0, 0), (0.0, 0.0))["total"] == 1000


def test_the_observer_counts_failures_until_the_moment_and_splits_what_was_free_then():
    state = ClusterState([_node("a", 2, 16, 64)], enforce_pod_limit=False)
    observer = Breakdown()
    observer(_pod("big", 4, 1000, 8000), None, 20.0, state)
    state.commit("s1", _share("a", 0, 810, 3000, 1024))
    observer(_pod("s1", 1, 810, 3000), 810, 60.0, state)
    observer(_pod("big2", 4, 1000, 8000), None, 90.0, state)
    observer(_pod("s2", 1, 500, 1500), None, 95.0, state)
    assert observer.snapshot is None
    state.commit("w", _share("a", 1, 600, 2000, 1024))
    observer(_pod("w", 1, 600, 2000), 600, 100.5, state)  # the moment: 190 + 400 free
    observer(_pod("late", 4, 1000, 8000), None, 130.0, state)  # after it: not counted
    report = observer.report(2000)
    # sizes seen once each: the first counted wins the tie
    assert report["arrived_pct"] == 100.5 and (report["common_sharing_size"], report["remainder"]) == (810, 190)
    assert report["cpu_floor_milli"] == 1500 and report["memory_floor_mib"] == 1024
    assert report["free_pct"]["total"] == pytest.approx(100 * 590 / 2000)
    assert (report["free_pct"]["remainder"], report["free_pct"]["partial_100_499"]) == (9.5, 20.0)
    assert report["failed"] == [
        {"cards": 4, "milli_per_card": 1000, "cpu_cores": 8, "pods": 2, "gpu_pct": 400.0, "first_at_arrived_pct": 20.0},
        {"cards": 1, "milli_per_card": 500, "cpu_cores": 1, "pods": 1, "gpu_pct": 25.0, "first_at_arrived_pct": 95.0}]
    assert report["failed_gpu_pct"] == 425.0
    # the CPU per GPU of every pod up to the moment: 22.5 cores for 9.91 cards
    assert report["cpu_milli_per_gpu_milli"] == pytest.approx(22500 / 9910, abs=1e-3)


def test_on_a_replay_what_is_free_at_the_moment_is_what_failed_by_then():
    nodes = [_node("a", 2, 16, 64), _node("b", 2, 16, 64)]
    pods = [_pod("s1", 1, 810, 2000), _pod("s2", 1, 810, 2000), _pod("w4", 4, 1000, 4000),
            _pod("w1", 1, 1000, 2000), _pod("w2", 1, 1000, 2000), _pod("h", 1, 500, 2000), _pod("cpu", 0, 0, 1000)]
    observer = Breakdown()
    result = replay_arrivals(nodes, pods, "binpack", 7, ReplayOptions(extend_to_pct=101), observer=observer)
    report = observer.report(result.capacity_milli)
    # arrived = allocated + failed, so free = capacity - allocated = failed - (arrived - capacity)
    assert report["arrived_pct"] >= 100
    assert report["free_pct"]["total"] == pytest.approx(report["failed_gpu_pct"] - (report["arrived_pct"] - 100), abs=2e-3)
    assert report["failed_gpu_pct"] == pytest.approx(sum(f["gpu_pct"] for f in report["failed"]), abs=2e-3)


def test_the_same_run_with_and_without_the_observer_gives_the_same_figures():
    nodes = [_node(f"n{i}", 4, 32, 128) for i in range(3)]
    pods = [_pod(f"p{i}", 1 if i % 3 else 2, (250, 500, 1000)[i % 3], 2000 + 500 * (i % 4)) for i in range(40)]
    plain = replay_arrivals(nodes, pods, "frag", 3, ReplayOptions(extend_to_pct=120))
    seen: list[float] = []
    observed = replay_arrivals(nodes, pods, "frag", 3, ReplayOptions(extend_to_pct=120),
                               observer=lambda pod, granted, arrived, state: seen.append(arrived))
    assert plain.failed_pods == observed.failed_pods and plain.unallocated_at(100) == observed.unallocated_at(100)
    assert len(seen) == observed.pods and seen == sorted(seen)


def test_a_replay_that_never_reaches_the_moment_says_so():
    with pytest.raises(ValueError, match="never reached arrived 100"):
        Breakdown().report(1000)
