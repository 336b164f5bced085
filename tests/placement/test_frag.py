"""The frag policy's own behaviour: what it learns from arrivals and how that steers placement."""

from __future__ import annotations

import numpy as np
import pytest

from qgpu_runtime.model import ContainerRequest, Dialect, PodRequest
from qgpu_runtime.placement import CardSpec, ClusterState, NodeSpec, place
from qgpu_runtime.placement.policies import FragPolicy, WorkloadShapes

GIB = 1024


def node(name, cards=2, cpu=32000):
    return NodeSpec(name, cpu, 256 * GIB, tuple(CardSpec(i, f"{name}-{i}", "T4", 16 * GIB) for i in range(cards)))


def shared(core_milli, cpu, name="s"):
    return PodRequest("ns", name, containers=(ContainerRequest("c", Dialect.QGPU, 1, core_milli, GIB),), cpu_milli=cpu)


def whole(cards, cpu, name="w"):
    return PodRequest("ns", name, containers=(ContainerRequest("c", Dialect.NVIDIA, cards, 1000, exclusive=True),), cpu_milli=cpu)


def cpu_only(cpu, name="c"):
    return PodRequest("ns", name, cpu_milli=cpu)


def test_cpu_per_gpu_counts_the_cpu_of_cpu_only_pods_too():
    shapes = WorkloadShapes()
    for req in (shared(500, 6000), whole(2, 10000), cpu_only(32000)):
        shapes.observe(req)
    assert shapes.cpu_per_gpu() == pytest.approx(48000 / 2500)


def test_stranded_gpu_is_what_the_free_cpu_cannot_feed():
    policy = FragPolicy()
    policy.observe(whole(1, 4000))  # 4 cores per card
    stranded = policy.stranded(np.array([2000, 2000, 500]), np.array([8000, 4000, 0]))
    assert stranded.tolist() == [0.0, 1000.0, 500.0]


def test_cpu_only_pod_goes_where_it_strands_no_gpu():
    # Packing alone would pick the CPU-poor node (less left after), but its two free cards need
    # 12 cores at the learned 6 cores per card (4 + 2 per card of GPU asked) and only 7 would be
    # left there, against 9 before.
    state = ClusterState([node("poor", cpu=9000), node("rich", cpu=64000)])
    policy = FragPolicy()
    policy.observe(whole(1, 4000))
    req = cpu_only(2000)
    policy.observe(req)
    assert place(state, req, policy).node == "rich"
    assert place(state, req, FragPolicy(policy.shapes, cpu_balance=0.0)).node == "poor"


def test_whole_cards_are_packed_onto_a_used_node_before_an_empty_one():
    state = ClusterState([node("a", cards=4, cpu=64000), node("b", cards=4, cpu=64000)])
    policy = FragPolicy()
    first = whole(1, 4000, "w1")
    policy.observe(first)
    state.commit("w1", place(state, first, policy))
    second = whole(1, 4000, "w2")
    policy.observe(second)
    assert place(state, second, policy).node == state.bookings["w1"].node


def test_a_rare_multi_card_shape_still_keeps_its_only_node_whole():
    # One 8-card pod in a hundred falls outside the common shapes, but the policy plans with every
    # shape: the next single card goes to the 9-card node, which can still host eight afterwards.
    state = ClusterState([node("eight", cards=8, cpu=80000), node("nine", cards=9, cpu=80000)])
    policy = FragPolicy()
    common = FragPolicy(WorkloadShapes())
    for i in range(99):
        policy.observe(whole(1, 4000, f"w{i}"))
        common.observe(whole(1, 4000, f"w{i}"))
    policy.observe(whole(8, 64000, "big"))
    common.observe(whole(8, 64000, "big"))
    assert place(state, whole(1, 4000), policy).node == "nine"
    assert place(state, whole(1, 4000), common).node == "eight"


def model_node(name, model, cards=2, cpu=32000):
    return NodeSpec(name, cpu, 256 * GIB, tuple(CardSpec(i, f"{name}-{i}", model, 16 * GIB) for i in range(cards)))


def test_a_pod_that_takes_any_model_leaves_the_model_others_are_bound_to():
    # Most pods seen so far can only run on T4 cards; a pod that can run anywhere should take the
    # V100 node's card, not the T4 capacity those pods depend on.
    state = ClusterState([model_node("t4", "T4"), model_node("v100", "V100M16")])
    policy = FragPolicy()
    for i in range(9):
        bound = shared(600, 4000, f"t{i}")
        policy.observe(PodRequest("ns", f"t{i}", containers=bound.containers, cpu_milli=4000, models=frozenset({"T4"})))
    free = whole(1, 4000, "free")
    policy.observe(free)
    assert place(state, free, policy).node == "v100"


def test_a_node_without_the_model_a_shape_needs_is_all_fragment_for_it():
    state = ClusterState([model_node("t4", "T4"), model_node("v100", "V100M16")])
    policy = FragPolicy(model_pressure=False)  # the plain expected fragment
    policy.observe(PodRequest("ns", "t", containers=shared(500, 1000).containers, cpu_milli=1000, models=frozenset({"T4"})))
    rows = np.arange(2)
    frag = policy.frag_of(state.core_free, np.array([2, 2]), state.cpu_free, state.mem_free, state, rows)
    assert frag.tolist() == [0.0, 2000.0]
    # Without the nodes' models every shape may use every node (what the measure was before).
    assert policy.frag_of(state.core_free, np.array([2, 2]), state.cpu_free, state.mem_free).tolist() == [0.0, 0.0]


def test_a_pod_that_may_go_anywhere_spares_the_scarcer_model():
    # One pod in ten needs T4 and one in ten G2, but the cluster has 2 T4 cards against 6 G2: the
    # T4 pods' demand presses on a third as many cards. The plain expected fragment sees both nodes
    # alike (each is usable by nine shapes in ten) and packs onto the smaller one; weighing each
    # shape by the pressure on the cards it may use keeps the T4 cards for the pods that need them.
    state = ClusterState([model_node("t4", "T4", cards=2), model_node("g2", "G2", cards=6)])
    policies = FragPolicy(), FragPolicy(model_pressure=False)
    for policy in policies:
        policy.observe(PodRequest("ns", "t", containers=whole(1, 4000).containers, cpu_milli=4000, models=frozenset({"T4"})))
        policy.observe(PodRequest("ns", "g", containers=whole(1, 4000).containers, cpu_milli=4000, models=frozenset({"G2"})))
        for i in range(8):
            policy.observe(whole(1, 4000, f"w{i}"))
    pressure, plain = policies
    assert place(state, whole(1, 4000), pressure).node == "g2"
    assert place(state, whole(1, 4000), plain).node == "t4"
