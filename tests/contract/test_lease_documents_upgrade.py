"""Version skew on the two Lease documents across issue 24's move into contract/leases.py.

During a rolling upgrade extenders (node commitments) and webhook replicas (claim-quota ledger) of
the release before and of this one write the same Leases. The previous release's codecs are frozen
in previous_release/lease_documents_before_i24.py. Both directions are run: the old reader on what
the new writer writes, the new reader on what the old writer wrote; both writers write the same
bytes; both readers ignore the fields a later release may add, refuse the same broken documents and
treat entries another writer left (expired by its clock, or of pods this binder never saw) alike.
"""

from __future__ import annotations

import json

import pytest

from qgpu_runtime.contract import leases as new
from qgpu_runtime.contract.observed import FirstSeen
from qgpu_runtime.placement.commitments import PodFate, observed, stale
from qgpu_runtime.webhook.ledger import pending, stamps
from tests.contract.previous_release import lease_documents_before_i24 as old

NODE = "gpu-node-1"
SINCE = 1_732_000_000_000_000_000


def _new_commitments() -> new.NodeCommitments:
    return new.NodeCommitments(NODE, {
        "uid-1": new.Commitment("uid-1", "ns/p", SINCE, (new.CardUse(0, 300, 4096), new.CardUse(1, 1000, 16384, True))),
        "uid-2": new.Commitment("uid-2", "other/q", SINCE + 5, (new.CardUse(255, 0, 1 << 20),)),
        "uid-3": new.Commitment("uid-3", "ns/empty", 0, ()),
    })


def _as_old(doc: new.NodeCommitments) -> old.NodeCommitments:
    return old.NodeCommitments(doc.node, {uid: old.Commitment(c.uid, c.pod, c.since_ns, tuple(
        old.CardUse(u.index, u.core_milli, u.memory_mib, u.exclusive) for u in c.cards)) for uid, c in doc.pods.items()})


def _new_ledger() -> dict[str, new.Reservation]:
    return {"claim-a": new.Reservation(600, 1024, 1_732_000_030.5), "claim-b": new.Reservation(0, 2048, 1_732_000_031.0)}


def _as_old_ledger(entries: dict[str, new.Reservation]) -> dict[str, old.Reservation]:
    return {k: old.Reservation(r.core_milli, r.memory_mib, r.expires) for k, r in entries.items()}


def _with_unknown_fields(text: str, *paths: tuple[str, ...]) -> str:
    """``text`` with a field ``later`` added at the top and at each object named by ``paths``."""
    doc = json.loads(text)
    doc["later"] = {"added": "by a later release"}
    for path in paths:
        at = doc
        for key in path:
            at = at[int(key)] if isinstance(at, list) else at[key]
        at["later"] = 1
    return json.dumps(doc)


# --- node commitments -----------------------------------------------------------------------------

def test_the_previous_extender_reads_what_this_one_writes():
    doc = _new_commitments()
    assert old.parse_commitments(doc.to_json(), NODE) == _as_old(doc)


def test_this_extender_reads_what_the_previous_one_wrote():
    written = _as_old(_new_commitments()).to_json()
    assert new.parse_commitments(written, NODE) == _new_commitments()


def test_both_extenders_write_the_same_bytes_and_name_the_same_leases():
    assert _new_commitments().to_json() == _as_old(_new_commitments()).to_json()
    long_node = "n" * 300  # past a Lease name's 253 characters: both use the digest
    for node in (NODE, long_node, "x" * (253 - len("qgpu-node."))):
        assert new.lease_name(node) == old.lease_name(node)
    assert new.ledger_name("team-a") == old.ledger_name("team-a") == "qgpu-claim-quota.team-a"


def test_fields_a_later_release_adds_are_ignored_by_both_readers():
    text = _with_unknown_fields(_new_commitments().to_json(), ("pods", "uid-1"), ("pods", "uid-1", "cards", "0"))
    assert new.parse_commitments(text, NODE) == _new_commitments()
    assert old.parse_commitments(text, NODE) == _as_old(_new_commitments())


@pytest.mark.parametrize("text", [
    '{"version":2,"node":"gpu-node-1","pods":{}}',
    '{"version":1,"node":"gpu-node-2","pods":{}}',  # another node's document
    '{"version":1,"node":"gpu-node-1","pods":[]}',
    '{"version":1,"node":"gpu-node-1","pods":{"u":{"pod":"ns/p","since_ns":1,"cards":[{"index":256,"core_milli":1,"memory_mib":1}]}}}',
    '{"version":1,"node":"gpu-node-1","pods":{"u":{"pod":"ns/p","since_ns":1,"cards":[{"index":0,"core_milli":1001,"memory_mib":1}]}}}',
    '{"version":1,"node":"gpu-node-1","pods":{"u":{"pod":"ns/p","since_ns":-1,"cards":[]}}}',
    "not json",
])
def test_both_readers_refuse_the_same_broken_documents(text):
    with pytest.raises(new.CommitmentError) as now:
        new.parse_commitments(text, NODE)
    with pytest.raises(old.CommitmentError) as before:
        old.parse_commitments(text, NODE)
    assert str(now.value) == str(before.value)


def test_entries_of_other_binders_are_pruned_alike_by_both_releases_whatever_their_stamp():
    """A foreign entry (another binder's pod this cache never saw) and one whose writer's clock says
    it is long expired are kept until the pruning binder itself watched them for the grace; a pod
    gone or bound elsewhere goes at once. The writer's ``since_ns`` decides nothing in either."""
    doc = new.NodeCommitments(NODE, {
        "foreign": new.Commitment("foreign", "ns/f", SINCE, (new.CardUse(0, 100, 1024),)),
        "expired": new.Commitment("expired", "ns/e", 1, (new.CardUse(1, 100, 1024),)),  # stamped in 1970
        "gone": new.Commitment("gone", "ns/g", SINCE, (new.CardUse(0, 100, 1024),)),
        "here": new.Commitment("here", "ns/h", 1, (new.CardUse(1, 100, 1024),)),
    })
    read_new, read_old = new.parse_commitments(doc.to_json(), NODE), old.parse_commitments(doc.to_json(), NODE)
    fates_new = {"gone": PodFate.GONE, "here": PodFate.BOUND_HERE}
    fates_old = {"gone": old.PodFate.GONE, "here": old.PodFate.BOUND_HERE}
    grace = 30_000_000_000
    for now_ns, expected in ((0, ["gone"]), (grace - 1, ["gone"]), (grace, ["expired", "foreign", "gone"])):
        seen_new, seen_old = FirstSeen(), FirstSeen()
        seen_new.ages(NODE, observed(read_new), 0)
        seen_old.ages(NODE, old.observed(read_old), 0)
        ages_new = seen_new.ages(NODE, observed(read_new), now_ns)
        ages_old = seen_old.ages(NODE, old.observed(read_old), now_ns)
        assert stale(read_new, fates_new, ages_new, grace) == expected
        assert old.stale(read_old, fates_old, ages_old, grace) == expected


# --- claim-quota ledger ---------------------------------------------------------------------------

def test_the_previous_webhook_reads_the_ledger_this_one_writes():
    assert old.parse_ledger(new.encode_ledger(_new_ledger())) == _as_old_ledger(_new_ledger())


def test_this_webhook_reads_the_ledger_the_previous_one_wrote():
    assert new.parse_ledger(old.encode_ledger(_as_old_ledger(_new_ledger()))) == _new_ledger()
    assert new.encode_ledger(_new_ledger()) == old.encode_ledger(_as_old_ledger(_new_ledger()))
    assert new.parse_ledger(None) == old.parse_ledger(None) == {}


def test_ledger_fields_a_later_release_adds_are_ignored_by_both_readers():
    text = _with_unknown_fields(new.encode_ledger(_new_ledger()), ("reservations", "claim-a"))
    assert new.parse_ledger(text) == _new_ledger()
    assert old.parse_ledger(text) == _as_old_ledger(_new_ledger())


@pytest.mark.parametrize("text", [
    '{"version":2,"reservations":{}}',
    '{"version":1,"reservations":{"c":{"core":-1,"memory":0,"expires":1}}}',
    '{"version":1,"reservations":{"c":{"core":1,"memory":0,"expires":"soon"}}}',
    '{"version":1,"reservations":{"c":{"core":1,"memory":0,"expires":1e999}}}',
    "[]",
])
def test_both_webhooks_refuse_the_same_broken_ledgers(text):
    with pytest.raises(new.LedgerError) as now:
        new.parse_ledger(text)
    with pytest.raises(old.LedgerError) as before:
        old.parse_ledger(text)
    assert str(now.value) == str(before.value)


def test_reservations_expired_by_their_writers_clock_count_alike_until_each_replica_watched_them_for_the_ttl():
    """A reservation another replica wrote with ``expires`` already past (its clock runs behind, or
    it wrote long ago) still counts in both releases until this replica has seen it for the TTL; a
    claim that became visible stops counting at once."""
    entries = {"behind": new.Reservation(600, 1024, 1.0), "visible": new.Reservation(100, 512, 1.0),
               "fresh": new.Reservation(100, 512, 4_000_000_000.0)}
    text = new.encode_ledger(entries)
    read_new, read_old = new.parse_ledger(text), old.parse_ledger(text)
    for now, expected in ((0.0, {"behind", "fresh"}), (29.9, {"behind", "fresh"}), (30.0, set())):
        seen_new, seen_old = FirstSeen(), FirstSeen()
        seen_new.ages("team-a", stamps(read_new), 0.0)
        seen_old.ages("team-a", old.stamps(read_old), 0.0)
        assert set(pending(read_new, seen_new.ages("team-a", stamps(read_new), now), 30.0, {"visible"})) == expected
        assert set(old.pending(read_old, seen_old.ages("team-a", old.stamps(read_old), now), 30.0, {"visible"})) == expected
