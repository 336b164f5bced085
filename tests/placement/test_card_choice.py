"""Card choice as kube-scheduler's DRA allocator makes it: the policy picks the node, the first card
in index order whose free core, memory and pod slots hold the request gets the pod."""

from __future__ import annotations

import pytest

from qgpu_runtime.model import AppClass, ContainerRequest, Dialect, PodRequest
from qgpu_runtime.placement import (
    CardChoice,
    CardShare,
    CardSpec,
    ClusterState,
    ContainerPlacement,
    NodeSpec,
    Placement,
    make_policy,
    place,
)

GIB = 1024
FIRST_FIT = CardChoice.FIRST_FIT


def node(name, indices=(0, 1, 2), memory_gib=16, model="T4"):
    """Cards listed in slot order ``indices``: the slot order need not be the index order."""
    return NodeSpec(name, 32000, 64 * GIB, tuple(CardSpec(i, f"{name}-{i}", model, memory_gib * GIB) for i in indices))


def share(core_pct, mem_gib=1, name="p"):
    return PodRequest("ns", name, containers=(ContainerRequest("c", Dialect.QGPU, 1, core_pct * 10, mem_gib * GIB),))


def whole(cards, name="w"):
    return PodRequest("ns", name, containers=(ContainerRequest("c", Dialect.NVIDIA, cards, 1000, exclusive=True),))


def preload(state, node_name, index, core_pct, mem_gib=1, key=None):
    """Book a share on a named card, whatever any policy would choose."""
    shares = (CardShare(index, f"{node_name}-{index}", core_pct * 10, mem_gib * GIB),)
    state.commit(key or f"pre-{node_name}-{index}-{core_pct}", Placement(node_name, (ContainerPlacement("c", shares),)))


def cards_of(placement):
    return [s.index for c in placement.containers for s in c.shares]


def test_first_fit_takes_the_first_card_with_room_where_the_policy_would_pack():
    state = ClusterState([node("a")])
    preload(state, "a", 1, 70)  # card 1: 30 % free, an exact fit for the pod
    preload(state, "a", 2, 50)
    req = share(30)
    assert cards_of(place(state, req, make_policy("binpack"))) == [1]
    assert cards_of(place(state, req, make_policy("binpack"), card_choice=FIRST_FIT)) == [0]


def test_first_fit_skips_cards_without_enough_core():
    state = ClusterState([node("a")])
    preload(state, "a", 0, 80)
    preload(state, "a", 1, 60)
    assert cards_of(place(state, share(30), make_policy("spread"), card_choice=FIRST_FIT)) == [1]


def test_first_fit_skips_cards_without_enough_memory():
    state = ClusterState([node("a")])
    preload(state, "a", 0, 10, mem_gib=14)
    assert cards_of(place(state, share(10, mem_gib=4), make_policy("binpack"), card_choice=FIRST_FIT)) == [1]


def test_first_fit_respects_the_per_card_pod_limit():
    state = ClusterState([node("a")], enforce_pod_limit=True)  # a 16 GiB T4 takes 4 shared pods
    for i in range(4):
        placed = place(state, share(1, name=f"p{i}"), make_policy("binpack"), card_choice=FIRST_FIT)
        assert cards_of(placed) == [0]
        state.commit(f"p{i}", placed)
    assert cards_of(place(state, share(1, name="p4"), make_policy("binpack"), card_choice=FIRST_FIT)) == [1]


def test_first_fit_follows_card_index_order_not_listing_order():
    state = ClusterState([node("a", indices=(2, 0, 1))])
    assert cards_of(place(state, share(30), make_policy("bestfit"), card_choice=FIRST_FIT)) == [0]


def test_first_fit_takes_the_first_whole_free_cards():
    state = ClusterState([node("a", indices=(3, 2, 1, 0))])
    preload(state, "a", 1, 10)
    assert sorted(cards_of(place(state, whole(2), make_policy("binpack"), card_choice=FIRST_FIT))) == [0, 2]


def test_first_fit_places_each_container_of_a_multi_container_pod_in_index_order():
    state = ClusterState([node("a")])
    preload(state, "a", 0, 90)
    req = PodRequest("ns", "m", containers=(ContainerRequest("x", Dialect.QGPU, 1, 200, GIB),
                                            ContainerRequest("y", Dialect.QGPU, 1, 100, GIB)))
    assert cards_of(place(state, req, make_policy("binpack"), card_choice=FIRST_FIT)) == [1, 0]


@pytest.mark.parametrize("policy", ["binpack", "bestfit", "spread", "frag"])
def test_the_policy_still_chooses_the_node(policy):
    """binpack and bestfit pick the fuller node, spread the emptier, with either card choice."""
    state = ClusterState([node("a"), node("b")])
    preload(state, "b", 2, 50)
    req = share(30)
    mine = place(state, req, make_policy(policy))
    dra = place(state, req, make_policy(policy), card_choice=FIRST_FIT)
    assert dra.node == mine.node
    assert cards_of(dra) == [0]


def test_an_online_pod_takes_the_first_card_with_room_even_beside_offline_work():
    """The allocator knows nothing of qgpu's classes: class preference cannot steer the card."""
    labels = {"mixed-qgpu-enable": "enable"}
    state = ClusterState([NodeSpec("a", 32000, 64 * GIB, tuple(CardSpec(i, f"a-{i}", "T4", 16 * GIB) for i in range(2)), labels)])
    offline = PodRequest("ns", "off", klass=AppClass.OFFLINE,
                         containers=(ContainerRequest("c", Dialect.QGPU, 1, 500, GIB),))
    state.commit("off", place(state, offline, make_policy("binpack")))
    online = PodRequest("ns", "on", klass=AppClass.ONLINE, containers=(ContainerRequest("c", Dialect.QGPU, 1, 0, GIB),))
    assert cards_of(place(state, online, make_policy("binpack"))) == [1]
    assert cards_of(place(state, online, make_policy("binpack"), card_choice=FIRST_FIT)) == [0]


def test_the_extender_view_scores_each_node_with_the_first_fit_card():
    """score_rows ranks with the allocator's card, and placement_at hands that card back."""
    from qgpu_runtime.placement.engine import placement_at, score_rows

    state = ClusterState([node("a"), node("b")])
    preload(state, "a", 1, 70)
    req = share(30)
    scored = score_rows(state, req, make_policy("binpack"), state.rows_of(["a", "b"]), card_choice=FIRST_FIT)
    assert scored.score.tolist() == [10, 0]  # binpack still prefers the fuller node
    assert cards_of(placement_at(state, req, scored, 0)) == [0]
