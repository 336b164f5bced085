"""The allocation record: what bind writes is what every reader gets back."""

from __future__ import annotations

import json

import pytest

from qgpu_runtime.contract.record import AllocationRecord, RecordError, parse_record, record_annotations
from qgpu_runtime.model.requests import AppClass
from qgpu_runtime.placement.state import CardShare, ContainerPlacement, Placement


def _placement() -> Placement:
    return Placement("n1", (ContainerPlacement("a", (CardShare(1, "GPU-1", 300, 5120),)),
                            ContainerPlacement("b", (CardShare(0, "GPU-0", 1000, 32768), CardShare(2, "GPU-2", 1000, 32768)), True)),
                     AppClass.OFFLINE, 500, 1024)


def test_record_round_trips_and_infers_whole_cards():
    rec = _placement().record("binpack", 1_700_000_000_123_456_789)
    back = parse_record(rec.to_json())
    assert back == rec
    assert back.time == "2023-11-14T22:13:20Z"
    assert Placement.of_record(back, 500, 1024) == _placement()


def test_record_json_follows_docs_annotations():
    rec = _placement().record("spread", 0)
    doc = json.loads(rec.to_json())
    assert set(doc) == {"version", "node", "policy", "class", "time", "containers"}
    assert doc["version"] == 1 and doc["class"] == "offline" and doc["policy"] == "spread"
    assert doc["containers"][0] == {"name": "a", "cards": [{"index": 1, "uuid": "GPU-1", "core_milli": 300, "memory_mib": 5120}]}
    annotations = record_annotations(rec, 42)
    assert annotations["qgpu.io/bind-time"] == "42" and annotations["qgpu.io/allocation"] == rec.to_json()


@pytest.mark.parametrize("raw, message", [
    ("nope", "not JSON"),
    ("[]", "must be a JSON object"),
    (json.dumps({"version": 2}), "version=2: this qgpu reads versions 1"),
    (json.dumps({"version": 1, "class": "gold", "containers": []}), "class='gold'"),
    (json.dumps({"version": 1, "class": "normal", "node": "n", "policy": "p", "time": "t",
                 "containers": [{"name": "a", "cards": [{"index": 0, "uuid": "u", "core_milli": 1500, "memory_mib": 1}]}]}),
     "core_milli within 0..1000"),
    (json.dumps({"version": 1, "class": "normal", "node": "n", "policy": "p", "time": "t",
                 "containers": [{"name": "a", "cards": [{"index": "0", "uuid": "u", "core_milli": 1, "memory_mib": 1}]}]}),
     r"containers\[0\].cards\[0\].index"),
])
def test_bad_records_are_refused_naming_the_field(raw, message):
    with pytest.raises(RecordError, match=message):
        parse_record(raw)


def test_record_is_frozen_value():
    rec = AllocationRecord("n", "binpack", AppClass.NORMAL, "t", ())
    with pytest.raises(AttributeError):
        rec.node = "m"  # type: ignore[misc]
