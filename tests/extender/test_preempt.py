"""The extender's preempt verb (issue 25 §1, §2), in memory: kube-scheduler's candidate victims in,
card-level victims out, and the cards they free held for the preemptor while they terminate.
Real cache, engine and ClusterState; the pods are what the watch would deliver."""

from __future__ import annotations

import json

from qgpu_runtime.contract.record import CardShare, ContainerPlacement
from qgpu_runtime.extender.app import ExtenderApp
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.extender.wire import MAX_PREEMPT_NODES, MAX_VICTIMS_PER_NODE
from qgpu_runtime.model.requests import DEFAULT_LIMITS, AppClass, parse_pod
from qgpu_runtime.placement.policies import make_policy
from qgpu_runtime.placement.state import Placement
from tests.extender.test_kube_cache import SEC, node
from tests.recordkeys import VERIFIER, signed

MIXED = {"mixed-qgpu-enable": "enable"}


def app(*nodes: dict, ttl_s: int = 60) -> ExtenderApp:
    cache = AllocationCache(make_policy("binpack"), "binpack", assume_ttl_ns=ttl_s * SEC, verifier=VERIFIER)
    cache.replace_nodes(list(nodes) or [node("a")])
    cache.replace_pods([])
    return ExtenderApp(cache, None, DEFAULT_LIMITS)


def pending(name: str, core: int | None = 100, memory_gib: int | None = None, priority: int = 100,
            klass: AppClass | None = None) -> dict:
    if memory_gib is None:  # a share below one card names its memory
        memory_gib = 1 if core is not None and core < 100 else 0
    limits = {}
    if core is not None:
        limits["tke.cloud.tencent.com/qgpu-core"] = str(core)
    if memory_gib:
        limits["tke.cloud.tencent.com/qgpu-memory"] = str(memory_gib)
    annotations = {"tke.cloud.tencent.com/app-class": klass.value} if klass else {}
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "annotations": annotations},
            "spec": {"nodeName": "", "priority": priority,
                     "containers": [{"name": "c", "resources": {"limits": limits}}]},
            "status": {"phase": "Pending"}}


def bound(name: str, node_name: str, cards: dict[int, int], priority: int = 0,
          klass: AppClass = AppClass.NORMAL, memory_gib: int = 1) -> dict:
    """A running pod with a record qgpu signed: ``cards`` maps card index -> core percent."""
    shares = tuple(CardShare(i, f"GPU-{node_name}-{i}", core * 10, memory_gib * 1024) for i, core in cards.items())
    record = Placement(node_name, (ContainerPlacement("c", shares),), klass).record("binpack", 0)
    core = sum(cards.values()) // len(cards)
    p = pending(name, core if klass is not AppClass.ONLINE else None, memory_gib, priority,
                klass if klass is not AppClass.NORMAL else None)
    p["metadata"]["annotations"].update(signed(record, 0, p["metadata"]["uid"]))
    p["spec"]["nodeName"] = node_name
    p["status"]["phase"] = "Running"
    return p


def meta_body(p: dict, victims: dict[str, list[str]], pdb: int = 0) -> bytes:
    return json.dumps({"Pod": p, "NodeNameToMetaVictims": {
        n: {"Pods": [{"UID": f"uid-{v}"} for v in vs], "NumPDBViolations": pdb} for n, vs in victims.items()}}).encode()


def full_body(p: dict, victims: dict[str, list[dict]]) -> bytes:
    return json.dumps({"Pod": p, "NodeNameToVictims": {
        n: {"Pods": vs, "NumPDBViolations": 0} for n, vs in victims.items()}}).encode()


def answer(a: ExtenderApp, body: bytes) -> dict[str, list[str]]:
    status, doc = a.handle("preempt", body)
    assert status == 200, doc
    return {n: sorted(p["UID"].removeprefix("uid-") for p in v["Pods"]) for n, v in doc["NodeNameToMetaVictims"].items()}


def watch(a: ExtenderApp, *pods: dict) -> None:
    for p in pods:
        a.cache.apply_pod("ADDED", p)


def delete(a: ExtenderApp, p: dict) -> None:
    a.cache.apply_pod("DELETED", p)


def filter_passes(a: ExtenderApp, p: dict, names: tuple[str, ...] = ("a",), now: int = 0) -> list[str]:
    return a.cache.filter(p, parse_pod(p), list(names), now).passed


# -- the card-level choice -----------------------------------------------------------------------


def test_the_victims_free_a_usable_card_where_kube_schedulers_choice_frees_none():
    """Card 0: A 30 % (priority 1) and B 30 % (priority 0); card 1: C 50 % (priority 2). A whole-card
    pod: kube-scheduler's node-level reprieve keeps C and A and names B, which frees no card."""
    a = app()
    watch(a, bound("A", "a", {0: 30}, 1), bound("B", "a", {0: 30}, 0), bound("C", "a", {1: 50}, 2))
    p = pending("p", 100)
    watch(a, p)
    status, doc = a.handle("preempt", meta_body(p, {"a": ["B"]}, pdb=1))
    assert sorted(v["UID"] for v in doc["NodeNameToMetaVictims"]["a"]["Pods"]) == ["uid-A", "uid-B"]
    # qgpu counts the violations of its own victims from the budgets it watches (none here), not
    # kube-scheduler's count of its own list
    assert doc["NodeNameToMetaVictims"]["a"]["NumPDBViolations"] == 0


def pdb(name: str, labels: dict[str, str], allowed: int = 0, namespace: str = "ns", disrupted: tuple[str, ...] = ()) -> dict:
    return {"metadata": {"namespace": namespace, "name": name},
            "spec": {"selector": {"matchLabels": labels}, "minAvailable": 1},
            "status": {"disruptionsAllowed": allowed, "disruptedPods": {n: "2026-11-28T00:00:00Z" for n in disrupted}}}


def labelled(p: dict, **labels: str) -> dict:
    p["metadata"]["labels"] = labels
    return p


def test_a_pod_a_disruption_budget_protects_is_spared_where_an_unprotected_one_frees_a_usable_card():
    """Two cards, each with one offline pod of 50 %; A has the lower priority and would go first.
    A budget protecting A (no disruption allowed) turns the choice to B, as kube-scheduler's
    reprieve of violating pods first does; deleting the budget turns it back."""
    a = app()
    watch(a, labelled(bound("A", "a", {0: 50}, 0, AppClass.OFFLINE), app="a"),
          labelled(bound("B", "a", {1: 50}, 1, AppClass.OFFLINE), app="b"))
    p = pending("p", 60)
    watch(a, p)
    assert answer(a, meta_body(p, {"a": ["A"]})) == {"a": ["A"]}
    a.cache.budgets.apply("ADDED", pdb("keep-a", {"app": "a"}))
    status, doc = a.handle("preempt", meta_body(p, {"a": ["A"]}))
    assert answer(a, meta_body(p, {"a": ["A"]})) == {"a": ["B"]}
    assert doc["NodeNameToMetaVictims"]["a"]["NumPDBViolations"] == 0
    a.cache.budgets.apply("DELETED", pdb("keep-a", {"app": "a"}))
    assert answer(a, meta_body(p, {"a": ["A"]})) == {"a": ["A"]}


def test_a_budget_is_violated_only_where_nothing_else_helps_and_the_violation_is_counted():
    """A and B selected by one budget that allows one disruption: evicting the less important, A,
    would overdraw it (kube-scheduler's split: the most important takes the allowance). A
    whole-card pod can only have card 0 (card 1 also holds C, of a higher priority than the pod):
    A goes, counted as one violation. A budget of another namespace, and one whose pod is already
    being disrupted, protect nothing."""
    a = app()
    watch(a, labelled(bound("A", "a", {0: 50}, 0, AppClass.OFFLINE), app="x"),
          labelled(bound("B", "a", {1: 50}, 5, AppClass.OFFLINE), app="x"), bound("C", "a", {1: 50}, 200))
    p = pending("p", 100)
    watch(a, p)
    a.cache.budgets.replace([pdb("x", {"app": "x"}, allowed=1)])
    status, doc = a.handle("preempt", meta_body(p, {"a": ["A"]}))
    assert {n: sorted(v["UID"] for v in d["Pods"]) for n, d in doc["NodeNameToMetaVictims"].items()} == {"a": ["uid-A"]}
    assert doc["NodeNameToMetaVictims"]["a"]["NumPDBViolations"] == 1
    a.cache.budgets.replace([pdb("x", {"app": "x"}, allowed=0, namespace="other"),
                             pdb("y", {"app": "x"}, allowed=0, disrupted=("A",))])
    status, doc = a.handle("preempt", meta_body(p, {"a": ["A"]}))
    assert doc["NodeNameToMetaVictims"]["a"]["NumPDBViolations"] == 0


def test_a_node_where_the_pod_already_fits_at_card_level_keeps_kube_schedulers_victims_that_book_no_card():
    """kube-scheduler's dry run found a node-level shortage (CPU, say) qgpu does not book: its victims
    that hold no qgpu card stay; a victim holding a card it does not need is dropped."""
    a = app()
    cpu_hog = {"metadata": {"name": "hog", "namespace": "ns", "uid": "uid-hog"},
               "spec": {"nodeName": "a", "priority": 0, "containers": [{"name": "c"}]}, "status": {"phase": "Running"}}
    watch(a, bound("A", "a", {0: 30}), cpu_hog)
    p = pending("p", 50)
    watch(a, p)
    assert answer(a, meta_body(p, {"a": ["A", "hog"]})) == {"a": ["hog"]}


def test_offline_pods_are_evicted_before_online_pods_of_equal_priority():
    a = app(node("a") | {"metadata": {**node("a")["metadata"], "labels": MIXED}})
    watch(a, bound("on", "a", {0: 0}, klass=AppClass.ONLINE, memory_gib=30),
          bound("off", "a", {1: 20}, klass=AppClass.OFFLINE, memory_gib=30))
    p = pending("p", None, memory_gib=8, klass=AppClass.ONLINE)
    watch(a, p)
    assert answer(a, meta_body(p, {"a": ["on"]})) == {"a": ["off"]}


def test_pods_of_equal_or_higher_priority_are_never_named_and_the_node_is_dropped():
    a = app()
    watch(a, bound("same", "a", {0: 60}, priority=100), bound("higher", "a", {1: 60}, priority=200))
    p = pending("p", 50, priority=100)
    watch(a, p)
    assert answer(a, meta_body(p, {"a": ["same", "higher"]})) == {}


def test_the_priority_of_a_victim_is_the_watchs_not_the_bodys():
    """A full-form body claims the victim's priority is 0: the watch says 500, so it is not named."""
    a = app()
    victim = bound("v", "a", {0: 100, 1: 100}, priority=500)
    watch(a, victim)
    p = pending("p", 100)
    watch(a, p)
    claimed = json.loads(json.dumps(victim))
    claimed["spec"]["priority"] = 0
    assert answer(a, full_body(p, {"a": [claimed]})) == {}


def test_a_two_card_pod_gets_two_whole_cards_freed():
    a = app(node("a", n_cards=3))
    watch(a, bound("A", "a", {0: 10}, 0), bound("B", "a", {1: 10}, 1), bound("C", "a", {2: 10}, 2))
    p = pending("p", 200)
    watch(a, p)
    assert answer(a, meta_body(p, {"a": ["A", "B", "C"]})) == {"a": ["A", "B"]}


def test_nodes_where_nothing_helps_and_nodes_qgpu_does_not_know_are_dropped():
    a = app(node("a"), node("b"))
    watch(a, bound("A", "a", {0: 60}), bound("B", "b", {0: 60}, priority=100), bound("C", "b", {1: 60}))
    p = pending("p", 200)
    watch(a, p)
    assert answer(a, meta_body(p, {"a": ["A"], "b": ["C"], "ghost": ["A"]})) == {"a": ["A"]}


def test_full_and_meta_forms_give_the_same_answer_in_the_meta_form():
    a = app()
    victim = bound("A", "a", {0: 80})
    watch(a, victim, bound("B", "a", {1: 80}, priority=500))
    p = pending("p", 50)
    watch(a, p)
    assert answer(a, meta_body(p, {"a": ["A"]})) == answer(a, full_body(p, {"a": [victim]})) == {"a": ["A"]}


def test_a_pod_asking_no_gpu_gets_kube_schedulers_victims_unchanged():
    a = app()
    watch(a, bound("A", "a", {0: 80}))
    p = pending("p", None)
    p["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1"}}
    watch(a, p)
    assert answer(a, meta_body(p, {"a": ["A"], "b": ["x"]})) == {"a": ["A"], "b": ["x"]}


def test_an_untrusted_preemptor_gets_no_victims_and_holds_nothing():
    a = app()
    watch(a, bound("A", "a", {0: 80}))
    ghost = pending("ghost", 50)  # never delivered by the watch: not a pod the apiserver has
    assert answer(a, meta_body(ghost, {"a": ["A"]})) == {}
    assert a.cache.nominated("ns/ghost") == {}
    assert a.metrics.refused.labels("preempt", "untrusted-pod")._value.get() == 1


def test_malformed_and_oversized_bodies_are_400_naming_the_field():
    a = app()
    p = pending("p", 50)
    watch(a, p)
    too_many_nodes = {"Pod": p, "NodeNameToMetaVictims": {f"n{i}": {"Pods": [{"UID": "u"}]} for i in range(MAX_PREEMPT_NODES + 1)}}
    too_many_pods = {"Pod": p, "NodeNameToMetaVictims": {"a": {"Pods": [{"UID": f"u{i}"} for i in range(MAX_VICTIMS_PER_NODE + 1)]}}}
    cases = [
        (too_many_nodes, "NodeNameToMetaVictims: 5001 nodes: at most 5000"),
        (too_many_pods, "NodeNameToMetaVictims['a'].Pods: 1001 pods"),
        ({"Pod": p, "NodeNameToMetaVictims": {"a": {"Pods": [{"UID": 7}]}}}, "['a'].Pods[0].UID=7"),
        ({"Pod": p, "NodeNameToVictims": {"a": {"Pods": [{"metadata": {}}]}}}, "['a'].Pods[0].metadata.uid"),
        ({"Pod": p, "NodeNameToVictims": {"a": {"Pods": [{"metadata": 1}]}}}, "['a'].Pods[0].metadata.uid"),  # hypothesis found it
        ({"Pod": p, "NodeNameToMetaVictims": {"a": {"Pods": [], "NumPDBViolations": 3}}}, "NumPDBViolations=3"),
        ({"Pod": p, "NodeNameToMetaVictims": []}, "must be an object keyed by node name"),
        ({"Pod": p}, "neither NodeNameToVictims nor NodeNameToMetaVictims"),
    ]
    for body, expected in cases:
        status, doc = a.handle("preempt", json.dumps(body).encode())
        assert status == 400 and expected in doc["Error"], (expected, doc)
    assert a.metrics.requests.labels("preempt", "400")._value.get() == len(cases)


# -- the nominated pod keeps its cards ---------------------------------------------------------------


def test_the_card_a_victim_frees_is_held_for_the_preemptor_until_it_binds():
    a = app(node("a", n_cards=1))
    victim = bound("v", "a", {0: 80})
    watch(a, victim)
    p, other = pending("p", 50), pending("other", 60, priority=100)
    watch(a, p, other)
    assert answer(a, meta_body(p, {"a": ["v"]})) == {"a": ["v"]}
    assert a.cache.nominated("ns/p") == {"a": {"ns/v"}}
    delete(a, victim)  # kube-scheduler deleted it; the kubelet finished it
    assert filter_passes(a, other) == []  # another pod of the same priority, filtered first
    assert filter_passes(a, p) == ["a"]  # the preemptor's own filter uses the held card
    assert a.cache.booking("ns/p") is not None and a.cache.booking("ns/p").node == "a"
    bound_p = bound("p", "a", {0: 50}, priority=100)
    watch(a, bound_p)  # its bind shows in the watch
    assert a.cache.nominated("ns/p") == {}
    assert filter_passes(a, other) == []  # 50 + 60 > 100: the card is the preemptor's now


def test_while_several_victims_terminate_the_ones_gone_keep_their_cards_for_the_preemptor():
    a = app(node("a", n_cards=1))
    v1, v2 = bound("v1", "a", {0: 40}), bound("v2", "a", {0: 40})
    watch(a, v1, v2)
    p, other = pending("p", 100), pending("other", 40, priority=100)
    watch(a, p, other)
    assert answer(a, meta_body(p, {"a": ["v1", "v2"]})) == {"a": ["v1", "v2"]}
    delete(a, v1)
    assert filter_passes(a, other) == []  # v1's 40 % is kept although only v2 is still running
    delete(a, v2)
    assert filter_passes(a, other) == []
    assert filter_passes(a, p) == ["a"]


def test_the_hold_expires_with_the_assume_timeout_and_the_card_is_open_again():
    a = app(node("a", n_cards=1), ttl_s=30)
    victim = bound("v", "a", {0: 80})
    watch(a, victim)
    p, other = pending("p", 50), pending("other", 60, priority=100)
    watch(a, p, other)
    a.cache.preempt(p, parse_pod(p), {"a": ["uid-v"]}, now_ns=0)
    delete(a, victim)
    assert filter_passes(a, other, now=SEC) == []
    a.cache.expire(31 * SEC)
    assert filter_passes(a, other, now=31 * SEC) == ["a"]


def test_kube_scheduler_nominating_another_node_drops_the_offer_there():
    a = app(node("a", n_cards=1), node("b", n_cards=1))
    va, vb = bound("va", "a", {0: 80}), bound("vb", "b", {0: 80})
    watch(a, va, vb)
    p, other = pending("p", 50), pending("other", 50, priority=100)
    watch(a, p, other)
    assert answer(a, meta_body(p, {"a": ["va"], "b": ["vb"]})) == {"a": ["va"], "b": ["vb"]}
    nominated = json.loads(json.dumps(p))
    nominated["status"]["nominatedNodeName"] = "b"
    a.cache.apply_pod("MODIFIED", nominated)
    assert a.cache.nominated("ns/p") == {"b": {"ns/vb"}}
    delete(a, va)  # finished on its own: nothing holds its card
    assert filter_passes(a, other, ("a",)) == ["a"]


def test_the_preemptor_deleted_releases_what_its_victims_kept():
    a = app(node("a", n_cards=1))
    v1, v2 = bound("v1", "a", {0: 40}), bound("v2", "a", {0: 40})
    watch(a, v1, v2)
    p, other = pending("p", 100), pending("other", 50, priority=100)
    watch(a, p, other)
    answer(a, meta_body(p, {"a": ["v1", "v2"]}))
    delete(a, v1)
    delete(a, p)
    assert a.cache.nominated("ns/p") == {}
    assert filter_passes(a, other) == ["a"]  # v2's 40 % + 50 % fit once v1's kept share is free


def test_the_preemptors_filter_while_a_victim_still_runs_keeps_the_hold_for_later():
    """Its own filter sets the kept share aside to decide, fails (v2 still runs), and books it again."""
    a = app(node("a", n_cards=1))
    v1, v2 = bound("v1", "a", {0: 40}), bound("v2", "a", {0: 40})
    watch(a, v1, v2)
    p, other = pending("p", 100), pending("other", 40, priority=100)
    watch(a, p, other)
    answer(a, meta_body(p, {"a": ["v1", "v2"]}))
    delete(a, v1)
    assert filter_passes(a, p) == []
    assert filter_passes(a, other) == []  # v1's share is still kept for p
    delete(a, v2)
    assert filter_passes(a, p) == ["a"]


def test_a_record_that_needs_the_kept_cards_wins_over_the_hold():
    """A hold is a guess; a bound pod's record (another binder's, say) is the truth, as for filter's holds."""
    a = app(node("a", n_cards=1))
    v1, v2 = bound("v1", "a", {0: 40}), bound("v2", "a", {0: 40})
    watch(a, v1, v2)
    p = pending("p", 100)
    watch(a, p)
    answer(a, meta_body(p, {"a": ["v1", "v2"]}))
    delete(a, v1)
    watch(a, bound("elsewhere", "a", {0: 50}))
    assert a.cache.booking("ns/elsewhere") is not None


def test_a_nomination_cleared_after_naming_the_node_drops_the_offer():
    """kube-scheduler took the room for a pod of higher priority and cleared this pod's nomination."""
    a = app(node("a", n_cards=1))
    victim = bound("v", "a", {0: 80})
    watch(a, victim)
    p, other = pending("p", 50), pending("other", 60, priority=100)
    watch(a, p, other)
    answer(a, meta_body(p, {"a": ["v"]}))
    nominated = json.loads(json.dumps(p))
    nominated["status"]["nominatedNodeName"] = "a"
    a.cache.apply_pod("MODIFIED", nominated)
    assert a.cache.nominated("ns/p") == {"a": {"ns/v"}}
    a.cache.apply_pod("MODIFIED", p)  # nominatedNodeName cleared
    assert a.cache.nominated("ns/p") == {}
    delete(a, victim)
    assert filter_passes(a, other) == ["a"]
