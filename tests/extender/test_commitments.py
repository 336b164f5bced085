"""The per-node commitment document: format, fit check and pruning (pure, no API)."""

from __future__ import annotations

import pytest

from qgpu_runtime.contract.leases import CardUse, Commitment, CommitmentError, NodeCommitments, parse_commitments
from qgpu_runtime.contract.observed import FirstSeen
from qgpu_runtime.placement.commitments import PodFate, observed, over_commitment, stale
from qgpu_runtime.placement.state import CardShare, ContainerPlacement, Placement
from tests.recordkeys import SIGNER, VERIFIER

CAPACITY = {0: 16384, 1: 16384}  # two 16 GiB cards


def use(uid: str, *cards: tuple[int, int, int], exclusive: bool = False, since: int = 0) -> Commitment:
    return Commitment(uid, f"ns/{uid}", since, tuple(CardUse(i, c, m, exclusive) for i, c, m in cards))


def test_a_placement_commits_its_shares_summed_per_card():
    placement = Placement("n", (
        ContainerPlacement("a", (CardShare(0, "u0", 300, 4096),)),
        ContainerPlacement("b", (CardShare(0, "u0", 200, 1024), CardShare(1, "u1", 100, 512))),
    ))
    c = Commitment.of("uid-1", "ns/p", placement, now_ns=7)
    assert c.cards == (CardUse(0, 500, 5120), CardUse(1, 100, 512))
    assert c.since_ns == 7


def test_the_document_round_trips():
    doc = NodeCommitments("gpu-1").with_pod(use("a", (0, 300, 4096))).with_pod(use("b", (1, 1000, 16384), exclusive=True))
    assert parse_commitments(doc.to_json(), "gpu-1") == doc


def test_no_annotation_means_nothing_committed():
    assert parse_commitments(None, "gpu-1").pods == {}
    assert parse_commitments("", "gpu-1").pods == {}


@pytest.mark.parametrize("raw, words", [
    ("[1]", "must be a JSON object"),
    ('{"version": 2, "node": "gpu-1", "pods": {}}', "version=2"),
    ('{"version": 1, "node": "gpu-2", "pods": {}}', "node='gpu-2'"),
    ('{"version": 1, "node": "gpu-1", "pods": []}', "pods=[]: must be an object"),
    ('{"version": 1, "node": "gpu-1", "pods": {"u": {"pod": "a/b", "since_ns": 0, "cards": [{"index": 0, '
     '"core_milli": 1001, "memory_mib": 1}]}}}', "core_milli=1001: must be within 0..1000"),
    ('{"version": 1, "node": "gpu-1", "pods": {"u": {"pod": "a/b", "since_ns": 0, "cards": [{"index": "0", '
     '"core_milli": 1, "memory_mib": 1}]}}}', "index='0': must be an integer"),
    ('{"version": 1, "node": "gpu-1", "pods": {"u": {"pod": "a/b", "since_ns": 0, "cards": [{"index": 0, '
     '"core_milli": 1, "memory_mib": -1}]}}}', "memory_mib=-1: must be within 0..1048576"),
    ('{"version": 1, "node": "gpu-1", "pods": {"u": {"pod": "a/b", "since_ns": 0, "cards": [{"index": 0, '
     '"core_milli": 1, "memory_mib": 18446744073709551616}]}}}', "memory_mib=18446744073709551616: must be within 0..1048576"),
    ('{"version": 1, "node": "gpu-1", "pods": {"u": {"pod": "a/b", "since_ns": 0, "cards": [{"index": 4096, '
     '"core_milli": 1, "memory_mib": 1}]}}}', "index=4096: must be within 0..255"),
    ('{"version": 1, "node": "gpu-1", "pods": {"u": {"pod": "a/b", "since_ns": 18446744073709551616, "cards": []}}}',
     "since_ns=18446744073709551616: must be within"),
])
def test_a_malformed_document_is_refused_naming_field_and_rule(raw, words):
    with pytest.raises(CommitmentError, match="qgpu.io/commitments") as info:
        parse_commitments(raw, "gpu-1")
    assert words in str(info.value)


def test_a_share_that_fits_beside_the_held_ones_passes():
    held = [use("a", (0, 500, 8192)), use("b", (0, 300, 4096))]
    assert over_commitment(CAPACITY, held, use("new", (0, 200, 4096))) == []


def test_core_beyond_the_whole_card_is_refused():
    held = [use("a", (0, 600, 1024))]
    (problem,) = over_commitment(CAPACITY, held, use("new", (0, 500, 1024)))
    assert problem == "card 0: core 1100‰ committed > 1000‰"


def test_memory_beyond_the_card_is_refused():
    held = [use("a", (1, 100, 12288))]
    (problem,) = over_commitment(CAPACITY, held, use("new", (1, 100, 8192)))
    assert problem == "card 1: memory 20480 MiB committed > 16384 MiB"


def test_the_same_pod_from_the_lease_and_from_its_record_counts_once():
    record_and_lease = [use("a", (0, 600, 8192)), use("a", (0, 600, 8192))]
    assert over_commitment(CAPACITY, record_and_lease, use("new", (0, 400, 8192))) == []


def test_the_first_view_of_a_pod_counts_so_records_listed_first_win_over_a_stale_entry():
    record = use("a", (1, 600, 8192))  # where the pod is bound
    stale_entry = use("a", (0, 600, 8192))  # a losing binder's choice for the same pod
    assert over_commitment(CAPACITY, [record, stale_entry], use("new", (0, 1000, 16384))) == []
    assert over_commitment(CAPACITY, [record, stale_entry], use("new", (1, 500, 1024))) == [
        "card 1: core 1100‰ committed > 1000‰"]


def test_the_pods_own_earlier_entry_does_not_count_against_it():
    assert over_commitment(CAPACITY, [use("new", (0, 1000, 16384))], use("new", (0, 1000, 16384))) == []


def test_a_card_taken_whole_shares_with_nobody_and_a_shared_card_cannot_be_taken_whole():
    whole = use("a", (0, 1000, 16384), exclusive=True)
    assert over_commitment(CAPACITY, [whole], use("new", (0, 0, 0))) == ["card 0: taken whole by another pod"]
    assert over_commitment(CAPACITY, [use("b", (1, 10, 10))], use("new", (1, 1000, 16384), exclusive=True)) == [
        "card 1: cannot be taken whole, 1 other pod(s) hold part of it"]


def test_a_card_the_node_does_not_have_is_refused():
    assert over_commitment(CAPACITY, [], use("new", (7, 10, 10))) == ["card 7: the node has no such card"]


def test_gone_and_elsewhere_pods_are_pruned_at_once_pending_ones_after_the_grace():
    doc = NodeCommitments("n", {c.uid: c for c in [
        use("gone", (0, 1, 1), since=1000), use("moved", (0, 1, 1), since=1000), use("here", (0, 1, 1), since=0),
        use("young", (0, 1, 1), since=900), use("old", (0, 1, 1), since=0), use("unseen-old", (0, 1, 1), since=0),
        use("just-seen", (0, 1, 1), since=0)]})
    fates = {"gone": PodFate.GONE, "moved": PodFate.BOUND_ELSEWHERE, "here": PodFate.BOUND_HERE,
             "young": PodFate.PENDING, "old": PodFate.PENDING}
    ages = {"gone": 0, "moved": 0, "here": 10**12, "young": 100, "old": 500, "unseen-old": 600}
    assert stale(doc, fates, ages, grace_ns=500) == ["gone", "moved", "old", "unseen-old"]


def test_a_bound_pod_keeps_its_entry_however_old():
    doc = NodeCommitments("n", {"a": use("a", (0, 1, 1), since=0)})
    assert stale(doc, {"a": PodFate.BOUND_HERE}, {"a": 10**18}, grace_ns=1) == []


def test_the_writers_stamp_decides_nothing_only_how_long_this_binder_watched_the_entry():
    """Issue 21 §6: an entry stamped in the future (its writer's clock ahead) was never pruned, and
    one stamped long ago (a clock behind) was pruned on sight."""
    doc = NodeCommitments("n", {"future": use("future", (0, 1, 1), since=2**62), "past": use("past", (0, 1, 1), since=0)})
    seen = FirstSeen()
    assert stale(doc, {}, seen.ages("n", observed(doc), 0), grace_ns=60) == []
    assert stale(doc, {}, seen.ages("n", observed(doc), 59), grace_ns=60) == []
    assert stale(doc, {}, seen.ages("n", observed(doc), 60), grace_ns=60) == ["future", "past"]


def test_an_entry_written_again_is_watched_afresh():
    seen = FirstSeen()
    first = NodeCommitments("n", {"a": use("a", (0, 1, 1), since=5)})
    seen.ages("n", observed(first), 0)
    again = NodeCommitments("n", {"a": use("a", (0, 2, 2), since=5)})
    assert seen.ages("n", observed(again), 100) == {"a": 0}
    assert seen.ages("n", observed(again), 160) == {"a": 60}


def test_the_extender_refuses_to_bind_before_its_caches_are_synced():
    """kube-scheduler calls before /readyz: a bind then would choose cards without the pods'
    records and prune the commitments of pods not listed yet (seen as an over-commit after a
    kill -9 and restart)."""
    from kubernetes import client

    from qgpu_runtime.extender.app import ExtenderApp
    from qgpu_runtime.extender.binder import Binder
    from qgpu_runtime.extender.cache import AllocationCache
    from qgpu_runtime.model.requests import DEFAULT_LIMITS
    from qgpu_runtime.placement.policies import make_policy

    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    app = ExtenderApp(cache, Binder(client.CoreV1Api(client.ApiClient()), cache, DEFAULT_LIMITS, signer=SIGNER), DEFAULT_LIMITS)
    body = b'{"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "a"}'
    status, doc = app.handle("bind", body)
    assert status == 200 and "not synced yet" in doc["Error"]


def test_a_commitment_write_that_landed_while_its_answer_was_lost_is_taken_for_this_binders_own():
    """The Lease write lands, its answer is lost, the retry comes back 409 (a CommitmentConflict).
    The fresh read then holds this bind's own entry, which was taken for another binder's (not yet
    remembered as written): every retry refused the pod, and the phantom entry held its cards for
    every binder until the grace ended (helper audit, 2026-12-01). Now the pod is bound."""
    import time as _time

    from qgpu_runtime.extender.bindchoice import BindChoice
    from qgpu_runtime.extender.commitments import CommitmentConflict, Snapshot
    from qgpu_runtime.model.requests import parse_pod
    from tests.extender.test_kube_cache import cache, pod

    class LandsThenConflicts:
        """A node's Lease whose first write is stored but answered 409 (the retry's answer)."""

        def __init__(self) -> None:
            self.doc: NodeCommitments = NodeCommitments("a")
            self.version = 1
            self.writes = 0

        def read(self, node: str) -> Snapshot:
            return Snapshot(self.doc, str(self.version))

        read_fresh = read

        def write(self, snapshot: Snapshot, commitments: NodeCommitments) -> None:
            if snapshot.resource_version != str(self.version):
                raise CommitmentConflict("changed")
            self.writes += 1
            self.doc, self.version = commitments, self.version + 1
            if self.writes == 1:
                raise CommitmentConflict("the retry of a write that landed")

    lease = LandsThenConflicts()
    c = cache()
    choice = BindChoice(c, lease, _time.time_ns, commit_attempts=3, commitment_grace_ns=60 * 10**9,
                        on_conflict=lambda: None, monotonic_ns=_time.monotonic_ns)  # type: ignore[arg-type]
    p = pod("p")
    record, _, committed = choice.choose(p, parse_pod(p), "a")
    assert committed and record.node == "a"
    assert list(lease.doc.pods) == ["uid-p"] and lease.writes == 2  # the entry rewritten, not refused
