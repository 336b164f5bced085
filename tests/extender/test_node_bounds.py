"""One node's data can hurt only that node (issue 21 §4): an inventory or a capacity out of bounds
takes that node out of placement with its reason, and every other node still gets a decision.

Before: ``memory_mib: 2**64`` on one node made every filter a 500 (int64 overflow when the
cache's arrays were built), and an allocatable CPU near the quantity cap did the same."""

from __future__ import annotations

import json

import pytest

from qgpu_runtime.contract.inventory import MAX_CARDS
from qgpu_runtime.extender.app import ExtenderApp
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.placement.policies import make_policy
from tests.extender.test_kube_cache import node, pod
from tests.recordkeys import VERIFIER


def _raw_node(name: str, raw: str, cpu: str = "32") -> dict:
    return {"metadata": {"name": name, "annotations": {"qgpu.io/gpus": raw}},
            "status": {"allocatable": {"cpu": cpu, "memory": "128Gi"}}}


def _card(i: int, memory_mib: int = 32768) -> dict:
    return {"index": i, "uuid": f"GPU-bad-{i}", "model": "V100", "memory_mib": memory_mib}


HOSTILE = {
    "memory 2**64": (_raw_node("bad", json.dumps([_card(0, 2**64)])), "memory_mib=18446744073709551616"),
    "3,500 cards": (_raw_node("bad", json.dumps([_card(i) for i in range(3500)])), "274280 characters"),
    "17 cards": (_raw_node("bad", json.dumps([{**_card(i), "uuid": "U"} for i in range(17)])), "lists 17 cards"),
    "cpu near int64": (_raw_node("bad", json.dumps([_card(0)]), cpu=str(2**62)), "status.allocatable.cpu="),
}


def _filter(app: ExtenderApp, names: list[str]) -> tuple[int, dict]:
    body = {"Pod": pod("p"), "NodeNames": names}
    return app.handle("filter", json.dumps(body).encode())


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_node_is_refused_with_its_reason_and_others_still_get_decisions(case: str) -> None:
    hostile, words = HOSTILE[case]
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([node("a"), hostile, node("b", n_cards=1)])
    cache.replace_pods([pod("p")])
    app = ExtenderApp(cache, None, DEFAULT_LIMITS)
    status, doc = _filter(app, ["a", "bad", "b"])
    assert status == 200, doc
    assert doc["NodeNames"] == ["a", "b"] and doc["Error"] == ""
    reason = doc["FailedAndUnresolvableNodes"]["bad"]
    assert reason.startswith("qgpu refused this node's data: node bad: ") and words in reason
    status, ranked = app.handle("prioritize", json.dumps({"Pod": pod("p"), "NodeNames": ["a", "b"]}).encode())
    assert status == 200 and ranked


def test_a_node_that_fixes_its_inventory_is_placed_again() -> None:
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([HOSTILE["memory 2**64"][0]])
    cache.replace_pods([pod("p")])
    app = ExtenderApp(cache, None, DEFAULT_LIMITS)
    assert "bad" in _filter(app, ["bad"])[1]["FailedAndUnresolvableNodes"]
    cache.apply_node("MODIFIED", _raw_node("bad", json.dumps([_card(0)])))
    assert _filter(app, ["bad"])[1]["NodeNames"] == ["bad"]


def test_the_cache_keeps_at_most_the_card_bound_per_node() -> None:
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([node("a"), HOSTILE["3,500 cards"][0]])
    state = cache.state()
    assert state.max_cards <= MAX_CARDS and int(state.n_cards.sum()) == 2


def test_a_hostile_resource_slice_leaves_only_its_node_out_of_dra_scoring() -> None:
    from qgpu_runtime.extender.dra import Ask
    from tests.extender.test_dra_prioritize import NO_GPU, rslice, view

    huge = rslice("huge", cards=1)
    huge["spec"]["devices"][0]["capacity"]["memory"]["value"] = str(2**64)
    repeated = rslice("repeated", cards=2)
    repeated["spec"]["devices"][1]["attributes"]["index"]["int"] = 0
    many = rslice("many", cards=MAX_CARDS + 1)
    v = view("node-a")
    for hostile in (huge, repeated, many):
        v.apply_slice("ADDED", hostile)
    scores = v.scores([Ask(250, 4096)], NO_GPU, ["node-a", "huge", "repeated", "many"], make_policy("binpack"))
    assert scores.tolist() == [10, 0, 0, 0]


def test_the_cache_keeps_only_the_labels_placement_reads() -> None:
    from qgpu_runtime.extender.nodes import READ_LABELS, node_spec

    many = node("a")
    many["metadata"]["labels"] = {**{f"example.com/l{i}": "x" * 63 for i in range(5000)},
                                  "mixed-qgpu-enable": "enable", "qgpu.io/pool-mode": "dra"}
    spec = node_spec(many)
    assert dict(spec.labels) == {"mixed-qgpu-enable": "enable", "qgpu.io/pool-mode": "dra"}
    assert set(spec.labels) <= READ_LABELS


def test_a_whole_node_pod_is_refused_a_node_of_more_cards_than_it_is_charged_for() -> None:
    """Issue F3: the pod quota charges a whole-node pod the most cards one pod may take (8); the
    inventory admits nodes of up to 16, and a filter used to pass such a node and grant all 16."""
    xgn = {"sched.tensorstack.dev/node-alloc-mode": "xgn"}
    hgx, dgx = node("hgx", n_cards=MAX_CARDS), node("dgx", n_cards=8)
    for doc in (hgx, dgx):
        doc["metadata"]["labels"] = xgn
    whole_node = {**pod("w"), "spec": {"containers": [{"name": "c", "resources": {"limits": {"tensorstack.dev/nvidia-gpu-node": "1"}}}]}}
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([hgx, dgx])
    cache.replace_pods([whole_node])
    app = ExtenderApp(cache, None, DEFAULT_LIMITS)
    status, doc = app.handle("filter", json.dumps({"Pod": whole_node, "NodeNames": ["hgx", "dgx"]}).encode())
    assert status == 200 and doc["NodeNames"] == ["dgx"], doc
    assert doc["FailedAndUnresolvableNodes"] == {
        "hgx": f"the whole node has {MAX_CARDS} cards and one pod may take at most 8 (CardLimits.max_cards_per_node)"}
