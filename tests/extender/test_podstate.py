"""The per-pod booking state (extender/podstate.py): one object per pod, gone when empty, and the
authorization count the hold cap reads stays exact through every transition."""

from __future__ import annotations

import gc

from qgpu_runtime.extender.podstate import BindAuthorization, NodeNameSet, PodEntry, PodStates


def _entry(key="ns/a", uid="u1", node="", record=None):
    return PodEntry(key, uid, node, record, None, False, 0, 0)


def test_a_pod_with_nothing_left_is_forgotten():
    pods = PodStates()
    pods.set_entry(_entry())
    pods.hold("ns/a", 5)
    pods.pin("ns/a", "{}")
    pods.drop_entry("ns/a")
    pods.unhold("ns/a")
    assert len(pods) == 1 and pods.pinned("ns/a") == "{}"
    pods.unpin("ns/a")
    assert len(pods) == 0 and pods.get("ns/a") is None


def test_the_authorized_count_follows_authorize_and_deauthorize():
    pods = PodStates()
    allowed = BindAuthorization("u1", NodeNameSet(["n1"]), 1)
    pods.authorize("ns/a", allowed)
    pods.authorize("ns/a", BindAuthorization("u1", NodeNameSet(["n2"]), 2))  # a re-filter replaces, not adds
    pods.authorize("ns/b", allowed)
    assert pods.authorized_count() == 2
    pods.deauthorize("ns/a")
    pods.deauthorize("ns/a")  # twice is harmless
    assert pods.authorized_count() == 1
    assert [k for k, _ in pods.authorizations()] == ["ns/b"]


def test_holds_are_listed_with_their_start_and_released_one_by_one():
    pods = PodStates()
    pods.hold("ns/a", 10)
    pods.hold("ns/b", 20)
    assert sorted(pods.holds()) == [("ns/a", 10), ("ns/b", 20)]
    pods.unhold("ns/a")
    assert pods.holds() == [("ns/b", 20)] and not pods.held("ns/a") and pods.held("ns/b")


def test_a_stale_record_is_remembered_until_cleared_and_entries_list_only_seen_pods():
    pods = PodStates()
    pods.mark_stale("ns/a", "rec")
    pods.set_entry(_entry("ns/b"))
    assert pods.stale("ns/a") == "rec" and [e.key for e in pods.entries()] == ["ns/b"]
    pods.clear_stale("ns/a")
    assert pods.get("ns/a") is None


def test_node_name_set_answers_exact_membership_only():
    names = NodeNameSet(["node-1", "node-10", "a.b", ""])
    assert "node-1" in names and "node-10" in names and "a.b" in names and "" in names
    for other in ("node", "node-", "ode-1", "node-100", "node-1\nnode-10", "a", "b", "a.b.", 1, None):
        assert other not in names, other
    assert len(names) == 4 and sorted(names) == ["", "a.b", "node-1", "node-10"]
    assert "" not in NodeNameSet(["x"]) and list(NodeNameSet([])) == [] and "" not in NodeNameSet([])


def test_a_name_holding_the_separator_is_never_a_member_nor_splits_into_members():
    names = NodeNameSet(["n1\nn2", "n3"])
    assert "n1" not in names and "n2" not in names and "n1\nn2" not in names and "n3" in names
    assert len(names) == 1


def test_an_authorization_for_thousands_of_nodes_gives_the_cycle_collector_nothing_to_walk():
    # what each pending pod keeps until its bind: before, a 5,000-name frozenset that every
    # collection traversed slot by slot (issue 14 §2)
    allowed = NodeNameSet(f"node-{i:05d}" for i in range(5000))
    referents = [r for r in gc.get_referents(allowed) if not isinstance(r, type)]
    assert len(referents) <= 2 and not any(gc.is_tracked(r) for r in referents)
    assert len(gc.get_referents(frozenset(allowed))) == 5000  # what the test would see of the old form
    assert "node-04999" in allowed and "node-05000" not in allowed
