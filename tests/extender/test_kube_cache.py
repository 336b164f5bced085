"""The extender's cache: bookings follow the pods' records, binds cannot double-book, stale and
expired assumptions are released. Real engine, real ClusterState; only the events are hand-made."""

from __future__ import annotations

import json

import pytest

from qgpu_runtime.contract.inventory import cards_annotation
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.model.requests import parse_pod
from qgpu_runtime.placement import engine
from qgpu_runtime.placement.policies import make_policy
from qgpu_runtime.placement.state import CardSpec
from tests.recordkeys import VERIFIER, sign_pod, signed

SEC = 10**9


def node(name: str, n_cards: int = 2, memory_mib: int = 32768, model: str = "V100") -> dict:
    cards = [CardSpec(i, f"GPU-{name}-{i}", model, memory_mib) for i in range(n_cards)]
    return {"metadata": {"name": name, "annotations": {"qgpu.io/gpus": cards_annotation(cards)}},
            "status": {"allocatable": {"cpu": "32", "memory": "128Gi"}}}


def pod(name: str, core: int = 30, memory: int = 8, uid: str | None = None, node_name: str = "",
        annotations: dict | None = None, version: str | None = None) -> dict:
    """``version``: the resourceVersion the apiserver would have given it (none by default)."""
    limits = {"tke.cloud.tencent.com/qgpu-core": str(core)}
    if memory:
        limits["tke.cloud.tencent.com/qgpu-memory"] = str(memory)
    meta = {"name": name, "namespace": "ns", "uid": uid or f"uid-{name}", "annotations": annotations or {}}
    if version is not None:
        meta["resourceVersion"] = version
    return {"metadata": meta,
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "resources": {"limits": limits}}]},
            "status": {"phase": "Pending"}}


def cache(ttl_s: int = 60, policy: str = "binpack") -> AllocationCache:
    c = AllocationCache(make_policy(policy), policy, assume_ttl_ns=ttl_s * SEC, verifier=VERIFIER)
    c.replace_nodes([node("a"), node("b")])
    c.replace_pods([])
    return c


def bind_locally(c: AllocationCache, p: dict, node_name: str, now: int) -> dict:
    """What Binder does to the cache, plus the pod as the watch would then show it."""
    rec = c.reserve(p, parse_pod(p), node_name, now)
    return {**p, "metadata": {**p["metadata"], "annotations": signed(rec, now, p["metadata"]["uid"])},
            "spec": {**p["spec"], "nodeName": node_name}}


def test_records_on_pods_rebuild_the_bookings():
    first = cache()
    bound_pod = bind_locally(first, pod("p1"), "a", 1)
    fresh = cache()
    fresh.replace_pods([bound_pod])
    booking = fresh.booking("ns/p1")
    assert booking is not None and booking.node == "a"
    assert booking == first.booking("ns/p1")


def test_reserve_books_so_the_next_reserve_cannot_over_commit_a_card():
    c = cache()
    c.replace_nodes([node("a", n_cards=1)])
    big = pod("big", core=60, memory=20)
    c.reserve(big, parse_pod(big), "a", 1)
    other = pod("other", core=60, memory=4)
    with pytest.raises(engine.Unschedulable):
        c.reserve(other, parse_pod(other), "a", 2)


def test_filter_splits_full_nodes_from_nodes_that_can_never_fit():
    c = cache()
    c.replace_nodes([node("a", n_cards=1), node("small", n_cards=1, memory_mib=4096)])
    filler = pod("filler", core=90, memory=20)
    c.reserve(filler, parse_pod(filler), "a", 1)
    p = pod("p", core=50, memory=8)
    out = c.filter(p, parse_pod(p), ["a", "small", "ghost"])
    assert out.passed == []
    assert set(out.failed) == {"a"}
    assert set(out.unresolvable) == {"small", "ghost"}
    assert all(out.failed.values()) and all(out.unresolvable.values())


def test_binpack_prefers_the_used_node_and_spread_the_empty_one():
    for policy, expected in (("binpack", "a"), ("spread", "b")):
        c = cache(policy=policy)
        first = pod("first")
        c.reserve(first, parse_pod(first), "a", 1)
        p = pod("p")
        scores = c.prioritize(p, parse_pod(p), ["a", "b"])
        assert max(scores, key=scores.get) == expected, (policy, scores)
        assert all(0 <= s <= 10 for s in scores.values())


def test_watch_events_older_than_our_own_write_do_not_replace_our_booking():
    c = cache()
    p = pod("p")
    old = bind_locally(c, p, "a", 1)
    c.apply_pod("MODIFIED", {**old, "spec": {**old["spec"], "nodeName": ""}})  # the event of our write
    ours = c.booking("ns/p")
    newer = bind_locally(c, {**p, "metadata": {**p["metadata"], "annotations": old["metadata"]["annotations"]}}, "b", 2)
    c.apply_pod("MODIFIED", {**old, "spec": {**old["spec"], "nodeName": ""}})  # late event, stale record
    assert c.booking("ns/p").node == "b" != ours.node
    c.apply_pod("MODIFIED", newer)
    assert c.booking("ns/p").node == "b"


def test_assumed_record_expires_and_is_handed_out_for_deletion():
    c = cache(ttl_s=30)
    p = bind_locally(c, pod("p"), "a", 100 * SEC)
    unbound = {**p, "spec": {**p["spec"], "nodeName": ""}}
    c.apply_pod("MODIFIED", unbound)
    assert c.expire(120 * SEC) == []
    assert c.booking("ns/p") is not None
    (expired,) = c.expire(131 * SEC)
    assert (expired.namespace, expired.name, expired.uid) == ("ns", "p", "uid-p")
    assert c.booking("ns/p") is None
    c.apply_pod("MODIFIED", unbound)  # the record is still there until the delete lands
    assert c.booking("ns/p") is None


def test_bound_records_never_expire_and_ended_pods_release():
    c = cache(ttl_s=1)
    p = bind_locally(c, pod("p"), "a", 0)
    c.apply_pod("MODIFIED", p)
    assert c.expire(100 * SEC) == [] and c.booking("ns/p") is not None
    c.apply_pod("MODIFIED", {**p, "status": {"phase": "Succeeded"}})
    assert c.booking("ns/p") is None


def test_scheduler_retrying_a_pod_releases_its_dead_assumption():
    c = cache()
    p = bind_locally(c, pod("p", core=90, memory=30), "a", 0)
    unbound = {**p, "spec": {**p["spec"], "nodeName": ""}}
    c.apply_pod("MODIFIED", unbound)
    out = c.filter(unbound, parse_pod(unbound), ["a"], now_ns=5 * SEC)
    assert out.passed == ["a"]  # the dead record no longer blocks its own card
    c.expire(5 * SEC + c.assume_ttl_ns)
    assert c.booking("ns/p") is None  # neither the record nor the new hold outlive the timeout


def test_filter_holds_the_best_node_so_the_next_pod_cannot_take_it_before_the_bind():
    c = cache()
    c.replace_nodes([node("a", n_cards=1)])
    first, second = pod("first", core=60, memory=8), pod("second", core=60, memory=8)
    assert c.filter(first, parse_pod(first), ["a"], now_ns=1).passed == ["a"]
    assert c.filter(second, parse_pod(second), ["a"], now_ns=2).failed.keys() == {"a"}
    c.reserve(first, parse_pod(first), "a", 3)  # the bind of the first pod turns its hold into a booking
    assert c.booking("ns/first").node == "a"
    assert c.filter(second, parse_pod(second), ["a"], now_ns=4).passed == []


def test_hold_moves_when_bind_names_another_node_and_expires_when_no_bind_comes():
    c = cache()
    p = pod("p")
    c.filter(p, parse_pod(p), ["a", "b"], now_ns=SEC)
    held = c.booking("ns/p").node
    other = "b" if held == "a" else "a"
    c.reserve(p, parse_pod(p), other, 2 * SEC)
    assert c.booking("ns/p").node == other
    q = pod("q")
    c.filter(q, parse_pod(q), ["a", "b"], now_ns=SEC)
    assert c.booking("ns/q") is not None
    c.expire(SEC + c.assume_ttl_ns)
    assert c.booking("ns/q") is None and c.booking("ns/p") is not None


def test_prioritize_ignores_the_pods_own_hold():
    for policy in ("binpack", "spread"):
        c = cache(policy=policy)
        first = pod("first")
        c.reserve(first, parse_pod(first), "a", 1)
        p = pod("p")
        before = c.prioritize(p, parse_pod(p), ["a", "b"])
        c.filter(p, parse_pod(p), ["a", "b"], now_ns=2)
        c._memo = None  # force a fresh computation with the hold in place
        assert c.prioritize(p, parse_pod(p), ["a", "b"]) == before, policy


def test_recreated_pod_with_same_name_drops_the_old_booking():
    c = cache()
    p = bind_locally(c, pod("p"), "a", 0)
    c.apply_pod("MODIFIED", p)
    c.apply_pod("ADDED", pod("p", uid="uid-2"))
    assert c.booking("ns/p") is None


def test_new_node_keeps_existing_bookings_and_late_nodes_pick_up_records():
    c = cache()
    p = bind_locally(c, pod("p"), "a", 0)
    c.apply_pod("MODIFIED", p)
    orphan = {**pod("q"), "metadata": {**pod("q")["metadata"], "annotations": {
        "qgpu.io/allocation": json.dumps({"version": 1, "node": "late", "policy": "binpack", "class": "normal", "time": "t",
                                          "containers": [{"name": "c", "cards": [{"index": 0, "uuid": "GPU-late-0", "core_milli": 300, "memory_mib": 8192}]}]})}},
              "spec": {**pod("q")["spec"], "nodeName": "late"}}
    c.apply_pod("ADDED", sign_pod(orphan))
    assert c.booking("ns/q") is None
    c.apply_node("ADDED", node("late"))
    assert c.booking("ns/p").node == "a"
    assert c.booking("ns/q").node == "late"


def test_bad_inventory_and_bad_records_are_reported_not_fatal():
    c = cache()
    c.apply_node("ADDED", {"metadata": {"name": "bad", "annotations": {"qgpu.io/gpus": "[{\"index\": -1}]"}}})
    c.apply_pod("ADDED", pod("r", node_name="a", annotations={"qgpu.io/allocation": "{}"}))
    assert "bad" in c.node_names()
    assert any("index=-1" in p for p in c.problems) and any("ns/r" in p for p in c.problems)


def test_unhealthy_cards_take_no_new_pods():
    from qgpu_runtime.extender.nodes import node_spec

    cards = [CardSpec(i, f"GPU-h-{i}", "V100", 32768) for i in range(2)]
    n = {"metadata": {"name": "h", "annotations": {"qgpu.io/gpus": cards_annotation(cards, unhealthy=frozenset({0}))}},
         "status": {"allocatable": {"cpu": "8", "memory": "16Gi"}}}
    spec = node_spec(n)
    assert [c.index for c in spec.cards] == [1] and spec.cpu_milli == 8000 and spec.memory_mib == 16384
    c = cache()
    c.replace_nodes([n])
    whole = pod("whole", core=200, memory=0)
    assert c.filter(whole, parse_pod(whole), ["h"]).unresolvable.keys() == {"h"}


def node_h(n_cards: int, unhealthy: frozenset[int]) -> dict:
    """Node h with ``n_cards`` V100s, those of ``unhealthy`` marked so by its manager."""
    cards = [CardSpec(i, f"GPU-h-{i}", "V100", 32768) for i in range(n_cards)]
    return {"metadata": {"name": "h", "annotations": {"qgpu.io/gpus": cards_annotation(cards, unhealthy=unhealthy)}},
            "status": {"allocatable": {"cpu": "8", "memory": "16Gi"}}}


def test_a_card_gone_unhealthy_leaves_its_pods_other_cards_booked_and_its_return_books_it_again():
    """A pod bound to cards 0 and 1; card 1 is marked unhealthy and leaves the node's spec while the
    pod keeps running. Its whole record used to stay unbooked ('no card with index 1'), and card 0,
    which the pod still holds, went to the next whole-card pod."""
    def h(unhealthy: frozenset[int]) -> dict:
        return node_h(2, unhealthy)

    c = cache()
    c.replace_nodes([h(frozenset())])
    two = bind_locally(c, pod("two", core=200, memory=0), "h", 1)
    c.apply_pod("MODIFIED", two)
    c.replace_nodes([h(frozenset({1}))])
    booking = c.booking("ns/two")
    assert booking is not None and [s.index for ct in booking.containers for s in ct.shares] == [0]
    whole = pod("whole", core=100, memory=0)
    assert c.filter(whole, parse_pod(whole), ["h"]).passed == []  # card 0 is the pod's
    c.apply_pod("MODIFIED", two)  # a later event of the pod books the same part
    assert [s.index for ct in c.booking("ns/two").containers for s in ct.shares] == [0]
    c.replace_nodes([h(frozenset())])  # card 1 back: the pod's share of it is booked again
    assert [s.index for ct in c.booking("ns/two").containers for s in ct.shares] == [0, 1]
    assert c.filter(whole, parse_pod(whole), ["h"]).passed == []


def test_a_record_that_collides_with_a_filter_hold_is_booked_and_the_hold_yields():
    """A filter answered before the caches synced held card capacity that records (arriving in the
    pod list) already book. The records must win, or the cache counts less than is bound and filter
    keeps offering a full node (whose binds the node commitments then refuse for ever)."""
    c = AllocationCache(make_policy("binpack"), "binpack", assume_ttl_ns=60 * SEC, verifier=VERIFIER)
    c.replace_nodes([node("a", n_cards=1)])
    early = pod("early", core=80, memory=4)
    c.filter(early, parse_pod(early), ["a"], 1)  # a hold on card 0 of a, before any pod was listed
    other = cache()  # where the bound pod's record was written
    other.replace_nodes([node("a", n_cards=1)])
    bound_pod = bind_locally(other, pod("bound", core=50, memory=4), "a", 1)
    c.replace_pods([bound_pod])
    assert c.booking("ns/bound") is not None and c.booking("ns/early") is None
    assert not c.problems


def test_nodes_of_a_dra_pool_take_only_what_dra_maps():
    """Cards of a DRA pool reach pods through ResourceClaims: a qGPU/vcuda/T9k pod bound there would
    find no device plugin, so those nodes are refused to it (unresolvable, with the reason), while
    nvidia.com/gpu, which the whole-card DeviceClass maps (KEP-5004), may still go there."""
    from qgpu_runtime.contract.names import POOL_MODE_LABEL
    from qgpu_runtime.extender.nodes import DRA_POOL_REASON, dra_pool, node_spec

    d = node("d")
    d["metadata"]["labels"] = {POOL_MODE_LABEL: "dra"}
    assert dra_pool(node_spec(d)) and not dra_pool(node_spec(node("p")))
    c = cache()
    c.replace_nodes([d, node("p")])
    share = pod("share")
    result = c.filter(share, parse_pod(share), ["d", "p"], now_ns=1)
    assert result.passed == ["p"] and result.unresolvable == {"d": DRA_POOL_REASON} and result.held == "p"
    only_dra = pod("only")
    result = c.filter(only_dra, parse_pod(only_dra), ["d"], now_ns=1)
    assert result.passed == [] and result.unresolvable == {"d": DRA_POOL_REASON} and result.held is None
    whole = {"metadata": {"name": "w", "namespace": "ns", "uid": "uid-w", "annotations": {}},
             "spec": {"nodeName": "", "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
             "status": {"phase": "Pending"}}
    result = c.filter(whole, parse_pod(whole), ["d"], now_ns=1)
    assert result.passed == ["d"]
    c.replace_nodes([node("d"), node("p")])  # the pool went back to device plugins
    again = pod("again")
    assert c.filter(again, parse_pod(again), ["d"], now_ns=1).passed == ["d"]


def test_a_filter_hold_on_a_card_gone_unhealthy_is_not_bound_with_fewer_cards():
    """Filter held cards 0 and 1 for a two-card pod; card 1 goes unhealthy before the bind. The
    hold is dropped whole, not trimmed to card 0: the bind chooses two cards the node still lists."""
    def h(unhealthy: frozenset[int]) -> dict:
        return node_h(3, unhealthy)

    c = cache()
    c.replace_nodes([h(frozenset())])
    two = pod("two", core=200, memory=0)
    assert c.filter(two, parse_pod(two), ["h"], now_ns=1).passed == ["h"]
    held = c.booking("ns/two")
    assert held is not None and [s.index for ct in held.containers for s in ct.shares] == [0, 1]
    c.replace_nodes([h(frozenset({1}))])
    record = c.reserve(two, parse_pod(two), "h", 2)
    assert sorted(s.index for ct in record.containers for s in ct.shares) == [0, 2]
