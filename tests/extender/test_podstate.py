"""The per-pod booking state (extender/podstate.py): one object per pod, gone when empty, and the
authorization count the hold cap reads stays exact through every transition."""

from __future__ import annotations

from qgpu_runtime.extender.podstate import BindAuthorization, PodEntry, PodStates


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
    allowed = BindAuthorization("u1", frozenset({"n1"}), 1)
    pods.authorize("ns/a", allowed)
    pods.authorize("ns/a", BindAuthorization("u1", frozenset({"n2"}), 2))  # a re-filter replaces, not adds
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
