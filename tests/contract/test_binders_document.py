"""The binders' document (Lease qgpu-binders): round trip and refusals naming field, value and rule."""

from __future__ import annotations

import json
import re

import pytest

from qgpu_runtime.contract.leases import BinderEntry, BindersError, encode_binders, parse_binders


def test_the_document_round_trips_and_nothing_means_no_binder():
    entries = {"a": BinderEntry(3, False, 15), "b": BinderEntry(0, True, 60)}
    assert parse_binders(encode_binders(entries)) == entries
    assert parse_binders(None) == {} and parse_binders("") == {}


def test_fields_a_later_release_adds_are_ignored():
    raw = json.dumps({"version": 1, "extra": 1, "binders": {"a": {"beat": 1, "committing": True, "duration_s": 15, "zone": "x"}}})
    assert parse_binders(raw) == {"a": BinderEntry(1, True, 15)}


@pytest.mark.parametrize("doc, words", [
    ("[]", "qgpu.io/binders is a JSON list: must be a JSON object"),
    ({"version": 2, "binders": {}}, "version=2: only version 1 is known"),
    ({"version": 1, "binders": []}, "binders=[]: must be an object keyed by binder identity"),
    ({"version": 1, "binders": {"a": {"beat": -1, "committing": True, "duration_s": 15}}}, "binders['a'].beat=-1: must be an integer"),
    ({"version": 1, "binders": {"a": {"beat": True, "committing": True, "duration_s": 15}}}, "beat=True: must be an integer"),
    ({"version": 1, "binders": {"a": {"beat": 1, "committing": "no", "duration_s": 15}}}, "committing='no': must be true or false"),
    ({"version": 1, "binders": {"a": {"beat": 1, "committing": True, "duration_s": 0}}}, "duration_s=0: must be an integer within 1..3600"),
    ({"version": 1, "binders": {"a": 5}}, "binders['a']=5: must be an object"),
    ({"version": 1, "binders": {f"b{i}": {"beat": 1, "committing": True, "duration_s": 15} for i in range(65)}},
     "65 entries: at most 64"),
])
def test_a_malformed_document_is_refused_naming_the_field(doc, words):
    with pytest.raises(BindersError, match=re.escape(words)):
        parse_binders(doc if isinstance(doc, str) else json.dumps(doc))
