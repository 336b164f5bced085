"""API JSON a tenant nested past the decoder's reach (kube/apijson.py): decoded with the tower cut
to null, everything around it intact; brackets inside strings are text, not nesting."""

from __future__ import annotations

import json

import pytest

from qgpu_runtime.kube.apijson import MAX_DEPTH, cut_deep, loads

TOWER = "[" * 3000 + "]" * 3000


def claim(name: str, parameters: str) -> str:
    return ('{"metadata":{"name":"%s","annotations":{"note":"[[[{ \\" ]]"}},"spec":{"devices":{"config":'
            '[{"opaque":{"driver":"other.example.com","parameters":%s}}]}}}' % (name, parameters))


def test_a_document_within_reach_is_decoded_as_json_loads_does():
    text = claim("ok", '{"a":[1,[2,[3]]]}')
    assert loads(text) == json.loads(text) and loads(text.encode()) == json.loads(text)


def test_a_list_holding_one_tower_decodes_with_only_the_tower_cut(caplog):
    body = '{"kind":"ResourceClaimList","items":[%s,%s,%s]}' % (
        claim("before", '{"x":1}'), claim("tower", '{"a":%s}' % TOWER), claim("after", '{"y":[true]}'))
    with pytest.raises(RecursionError):
        json.loads(body)
    doc = loads(body.encode())
    names = [item["metadata"]["name"] for item in doc["items"]]
    assert names == ["before", "tower", "after"]
    params = [item["spec"]["devices"]["config"][0]["opaque"]["parameters"] for item in doc["items"]]
    assert params[0] == {"x": 1} and params[2] == {"y": [True]}
    assert doc["items"][1]["metadata"]["annotations"] == {"note": '[[[{ " ]]'}  # a string's brackets are text

    def depth(value: object) -> int:
        if isinstance(value, list):
            return 1 + max((depth(v) for v in value), default=0)
        if isinstance(value, dict):
            return 1 + max((depth(v) for v in value.values()), default=0)
        return 0

    assert depth(params[1]) <= MAX_DEPTH
    assert "1 value(s) nested deeper than 64 levels read as null" in caplog.text


@pytest.mark.parametrize(("data", "expected", "count"), [
    (b"[[[1]]]", b"[[null]]", 1),
    (b'[["[[[", {"a": [1]}], [2]]', b'[["[[[", null], [2]]', 1),
    (b'[[{"a": 1}, {"b": 2}], 3]', b'[[null, null], 3]', 2),
    (b'["\\\\", [[0]]]', b'["\\\\", [null]]', 1),  # an escaped backslash ends the string before the quote
    (b'{"a":"\\"[[[","b":[[1]]}', b'{"a":"\\"[[[","b":[null]}', 1),  # an escaped quote does not
    (b"[1, 2]", b"[1, 2]", 0),
])
def test_cut_deep_counts_brackets_outside_strings_only(data, expected, count):
    assert cut_deep(data, 2) == (expected, count)


def test_brackets_that_never_close_are_a_value_error_not_a_recursion_error():
    with pytest.raises(ValueError, match="never close"):
        loads("[" * 5000)
