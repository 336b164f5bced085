"""extender/v1 wire format: Go field names, both node forms, clear errors for bad bodies."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qgpu_runtime.extender.wire import (
    BindingArgs,
    ExtenderArgs,
    FilterResult,
    WireError,
    encode_priorities_json,
)

POD = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": []}}


def test_node_names_form_is_decoded_and_echoed_as_node_names():
    args = ExtenderArgs.decode(json.dumps({"Pod": POD, "Nodes": None, "NodeNames": ["a", "b"]}))
    assert args.names == ["a", "b"] and args.nodes is None
    doc = FilterResult(["b"], {"a": "full"}, {}).encode(args)
    assert doc == {"Nodes": None, "NodeNames": ["b"], "FailedNodes": {"a": "full"}, "FailedAndUnresolvableNodes": {}, "Error": ""}


def test_full_node_form_is_decoded_and_echoed_as_a_node_list_of_the_passing_nodes():
    nodes = {"items": [{"metadata": {"name": "a"}}, {"metadata": {"name": "b"}, "status": {"x": 1}}]}
    args = ExtenderArgs.decode(json.dumps({"Pod": POD, "Nodes": nodes}))
    assert args.names == ["a", "b"]
    doc = FilterResult(["b"], {}, {"a": "no GPUs"}).encode(args)
    assert doc["NodeNames"] is None
    assert doc["Nodes"]["items"] == [{"metadata": {"name": "b"}, "status": {"x": 1}}]
    assert doc["FailedAndUnresolvableNodes"] == {"a": "no GPUs"}


def test_keys_match_case_insensitively_like_go():
    args = ExtenderArgs.decode(json.dumps({"pod": POD, "nodenames": ["x"]}))
    assert args.names == ["x"]


@pytest.mark.parametrize("body, field", [
    (b"{not json", "not JSON"),
    (b"[1,2]", "JSON list"),
    (json.dumps({"Pod": "x", "NodeNames": []}), "ExtenderArgs.Pod"),
    (json.dumps({"Pod": POD}), "neither Nodes nor NodeNames"),
    (json.dumps({"Pod": POD, "NodeNames": [1]}), "NodeNames"),
    (json.dumps({"Pod": POD, "Nodes": {"items": [{}]}}), "Nodes.items"),
])
def test_malformed_args_name_the_field(body, field):
    with pytest.raises(WireError, match=field):
        ExtenderArgs.decode(body)


def test_priorities_are_a_bare_array_clamped_to_0_10_without_the_hosts_scoring_0():
    assert json.loads(encode_priorities_json(["a", "b", "c", "d"], [12, -1, 7, 0])) == [
        {"Host": "a", "Score": 10}, {"Host": "c", "Score": 7}]
    assert encode_priorities_json(["a", "b"], [0, 0]) == b"[]" and encode_priorities_json([], []) == b"[]"


def _kube_scheduler_totals(nodes: list[str], plugin: dict[str, int], answer: list[dict], weight: int) -> dict[str, int]:
    """prioritizeNodes of pkg/scheduler/schedule_one.go restated: each listed host's extender score
    times weight times MaxNodeScore / MaxExtenderPriority is added to that node's total; a node the
    answer does not list gets nothing added."""
    extender: dict[str, int] = {}
    for entry in answer:
        extender[entry["Host"]] = extender.get(entry["Host"], 0) + entry["Score"] * weight * (100 // 10)
    return {n: plugin[n] + extender.get(n, 0) for n in nodes}


@given(st.lists(st.tuples(st.integers(0, 100), st.integers(-2, 12)), min_size=1, max_size=40), st.integers(1, 10))
def test_leaving_out_the_hosts_scoring_0_gives_kube_scheduler_the_same_totals(rows, weight):
    nodes = [f"n{i}" for i in range(len(rows))]
    plugin = {n: p for n, (p, _) in zip(nodes, rows)}
    scores = [s for _, s in rows]
    full = [{"Host": n, "Score": max(0, min(10, s))} for n, s in zip(nodes, scores)]
    assert (_kube_scheduler_totals(nodes, plugin, json.loads(encode_priorities_json(nodes, scores)), weight)
            == _kube_scheduler_totals(nodes, plugin, full, weight))


def test_binding_args_need_pod_name_and_node():
    args = BindingArgs.decode(json.dumps({"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "n"}))
    assert args == BindingArgs("p", "ns", "u", "n")
    with pytest.raises(WireError, match="Node is empty"):
        BindingArgs.decode(json.dumps({"PodName": "p"}))
    with pytest.raises(WireError, match="PodUID"):
        BindingArgs.decode(json.dumps({"PodName": "p", "Node": "n", "PodUID": 5}))


@given(st.lists(st.tuples(st.text(), st.integers(-5, 20))))
def test_priorities_as_json_bytes_equal_the_dict_form_for_any_host_name(pairs):
    """The hot-path encoder (no per-host dicts) says exactly what json.dumps of the dict form would,
    for any names: quotes, backslashes, control characters and non-ASCII included."""
    names = [n for n, _ in pairs]
    scores = [s for _, s in pairs]
    want = [{"Host": n, "Score": max(0, min(10, s))} for n, s in pairs if s > 0]
    assert json.loads(encode_priorities_json(names, scores)) == want
