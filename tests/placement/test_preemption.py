"""The card-level victim chooser (placement/preemption.py), in memory: which pods to evict so a
pending pod fits a node, where kube-scheduler's node-level arithmetic would evict others."""

from __future__ import annotations

from qgpu_runtime.model.requests import AppClass, parse_pod
from qgpu_runtime.placement.policies import make_policy
from qgpu_runtime.placement.preemption import Candidate, choose_victims
from qgpu_runtime.placement.state import CardShare, CardSpec, ContainerPlacement, NodeSpec, Placement

BINPACK = make_policy("binpack")


def spec(n_cards: int = 2, model: str = "V100") -> NodeSpec:
    cards = tuple(CardSpec(i, f"GPU-{i}", model, 32768) for i in range(n_cards))
    return NodeSpec("a", 32000, 131072, cards)


def on_card(card: int, core: int, klass: AppClass = AppClass.NORMAL, memory_mib: int = 1024) -> Placement:
    share = CardShare(card, f"GPU-{card}", core * 10, memory_mib)
    return Placement("a", (ContainerPlacement("c", (share,)),), klass)


def candidate(key: str, placement: Placement, priority: int = 0) -> Candidate:
    return Candidate(key, f"uid-{key}", priority, placement)


def request(core: int | None, annotations: dict | None = None, memory_gib: int = 1):
    limits = {"tke.cloud.tencent.com/qgpu-memory": str(memory_gib)}
    if core is not None:
        limits["tke.cloud.tencent.com/qgpu-core"] = str(core)
    return parse_pod({"metadata": {"name": "p", "namespace": "ns", "uid": "u", "annotations": annotations or {}},
                      "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]}})


def whole_cards(n: int):
    return parse_pod({"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
                      "spec": {"containers": [{"name": "c", "resources": {"limits": {
                          "tke.cloud.tencent.com/qgpu-core": str(100 * n)}}}]}})


def victims(eviction) -> list[str]:
    assert eviction is not None
    return sorted(v.key for v in eviction.victims)


def test_a_whole_card_pod_evicts_the_pods_of_one_card_where_node_level_arithmetic_would_evict_a_useless_one():
    """Card 0: A 30 % and B 30 %; card 1: C 50 %; a pod asks one whole card (100 %). kube-scheduler's
    reprieve (highest priority first: C, A, then B) keeps C and A and evicts B alone, which frees no
    card. At card level the lowest-priority set that frees a card is A and B."""
    booked = {"A": on_card(0, 30), "B": on_card(0, 30), "C": on_card(1, 50)}
    cands = [candidate("A", booked["A"], 1), candidate("B", booked["B"], 0), candidate("C", booked["C"], 2)]
    assert victims(choose_victims(spec(), booked, cands, whole_cards(1), BINPACK)) == ["A", "B"]


def test_at_equal_priority_the_fewest_pods_that_free_room_are_evicted():
    """Card 0: two pods of 40 %; card 1: one pod of 70 %; a 50 % pod fits once card 1 is free (one
    eviction) or once one 40 % pod leaves card 0 (one eviction, less freed): the 40 % one."""
    booked = {"A": on_card(0, 40), "B": on_card(0, 40), "C": on_card(1, 70)}
    cands = [candidate(k, p) for k, p in booked.items()]
    chosen = choose_victims(spec(), booked, cands, request(50), BINPACK)
    assert len(victims(chosen)) == 1 and victims(chosen)[0] in {"A", "B"}


def test_offline_pods_go_before_online_pods_of_equal_priority():
    """Both cards' memory is nearly taken, one by an online pod, one by an offline pod."""
    booked = {"on": on_card(0, 0, AppClass.ONLINE, memory_mib=30000),
              "off": on_card(1, 0, AppClass.OFFLINE, memory_mib=30000)}
    cands = [candidate(k, p) for k, p in booked.items()]
    node = NodeSpec("a", 32000, 131072, spec().cards, {"mixed-qgpu-enable": "enable"})
    online = request(None, {"tke.cloud.tencent.com/app-class": "online"}, memory_gib=8)
    assert victims(choose_victims(node, booked, cands, online, BINPACK)) == ["off"]


def test_two_offline_pods_go_before_one_online_pod_of_equal_priority():
    booked = {"on": on_card(0, 80, AppClass.ONLINE), "off1": on_card(1, 40, AppClass.OFFLINE),
              "off2": on_card(1, 40, AppClass.OFFLINE)}
    cands = [candidate(k, p) for k, p in booked.items()]
    assert victims(choose_victims(spec(), booked, cands, request(70), BINPACK)) == ["off1", "off2"]


def test_a_lower_priority_pod_goes_before_one_of_higher_priority_even_if_that_frees_more():
    booked = {"low": on_card(0, 60), "high": on_card(1, 60)}
    cands = [candidate("low", booked["low"], 1), candidate("high", booked["high"], 5)]
    assert victims(choose_victims(spec(), booked, cands, request(50), BINPACK)) == ["low"]


def test_pods_that_are_not_candidates_are_never_evicted():
    """Only the candidates (the caller passes the lower-priority pods) can be named: if evicting
    them is not enough, there is no answer."""
    booked = {"mine": on_card(0, 60), "theirs": on_card(1, 60)}
    assert choose_victims(spec(), booked, [candidate("mine", booked["mine"])], whole_cards(2), BINPACK) is None
    assert victims(choose_victims(spec(), booked, [candidate("mine", booked["mine"])], whole_cards(1), BINPACK)) == ["mine"]


def test_a_two_card_pod_needs_two_whole_cards_freed():
    booked = {"A": on_card(0, 10), "B": on_card(1, 10), "C": on_card(2, 10)}
    cands = [candidate("A", booked["A"], 0), candidate("B", booked["B"], 1), candidate("C", booked["C"], 2)]
    assert victims(choose_victims(spec(3), booked, cands, whole_cards(2), BINPACK)) == ["A", "B"]


def test_a_pod_that_fits_already_needs_no_victims_and_a_model_it_refuses_has_no_answer():
    booked = {"A": on_card(0, 90)}
    assert choose_victims(spec(), booked, [candidate("A", booked["A"])], request(50), BINPACK).victims == ()
    wants_t4 = request(50, {"qgpu.io/gpu-model": "T4"})
    assert choose_victims(spec(), booked, [candidate("A", booked["A"])], wants_t4, BINPACK) is None


def test_the_state_handed_in_is_never_changed():
    booked = {"A": on_card(0, 60), "B": on_card(1, 60)}
    before = dict(booked)
    choose_victims(spec(), booked, [candidate(k, p) for k, p in booked.items()], whole_cards(2), BINPACK)
    assert booked == before


def test_with_the_budget_spent_every_node_still_gets_the_first_orders_answer():
    from qgpu_runtime.placement.preemption import FitBudget

    booked = {"A": on_card(0, 30), "B": on_card(0, 30), "C": on_card(1, 50)}
    cands = [candidate("A", booked["A"], 1), candidate("B", booked["B"], 0), candidate("C", booked["C"], 2)]
    spent = FitBudget(0)
    assert victims(choose_victims(spec(), booked, cands, whole_cards(1), BINPACK, budget=spent)) == ["A", "B"]
    assert spent.left < 0  # counted, but never stopped the first order


def test_a_set_that_violates_no_disruption_budget_beats_a_smaller_one_that_does():
    """Card 0: A 100 %; card 1: B 50 % and C 50 %, all of one priority; a whole-card pod. Without
    budgets A alone goes (fewest pods); with A protected, B and C go (no violation first, as
    kube-scheduler ranks); with all three protected, A alone again, one violation counted."""
    booked = {"A": on_card(0, 100), "B": on_card(1, 50), "C": on_card(1, 50)}

    def choose(protected: set[str]):
        cands = [Candidate(k, f"uid-{k}", 0, p, violating=k in protected) for k, p in booked.items()]
        return choose_victims(spec(), booked, cands, whole_cards(1), BINPACK)

    assert victims(choose(set())) == ["A"]
    assert victims(choose({"A"})) == ["B", "C"] and choose({"A"}).pdb_violations == 0
    assert victims(choose({"A", "B", "C"})) == ["A"] and choose({"A", "B", "C"}).pdb_violations == 1
