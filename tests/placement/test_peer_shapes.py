"""Issue 22 §3 in the engine: a share on each of N distinct cards (HAMi's vGPUs, KAI's
gpu-fraction-num-devices), and HAMi's model patterns."""

from __future__ import annotations

import pytest

from qgpu_runtime.model import ContainerRequest, Dialect, PodRequest
from qgpu_runtime.model.requests import ModelPatterns
from qgpu_runtime.placement import ClusterState, Unschedulable, make_policy, place
from tests.placement.test_engine import GIB, book, node, share


def vgpus(cards, core_pct, mem_mib, name="h", patterns=None, **kw):
    return PodRequest("ns", name, containers=(ContainerRequest("c", Dialect.HAMI, cards, core_pct * 10, mem_mib, **kw),),
                      model_patterns=patterns)


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_n_shares_land_on_n_distinct_cards_of_one_node(policy):
    state = ClusterState([node("a", cards=3), node("b", cards=1)])
    placement = book(state, vgpus(2, 30, 3000), policy)
    (c,) = placement.containers
    assert placement.node == "a"
    assert len({s.index for s in c.shares}) == 2
    assert all((s.core_milli, s.memory_mib) == (300, 3000) for s in c.shares)
    assert not c.exclusive


def test_n_shares_need_n_cards_with_room():
    state = ClusterState([node("a", cards=2)])
    book(state, share(90, name="full"))
    with pytest.raises(Unschedulable):
        place(state, vgpus(2, 30, 3000), make_policy("binpack"))
    assert len(place(state, vgpus(1, 10, 1000), make_policy("binpack")).containers[0].shares) == 1


def test_a_percent_share_on_several_cards_follows_each_cards_memory():
    state = ClusterState([node("a", cards=2, memory_gib=16)])
    (c,) = place(state, vgpus(2, 0, 0, memory_pct=25), make_policy("binpack")).containers
    assert [s.memory_mib for s in c.shares] == [4 * GIB, 4 * GIB]


def test_several_containers_each_with_shares_on_distinct_cards():
    state = ClusterState([node("a", cards=3)])
    req = PodRequest("ns", "m", containers=(ContainerRequest("x", Dialect.HAMI, 2, 300, 1000),
                                            ContainerRequest("y", Dialect.KAI, 3, 0, 1000)))
    x, y = place(state, req, make_policy("binpack")).containers
    assert len({s.index for s in x.shares}) == 2 and len({s.index for s in y.shares}) == 3


def test_hami_model_patterns_select_and_refuse_cards_by_substring():
    state = ClusterState([node("t4", model="Tesla T4"), node("a100", model="NVIDIA A100-SXM4-80GB")])
    assert place(state, vgpus(1, 10, 1000, patterns=ModelPatterns(("A100",))), make_policy("binpack")).node == "a100"
    assert place(state, vgpus(1, 10, 1000, patterns=ModelPatterns((), ("A100",))), make_policy("binpack")).node == "t4"
    with pytest.raises(Unschedulable) as info:
        place(state, vgpus(1, 10, 1000, patterns=ModelPatterns(("V100",))), make_policy("binpack"))
    assert set(info.value.reasons.values()) == {"GPU model not allowed for this pod"}
