"""The record's per-container dialect (issue 24) and the container environment built from it.

Rolling upgrade, both directions: the previous release's node reader (frozen in previous_release/)
reads records that carry the new optional fields with the same meaning; this node builds from a
record the previous extender wrote (no dialect) the same environment as from one this extender
writes, and both equal what the previous release's builder (previous_release/node_environment.py,
from the pod spec) gave. The DRA door's environment is unchanged too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qgpu_runtime.contract.environment import T9kMode, container_environment, quota_document, quota_json
from qgpu_runtime.contract.names import ALLOC_MODE_LABEL
from qgpu_runtime.contract.record import (
    CardShare,
    ContainerDialect,
    ContainerPlacement,
    RecordError,
    parse_record,
    record_annotations,
)
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model.requests import AppClass, parse_pod
from qgpu_runtime.node.deviceplugin.matching import Match
from qgpu_runtime.node.deviceplugin.response import build_grant
from qgpu_runtime.node.dra import cdi
from qgpu_runtime.placement import CardSpec, ClusterState, NodeSpec, Placement, make_policy, place
from tests.contract.previous_release import node_environment as old_env
from tests.contract.previous_release import node_record as old_node

NS = 1_732_000_000_000_000_000
CARDS = {0: CardInfo(0, "GPU-aaaa", "Tesla T4", 15360, 0), 1: CardInfo(1, "GPU-bbbb", "Tesla T4", 15360, 1)}
ASKS = {  # container resources, one pod per way of asking
    "t9k-xgn": {"tensorstack.dev/nvidia-gpu": "2"},
    "t9k-sgn": {"tensorstack.dev/nvidia-gpu-percent": "30"},
    "t9k-node": {"tensorstack.dev/nvidia-gpu-node": "1"},
    "qgpu": {"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "4"},
    "vcuda": {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "8"},
    "nvidia": {"nvidia.com/gpu": "1"},
}


def _pod(ask: str) -> dict:
    return {"metadata": {"name": ask, "namespace": "ns", "uid": f"uid-{ask}"},
            "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": ASKS[ask]}}]}}


def _record_raw(ask: str) -> str:
    """What this extender writes for the pod: the engine's placement, as bind encodes it."""
    mode = {"t9k-xgn": "xgn", "t9k-node": "xgn", "t9k-sgn": "sgn"}.get(ask)  # T9k's modes need their node pool
    cards = tuple(CardSpec(c.index, c.uuid, c.model, c.memory_mib) for c in CARDS.values())
    state = ClusterState([NodeSpec("n1", 32000, 64 * 1024, cards, {ALLOC_MODE_LABEL: mode} if mode else {})])
    placement = place(state, parse_pod(_pod(ask)), make_policy("binpack"))
    return placement.record("binpack", NS).to_json()


def _without_dialect(raw: str) -> str:
    """The same record as the previous extender wrote it: no dialect fields."""
    doc = json.loads(raw)
    for c in doc["containers"]:
        for key in ("dialect", "memory_pct", "whole_node"):
            c.pop(key, None)
    return json.dumps(doc, separators=(",", ":"))


def _envs(ask: str, raw: str) -> dict[str, str]:
    record = parse_record(raw)
    pod = _pod(ask)
    match = Match("ns", ask, f"uid-{ask}", "c", record, record.containers[0], False, pod)
    return build_grant(match, CARDS, "fixed-share", Path("/state"), False).envs


def _old_envs(ask: str, raw: str) -> dict[str, str]:
    shares = parse_record(raw).containers[0].shares
    spec_container = _pod(ask)["spec"]["containers"][0]
    return {**old_env.card_envs(shares, "normal", "fixed-share"), **old_env.t9k_envs(spec_container, shares)}


# --- the writer -----------------------------------------------------------------------------------

@pytest.mark.parametrize("ask,expected", [
    ("t9k-xgn", {"dialect": "t9k"}), ("t9k-sgn", {"dialect": "t9k", "memory_pct": 30}),
    ("t9k-node", {"dialect": "t9k", "whole_node": True}), ("qgpu", {"dialect": "qgpu"}),
    ("vcuda", {"dialect": "vcuda"}), ("nvidia", {"dialect": "nvidia"})])
def test_the_extender_writes_each_containers_dialect(ask, expected):
    container = json.loads(_record_raw(ask))["containers"][0]
    assert {k: v for k, v in container.items() if k not in ("name", "cards")} == expected
    assert parse_record(_record_raw(ask)).containers[0].dialect == ContainerDialect(
        expected["dialect"], expected.get("memory_pct"), expected.get("whole_node", False))


def test_the_dialect_is_no_part_of_the_booking():
    raw = _record_raw("t9k-sgn")
    assert Placement.of_record(parse_record(raw)) == Placement.of_record(parse_record(_without_dialect(raw)))


def test_a_placement_without_dialect_writes_what_the_previous_extender_wrote():
    placement = Placement("n1", (ContainerPlacement("c", (CardShare(0, "GPU-aaaa", 300, 4096),)),), AppClass.OFFLINE)
    raw = record_annotations(placement.record("frag", NS), NS)["qgpu.io/allocation"]
    assert "dialect" not in raw


# --- old reader, new writer -----------------------------------------------------------------------

@pytest.mark.parametrize("ask", sorted(ASKS))
def test_the_previous_node_manager_reads_records_with_a_dialect(ask):
    raw = _record_raw(ask)
    old, new = old_node.parse_record(raw), parse_record(raw)
    assert (old.node, old.policy, old.klass) == (new.node, new.policy, new.klass.value)
    assert [(c.name, [(s.index, s.uuid, s.core_milli, s.memory_mib) for s in c.cards]) for c in old.containers] == \
        [(c.name, [(s.index, s.uuid, s.core_milli, s.memory_mib) for s in c.shares]) for c in new.containers]


# --- new reader: both writers, the same environment as the previous release ------------------------

@pytest.mark.parametrize("ask", sorted(ASKS))
def test_the_environment_from_the_records_dialect_is_the_previous_releases(ask):
    raw = _record_raw(ask)
    assert _envs(ask, raw) == _old_envs(ask, raw)


@pytest.mark.parametrize("ask", sorted(ASKS))
def test_a_record_without_dialect_falls_back_to_the_pod_spec(ask):
    raw = _without_dialect(_record_raw(ask))
    assert parse_record(raw).containers[0].dialect is None
    assert _envs(ask, raw) == _old_envs(ask, raw)


def test_the_node_believes_the_records_dialect_not_the_spec():
    """The pod spec is not read again once the record says how the container asked."""
    raw = _record_raw("t9k-sgn")
    doc = json.loads(raw)
    doc["containers"][0]["memory_pct"] = 40
    assert _envs("t9k-sgn", json.dumps(doc))["T9K_GPU_PERCENT"] == "40"


@pytest.mark.parametrize("shares", [
    [CardShare(0, "GPU-aaaa", 1000, 15360), CardShare(1, "GPU-bbbb", 1000, 15360)],
    [CardShare(1, "GPU-bbbb", 250, 4096)], [CardShare(0, "GPU-aaaa", 0, 100), CardShare(1, "GPU-bbbb", 500, 9000)], []])
def test_a_dra_claims_environment_is_the_previous_releases(shares):
    devices = cdi.claim_devices("uid", shares, CARDS, "offline", "burst-share", lambda index: ())
    old = {**old_env.card_envs(shares, "offline", "burst-share"), **old_env.t9k_share_envs(shares, CARDS)}
    assert all(dict(d.env) == old for d in devices) and len(devices) == len(shares)
    assert list(container_environment(shares, "offline", "burst-share",
                                      T9kMode.of_shares(shares, {i: c.memory_mib for i, c in CARDS.items()}))) == list(old)


def test_quota_json_is_the_previous_releases_text():
    shares = (CardShare(0, "GPU-aaaa", 300, 4096),)
    doc = quota_document("ns/p", "uid", "c", "normal", "fixed-share", shares)
    assert quota_json(doc) == json.dumps({
        "pod": "ns/p", "pod_uid": "uid", "container": "c", "class": "normal", "policy": "fixed-share",
        "cards": [{"index": 0, "uuid": "GPU-aaaa", "core_milli": 300, "memory_mib": 4096}]}, indent=2, sort_keys=True) + "\n"


# --- the codec ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,message", [
    ({"dialect": 7}, r"containers\[0\]\.dialect=7: wrong type"),
    ({"dialect": "t9k", "memory_pct": "30"}, r"containers\[0\]\.memory_pct='30': wrong type"),
    ({"dialect": "t9k", "memory_pct": 130}, r"containers\[0\]\.memory_pct=130: must be within 0\.\.100"),
    ({"dialect": "t9k", "whole_node": 1}, r"containers\[0\]\.whole_node=1: wrong type, expected bool")])
def test_a_mistyped_dialect_is_refused_by_name(fields, message):
    doc = json.loads(_without_dialect(_record_raw("qgpu")))
    doc["containers"][0].update(fields)
    with pytest.raises(RecordError, match=message):
        parse_record(json.dumps(doc))


def test_a_dialect_this_release_does_not_know_reads_as_no_t9k_request():
    doc = json.loads(_record_raw("qgpu"))
    doc["containers"][0]["dialect"] = "mig"
    record = parse_record(json.dumps(doc))
    assert record.containers[0].dialect == ContainerDialect("mig")
    assert T9kMode.of_dialect(record.containers[0].dialect) is None
