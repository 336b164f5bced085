"""Version skew during a rolling upgrade, both directions.

Old writer, new reader: documents written by qgpu 0.1.0 (tests/contract/previous_release/
written.json, produced by that release's extender and node manager) are read by today's codecs
with the same meaning. New writer, old reader: everything today's encoders write is accepted by
the previous release's readers (frozen copies in previous_release/) with the same meaning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qgpu_runtime.contract import names
from qgpu_runtime.contract.inventory import InventoryCard, encode_inventory, parse_inventory
from qgpu_runtime.contract.leases import CardUse, Commitment, NodeCommitments, Reservation, encode_ledger, parse_commitments, parse_ledger
from qgpu_runtime.contract.observed import FirstSeen
from qgpu_runtime.contract.record import RecordError, bind_time, parse_record, record_annotations
from qgpu_runtime.extender.nodes import node_spec
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model.requests import AppClass
from qgpu_runtime.node.nodeinfo import node_metadata
from qgpu_runtime.placement.state import CardShare, CardSpec, ContainerPlacement, Placement
from qgpu_runtime.webhook.ledger import pending, stamps
from tests.contract.previous_release import extender_inventory as old_extender
from tests.contract.previous_release import lease_documents as old
from tests.contract.previous_release import node_record as old_node

WRITTEN = json.loads((Path(__file__).parent / "previous_release" / "written.json").read_text())
BIND_NS = 1_732_000_000_000_000_000


def _placement() -> Placement:
    return Placement("gpu-node-1", (
        ContainerPlacement("trainer", (CardShare(0, "GPU-aaaa", 300, 4096), CardShare(1, "GPU-bbbb", 1000, 16384))),
        ContainerPlacement("sidecar", (CardShare(1, "GPU-bbbb", 0, 1024),))), AppClass.OFFLINE)


def _cards() -> list[CardInfo]:
    return [CardInfo(0, "GPU-aaaa", "Tesla V100-SXM2-32GB", 32510, 0), CardInfo(1, "GPU-bbbb", "Tesla V100-SXM2-32GB", 32510, 1),
            CardInfo(2, "GPU-cccc", "Tesla T4", 15109, 2)]


# --- old writer, new reader ----------------------------------------------------------------------

def test_a_record_written_by_the_previous_extender_is_read_by_this_node_manager():
    notes = WRITTEN["pod_annotations"]
    record = parse_record(notes[names.ALLOCATION])
    assert Placement.of_record(record) == _placement()
    assert record.policy == "frag"
    assert record.container("sidecar").shares == (CardShare(1, "GPU-bbbb", 0, 1024),)
    assert bind_time({"metadata": {"annotations": notes}}) == BIND_NS


def test_an_inventory_written_by_the_previous_node_manager_is_read_by_this_extender():
    node = {"metadata": {"name": "gpu-node-1", "annotations": WRITTEN["node_annotations"], "labels": WRITTEN["node_labels"]}}
    assert node_spec(node).cards == (CardSpec(0, "GPU-aaaa", "Tesla V100-SXM2-32GB", 32510),
                                     CardSpec(1, "GPU-bbbb", "Tesla V100-SXM2-32GB", 32510))
    assert parse_inventory("gpu-node-1", WRITTEN["node_annotations"][names.INVENTORY])[2] == \
        InventoryCard(2, "GPU-cccc", "Tesla T4", 15109, healthy=False, reason="XID 79: fell off the bus")


def test_this_node_manager_writes_what_the_previous_one_wrote():
    labels, annotations = node_metadata(_cards(), {2: "XID 79: fell off the bus"}, "fixed-share")
    assert (labels, annotations) == (WRITTEN["node_labels"], WRITTEN["node_annotations"])


def test_this_extender_writes_what_the_previous_one_wrote():
    assert record_annotations(_placement().record("frag", BIND_NS), BIND_NS) == WRITTEN["pod_annotations"]


# --- new writer, old reader ----------------------------------------------------------------------

def test_the_previous_node_manager_reads_every_record_this_extender_writes():
    for klass in AppClass:
        placement = Placement(_placement().node, _placement().containers, klass)
        old = old_node.parse_record(placement.record("binpack", BIND_NS).to_json())
        assert (old.node, old.policy, old.klass) == ("gpu-node-1", "binpack", klass.value)
        assert [(c.name, [(s.index, s.uuid, s.core_milli, s.memory_mib) for s in c.cards]) for c in old.containers] == \
            [(c.name, [(s.index, s.uuid, s.core_milli, s.memory_mib) for s in c.shares]) for c in placement.containers]


def test_the_previous_extender_reads_every_inventory_this_node_manager_writes():
    for unhealthy in ({}, {0: "XID 48"}, {0: "", 1: "gone"}):
        _, annotations = node_metadata(_cards(), unhealthy, "burst-share")
        old = old_extender.parse_cards("n", annotations[names.INVENTORY])
        assert [c.index for c in old] == [c.index for c in _cards() if c.index not in unhealthy]


# --- a later release adds optional fields ---------------------------------------------------------

def test_unknown_fields_of_a_known_version_are_ignored():
    doc = json.loads(WRITTEN["pod_annotations"][names.ALLOCATION])
    doc["priority"] = "high"
    doc["containers"][0]["cards"][0]["mig"] = "1g.10gb"
    assert Placement.of_record(parse_record(json.dumps(doc))) == _placement()
    cards = json.loads(encode_inventory(_cards()))
    cards[0]["numa"] = 1
    assert [c.index for c in parse_inventory("n", json.dumps(cards))] == [0, 1, 2]


def test_a_record_of_an_unknown_version_is_refused_naming_the_versions_read():
    doc = json.loads(WRITTEN["pod_annotations"][names.ALLOCATION])
    doc["version"] = 2
    with pytest.raises(RecordError, match=r"version=2: this qgpu reads versions 1"):
        parse_record(json.dumps(doc))


# --- the record signature (issue 21): a new annotation, optional to old readers ---------------------

def test_a_signed_bind_writes_what_the_previous_extender_wrote_plus_the_signature():
    from qgpu_runtime.contract.signature import signed_annotations
    from tests.recordkeys import SIGNER

    notes = signed_annotations(_placement().record("frag", BIND_NS), BIND_NS, "pod-uid", SIGNER)
    assert set(notes) == {*WRITTEN["pod_annotations"], names.ALLOCATION_SIGNATURE}
    assert {k: v for k, v in notes.items() if k != names.ALLOCATION_SIGNATURE} == WRITTEN["pod_annotations"]
    old = old_node.parse_record(notes[names.ALLOCATION])  # the previous node manager ignores the signature
    assert (old.node, old.policy) == ("gpu-node-1", "frag")


def test_a_record_the_previous_extender_wrote_is_read_but_not_trusted_by_this_release():
    """Why the upgrade goes extender first (docs/annotations.md): an unsigned record keeps its
    meaning for the codec but grants and books nothing in this release's readers."""
    from qgpu_runtime.contract.signature import UntrustedRecord, trusted_record
    from tests.recordkeys import VERIFIER

    pod = {"metadata": {"uid": "pod-uid", "annotations": WRITTEN["pod_annotations"]}, "spec": {"nodeName": "gpu-node-1"}}
    assert Placement.of_record(parse_record(WRITTEN["pod_annotations"][names.ALLOCATION])) == _placement()
    with pytest.raises(UntrustedRecord, match="allocation-signature is missing"):
        trusted_record(pod, VERIFIER)


# --- the Lease documents: claim-quota ledger and node commitments (issue 21 §6) -------------------
# Expiry moved from the writer's stamp to each reader's own clock; the documents did not change.

LEDGER_BEFORE = ('{"version":1,"reservations":{"team-a-claim":{"core":600,"memory":1024,"expires":1732000030.5}}}')
COMMITMENTS_BEFORE = ('{"version":1,"node":"gpu-node-1","pods":{"uid-1":{"pod":"ns/p","since_ns":1732000000000000000,'
                      '"cards":[{"index":0,"core_milli":300,"memory_mib":4096,"exclusive":false}]}}}')


def test_a_ledger_written_before_is_read_alike_and_its_entries_count_until_watched_for_the_ttl():
    entries = parse_ledger(LEDGER_BEFORE)
    assert entries == {"team-a-claim": Reservation(600, 1024, 1732000030.5)}
    seen = FirstSeen()
    assert set(pending(entries, seen.ages("team-a", stamps(entries), 0.0), 30.0, ())) == {"team-a-claim"}
    assert pending(entries, seen.ages("team-a", stamps(entries), 30.0), 30.0, ()) == {}


def test_the_previous_webhook_reads_the_ledger_this_one_writes_and_counts_it_until_expires():
    written = encode_ledger({"c": Reservation(600, 1024, 1000.0 + 30.0)})  # ClaimQuota: its wall clock + TTL
    entries = old.parse_ledger(written)
    assert entries == {"c": old.Reservation(600, 1024, 1030.0)}
    assert set(old.pending(entries, 1000.0, ())) == {"c"} and old.pending(entries, 1030.0, ()) == {}


def test_commitments_written_before_are_read_alike():
    assert parse_commitments(COMMITMENTS_BEFORE, "gpu-node-1") == NodeCommitments("gpu-node-1", {
        "uid-1": Commitment("uid-1", "ns/p", 1732000000000000000, (CardUse(0, 300, 4096, False),))})


def test_the_previous_extender_reads_the_commitments_this_one_writes():
    doc = NodeCommitments("gpu-node-1", {"uid-1": Commitment("uid-1", "ns/p", 1732000000000000000,
                                                             (CardUse(0, 300, 4096), CardUse(1, 1000, 16384, True)))})
    read = old.parse_commitments(doc.to_json(), "gpu-node-1")
    assert read == old.NodeCommitments("gpu-node-1", {"uid-1": old.Commitment(
        "uid-1", "ns/p", 1732000000000000000, (old.CardUse(0, 300, 4096, False), old.CardUse(1, 1000, 16384, True)))})
    assert doc.to_json() == COMMITMENTS_BEFORE.replace('}]}}}', '},{"index":1,"core_milli":1000,"memory_mib":16384,'
                                                                 '"exclusive":true}]}}}')
