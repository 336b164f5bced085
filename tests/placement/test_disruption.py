"""PodDisruptionBudgets as preemption reads them (placement/disruption.py): the selector, the
split of candidates into protected and not, as kube-scheduler's filterPodsWithPDBViolation."""

from __future__ import annotations

import pytest

from qgpu_runtime.placement.disruption import (
    MAX_TERM_VALUES,
    PodLabels,
    SelectorError,
    budget_of,
    parse_selector,
    violating,
)


def pdb(selector, allowed=0, namespace="ns", name="b", disrupted=None) -> dict:
    return {"metadata": {"namespace": namespace, "name": name}, "spec": {"selector": selector},
            "status": {"disruptionsAllowed": allowed, "disruptedPods": disrupted or {}}}


def pods(*specs: tuple[str, dict]) -> list[PodLabels]:
    return [PodLabels(f"ns/{name}", labels) for name, labels in specs]


@pytest.mark.parametrize("selector,labels,expected", [
    ({"matchLabels": {"app": "a"}}, {"app": "a", "x": "1"}, True),
    ({"matchLabels": {"app": "a"}}, {"app": "b"}, False),
    ({"matchExpressions": [{"key": "app", "operator": "In", "values": ["a", "b"]}]}, {"app": "b"}, True),
    ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["a"]}]}, {"app": "b"}, True),
    ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["a"]}]}, {"x": "1"}, True),
    ({"matchExpressions": [{"key": "app", "operator": "Exists"}]}, {"app": ""}, True),
    ({"matchExpressions": [{"key": "app", "operator": "DoesNotExist"}]}, {"app": "a"}, False),
    ({"matchLabels": {"app": "a"}, "matchExpressions": [{"key": "t", "operator": "Exists"}]}, {"app": "a"}, False),
    ({}, {"app": "a"}, False),  # an empty selector matches nothing
    (None, {"app": "a"}, False),
    ({"matchLabels": {"app": "a"}}, {}, False),  # a pod without labels matches nothing
])
def test_selector_matching(selector, labels, expected):
    b = budget_of(pdb(selector))
    assert b.matches("ns", labels) is expected
    assert not b.matches("other", labels)


@pytest.mark.parametrize("selector,field", [
    ("app=a", "selector: str"),
    ({"matchLabels": {"app": 1}}, "selector.matchLabels['app']=1"),
    ({"matchExpressions": [{"key": "", "operator": "In", "values": ["a"]}]}, "selector.matchExpressions[0].key=''"),
    ({"matchExpressions": [{"key": "k", "operator": "Gt", "values": ["1"]}]}, "selector.matchExpressions[0].operator='Gt'"),
    ({"matchExpressions": [{"key": "k", "operator": "In"}]}, "In needs at least one value"),
    ({"matchExpressions": [{"key": "k", "operator": "Exists", "values": ["a"]}]}, "Exists takes no values"),
    ({"matchExpressions": [{"key": "k", "operator": "In", "values": ["v"] * (MAX_TERM_VALUES + 1)}]}, "at most"),
    ({"matchExpressions": [{"key": f"k{i}", "operator": "In", "values": [f"v{j}" for j in range(MAX_TERM_VALUES // 2)]}
                           for i in range(3)]}, "selector.matchExpressions[2].values: 384 values in the selector's terms so far"),
])
def test_an_unreadable_selector_is_named_and_matches_nothing(selector, field):
    with pytest.raises(SelectorError, match="^" + field.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       if field.startswith("selector") else field):
        parse_selector(selector)
    assert not budget_of(pdb(selector)).matches("ns", {"app": "a", "k": "v"})


def test_the_allowance_goes_to_the_most_valuable_first():
    """Allowed 1: the first candidate (most valuable) takes it, the next overdraw it."""
    b = budget_of(pdb({"matchLabels": {"app": "a"}}, allowed=1))
    assert violating(pods(("p1", {"app": "a"}), ("p2", {"app": "a"}), ("p3", {"app": "a"})), [b]) == {"ns/p2", "ns/p3"}
    assert violating(pods(("p1", {"app": "a"})), [b]) == frozenset()


def test_disrupted_pods_and_other_namespaces_count_against_nothing():
    b = budget_of(pdb({"matchLabels": {"app": "a"}}, allowed=0, disrupted={"p1": "2026-11-28T00:00:00Z"}))
    other = budget_of(pdb({"matchLabels": {"app": "a"}}, allowed=0, namespace="other", name="o"))
    assert violating(pods(("p1", {"app": "a"}), ("p2", {"app": "a"})), [b, other]) == {"ns/p2"}


def test_any_overdrawn_budget_makes_a_pod_violating_and_a_missing_status_reads_zero():
    roomy = budget_of(pdb({"matchLabels": {"app": "a"}}, allowed=5, name="roomy"))
    fresh = budget_of({"metadata": {"namespace": "ns", "name": "fresh"},
                       "spec": {"selector": {"matchLabels": {"tier": "db"}}}})
    assert fresh.allowed == 0
    assert violating(pods(("p1", {"app": "a"}), ("p2", {"app": "a", "tier": "db"})), [roomy, fresh]) == {"ns/p2"}
