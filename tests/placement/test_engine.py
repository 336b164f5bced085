"""Placement engine behaviour: fit rules, policies, co-location, reasons, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from qgpu_runtime.model import AppClass, ContainerRequest, Dialect, PodRequest
from qgpu_runtime.model.requests import CardLimits
from qgpu_runtime.placement import (
    CardSpec,
    ClusterState,
    NodeSpec,
    StateError,
    Unschedulable,
    make_policy,
    place,
    score,
)

GIB = 1024


def node(name, cards=2, model="T4", memory_gib=16, cpu=32000, mem=64 * GIB, labels=None):
    return NodeSpec(name, cpu, mem, tuple(CardSpec(i, f"{name}-uuid-{i}", model, memory_gib * GIB) for i in range(cards)), labels or {})


def share(core_pct, mem_gib=1, klass=AppClass.NORMAL, name="p", models=None, cpu=0):
    return PodRequest("ns", name, klass=klass, containers=(ContainerRequest("c", Dialect.QGPU, 1, core_pct * 10, mem_gib * GIB),),
                      models=models, cpu_milli=cpu)


def whole(cards, name="w", dialect=Dialect.NVIDIA, alloc_mode=None):
    return PodRequest("ns", name, containers=(ContainerRequest("c", dialect, cards, 1000, exclusive=True),), alloc_mode=alloc_mode)


def book(state, req, policy="binpack", key=None):
    placement = place(state, req, make_policy(policy))
    state.commit(key or req.name, placement)
    return placement


def test_binpack_fills_the_fullest_card_first():
    state = ClusterState([node("a"), node("b")])
    first = book(state, share(30, name="p1"))
    second = book(state, share(30, name="p2"))
    assert (second.node, second.containers[0].shares[0].index) == (first.node, first.containers[0].shares[0].index)


def test_spread_uses_the_emptiest_node_and_card():
    state = ClusterState([node("a"), node("b")])
    first = book(state, share(30, name="p1"), "spread")
    second = book(state, share(30, name="p2"), "spread")
    assert first.node != second.node


def test_spread_and_binpack_differ_inside_a_node():
    state = ClusterState([node("a")])
    book(state, share(30, name="p1"), "spread")
    nxt = place(state, share(30, name="p2"), make_policy("spread"))
    packed = place(state, share(30, name="p2"), make_policy("binpack"))
    assert nxt.containers[0].shares[0].index != packed.containers[0].shares[0].index


def test_whole_cards_are_exclusive():
    state = ClusterState([node("a", cards=2)])
    book(state, whole(1))
    with pytest.raises(Unschedulable):
        place(state, whole(2, name="w2"), make_policy("binpack"))
    p = book(state, share(50, name="s"))
    assert p.containers[0].shares[0].index == 1


def test_shared_card_cannot_be_taken_whole():
    state = ClusterState([node("a", cards=1)])
    book(state, share(10))
    with pytest.raises(Unschedulable) as info:
        place(state, whole(1), make_policy("binpack"))
    assert info.value.reasons == {"a": "not enough whole free cards"}


def test_core_and_memory_and_pod_count_limits_hold():
    state = ClusterState([node("a", cards=1, memory_gib=8)])  # 8 GiB card: 2 shared pods
    book(state, share(10, name="p1"))
    book(state, share(10, name="p2"))
    with pytest.raises(Unschedulable, match="no card has enough free core, memory and pod slots"):
        place(state, share(10, name="p3"), make_policy("binpack"))


def test_memory_is_checked_per_card():
    state = ClusterState([node("a", cards=1, memory_gib=16)])
    book(state, share(10, mem_gib=12, name="big"))
    with pytest.raises(Unschedulable):
        place(state, share(10, mem_gib=5, name="p"), make_policy("binpack"))


def test_model_constraint():
    state = ClusterState([node("t4", model="T4"), node("v100", model="V100")])
    p = place(state, share(10, models=frozenset({"V100"})), make_policy("binpack"))
    assert p.node == "v100"
    with pytest.raises(Unschedulable) as info:
        place(state, share(10, models=frozenset({"A100"})), make_policy("binpack"))
    assert set(info.value.reasons.values()) == {"GPU model not allowed for this pod"}


def test_t9k_whole_cards_need_xgn_nodes():
    xgn = {"sched.tensorstack.dev/node-alloc-mode": "xgn"}
    state = ClusterState([node("plain"), node("x", labels=xgn)])
    assert place(state, whole(1, dialect=Dialect.T9K, alloc_mode="xgn"), make_policy("spread")).node == "x"


def test_t9k_percent_takes_a_share_of_the_chosen_cards_memory():
    sgn = {"sched.tensorstack.dev/node-alloc-mode": "sgn"}
    state = ClusterState([node("s", cards=1, memory_gib=16, labels=sgn)])
    req = PodRequest("ns", "t", containers=(ContainerRequest("c", Dialect.T9K, 1, 0, memory_pct=25),), alloc_mode="sgn")
    p = place(state, req, make_policy("binpack"))
    assert p.containers[0].shares[0].memory_mib == 4 * GIB


XGN = {"sched.tensorstack.dev/node-alloc-mode": "xgn"}


def test_whole_node_takes_every_card():
    state = ClusterState([node("a", cards=4, labels=XGN)])
    req = PodRequest("ns", "n", containers=(ContainerRequest("c", Dialect.T9K, 0, 1000, exclusive=True, whole_node=True),))
    p = book(state, req)
    assert [s.index for s in p.containers[0].shares] == [0, 1, 2, 3]
    with pytest.raises(Unschedulable):
        place(state, share(10, name="x"), make_policy("binpack"))


def test_a_whole_node_of_more_cards_than_one_pod_may_take_is_refused_naming_both_counts():
    """Issue F3: a whole-node request is charged the most cards one pod may take (8 by default), so a
    node of 16 cards (the inventory admits up to 16) would have granted twice what was charged."""
    req = PodRequest("ns", "n", containers=(ContainerRequest("c", Dialect.T9K, 0, 1000, exclusive=True, whole_node=True),))
    state = ClusterState([node("hgx", cards=16, labels=XGN), node("dgx", cards=8, labels=XGN)])
    assert place(state, req, make_policy("binpack")).node == "dgx"
    with pytest.raises(Unschedulable) as refused:
        place(ClusterState([node("hgx", cards=16, labels=XGN)]), req, make_policy("binpack"))
    assert refused.value.reasons == {
        "hgx": "the whole node has 16 cards and one pod may take at most 8 (CardLimits.max_cards_per_node)"}
    _, failed = score(state, req, make_policy("spread"), ["hgx", "dgx"])
    assert failed == {"hgx": "the whole node has 16 cards and one pod may take at most 8 (CardLimits.max_cards_per_node)"}
    wider = ClusterState([node("hgx", cards=16, labels=XGN)], CardLimits(max_cards_per_node=16))
    assert len(place(wider, req, make_policy("binpack")).containers[0].shares) == 16


def test_whole_node_lands_only_on_xgn_nodes():
    """T9k's nvidia-gpu-node is an xgn request: a free sgn or unlabelled node never takes it."""
    sgn = {"sched.tensorstack.dev/node-alloc-mode": "sgn"}
    req = PodRequest("ns", "n", containers=(ContainerRequest("c", Dialect.T9K, 0, 1000, exclusive=True, whole_node=True),))
    with pytest.raises(Unschedulable) as refused:
        place(ClusterState([node("s", cards=2, labels=sgn), node("u", cards=2)]), req, make_policy("binpack"))
    assert refused.value.reasons == {"s": "node allocation mode does not match the T9k request",
                                     "u": "node allocation mode does not match the T9k request"}
    state = ClusterState([node("s", cards=2, labels=sgn), node("u", cards=2), node("x", cards=2, labels=XGN)])
    assert place(state, req, make_policy("spread")).node == "x"


def test_multi_card_and_multi_container_pods():
    state = ClusterState([node("a", cards=4)])
    req = PodRequest("ns", "m", containers=(
        ContainerRequest("trainer", Dialect.QGPU, 2, 1000, exclusive=True),
        ContainerRequest("helper", Dialect.QGPU, 1, 300, 2 * GIB),
    ))
    p = book(state, req)
    trainer, helper = p.containers
    assert len(trainer.shares) == 2
    assert helper.shares[0].index not in {s.index for s in trainer.shares}


MIXED = {"mixed-qgpu-enable": "enable"}


def test_online_and_offline_pods_need_mixed_nodes():
    state = ClusterState([node("plain")])
    with pytest.raises(Unschedulable) as info:
        place(state, share(0, klass=AppClass.ONLINE), make_policy("binpack"))
    assert info.value.reasons == {"plain": "online/offline pods need a node labelled mixed-qgpu-enable=enable"}


def test_online_pods_avoid_cards_with_offline_pods_when_they_can():
    state = ClusterState([node("m", cards=2, labels=MIXED)])
    off = book(state, share(80, klass=AppClass.OFFLINE, name="off"))
    on = book(state, share(0, klass=AppClass.ONLINE, name="on"))
    assert on.containers[0].shares[0].index != off.containers[0].shares[0].index


def test_offline_pods_binpack_onto_cards_without_online_pods():
    state = ClusterState([node("m", cards=3, labels=MIXED)])
    online = book(state, share(0, klass=AppClass.ONLINE, name="on"), "spread")
    a = book(state, share(20, klass=AppClass.OFFLINE, name="off1"), "spread")
    b = book(state, share(20, klass=AppClass.OFFLINE, name="off2"), "spread")
    assert a.containers[0].shares[0].index == b.containers[0].shares[0].index
    assert a.containers[0].shares[0].index != online.containers[0].shares[0].index


def test_online_pod_shares_with_offline_when_no_clean_card_exists():
    state = ClusterState([node("m", cards=1, labels=MIXED)])
    book(state, share(50, klass=AppClass.OFFLINE, name="off"))
    on = book(state, share(0, klass=AppClass.ONLINE, name="on"))
    assert on.containers[0].shares[0].index == 0


def test_unschedulable_names_a_reason_per_node():
    state = ClusterState([node("small", cpu=1000), node("busy", cards=1)])
    book(state, whole(1), key="taken")
    with pytest.raises(Unschedulable) as info:
        place(state, share(10, cpu=2000), make_policy("binpack"))
    assert info.value.reasons == {"small": "insufficient CPU", "busy": "no card has enough free core, memory and pod slots"}
    assert str(info.value).startswith("0/2 nodes can take ns/p:")


@pytest.mark.parametrize("policy", ["binpack", "spread", "bestfit", "frag"])
def test_same_input_same_answer(policy):
    def run():
        state = ClusterState([node(f"n{i}", cards=4) for i in range(6)])
        pol = make_policy(policy)
        out = []
        for i, core in enumerate([30, 50, 20, 70, 100, 10, 40]):
            req = share(core, name=f"p{i}") if core < 100 else whole(1, name=f"p{i}")
            pol.observe(req)
            p = place(state, req, pol)
            state.commit(req.name, p)
            out.append(p)
        return out
    assert run() == run()


def test_score_is_0_to_10_with_reasons_for_failures_and_unknown_nodes():
    state = ClusterState([node("a"), node("b"), node("tiny", cpu=100)])
    book(state, share(60, name="x"), key="x")
    scores, failed = score(state, share(30, cpu=500), make_policy("binpack"), ["a", "b", "tiny", "ghost"])
    assert set(scores) == {"a", "b"}
    assert all(0 <= v <= 10 for v in scores.values())
    assert scores["a"] > scores["b"]  # binpack prefers the node already in use
    assert failed == {"tiny": "insufficient CPU", "ghost": "node unknown to qgpu (no GPU inventory reported yet)"}


def test_commit_is_idempotent_and_refuses_conflicts():
    state = ClusterState([node("a", cards=1)])
    p = place(state, share(60), make_policy("binpack"))
    state.commit("k", p)
    state.commit("k", p)
    assert state.core_free[0, 0] == 400
    with pytest.raises(StateError, match="k: already booked on a; release it first"):
        state.commit("k", place(state, share(10), make_policy("binpack")))
    with pytest.raises(StateError, match="lacks capacity"):
        state.commit("other", p)  # 60% more does not fit any more


def test_release_restores_capacity_and_unknown_release_is_a_noop():
    state = ClusterState([node("a", cards=2)])
    before = (state.core_free.copy(), state.mem_free_card.copy(), state.pods.copy())
    book(state, share(30, name="x"))
    assert state.release("x") is not None
    assert state.release("x") is None
    assert all(np.array_equal(a, b) for a, b in zip(before, (state.core_free, state.mem_free_card, state.pods)))


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"policy 'best' is unknown; choose one of bestfit, binpack, frag, spread"):
        make_policy("best")


def test_duplicate_node_names_are_refused():
    with pytest.raises(StateError, match="node names must be unique, repeated: a"):
        ClusterState([node("a"), node("a")])


def test_score_on_a_cluster_without_nodes_fails_every_name_as_unknown():
    state = ClusterState([])
    scores, failed = score(state, share(30), make_policy("binpack"), ["a", "b"])
    assert scores == {} and failed == {n: "node unknown to qgpu (no GPU inventory reported yet)" for n in "ab"}
