"""Every field of the node inventory is bounded where it is read, and the node's encoder refuses
the same values: a node's manager (its own token may write the annotation) can hurt only itself."""

from __future__ import annotations

import json

import pytest

from qgpu_runtime.contract.inventory import (
    BOUNDS,
    MAX_CARDS,
    MAX_MEMORY_MIB,
    NodeInventoryError,
    clip_reason,
    encode_inventory,
    parse_inventory,
)
from qgpu_runtime.node.nodeinfo import node_metadata
from qgpu_runtime.placement.state import CardSpec


def _card(**over: object) -> dict[str, object]:
    return {"index": 0, "uuid": "GPU-0", "model": "H200", "memory_mib": 143771, "healthy": True, **over}


def _raw(*cards: dict[str, object]) -> str:
    return json.dumps(list(cards))


@pytest.mark.parametrize("field, value, words", [
    ("memory_mib", 2**64, "memory_mib=18446744073709551616: must be an integer from 1 to 1048576"),
    ("memory_mib", MAX_MEMORY_MIB + 1, "memory_mib=1048577"),
    ("memory_mib", 0, "memory_mib=0"),
    ("index", 2**63, "index=9223372036854775808: must be an integer from 0 to 255"),
    ("index", -1, "index=-1"),
    ("uuid", "G" * 97, "uuid='GGGG"),
    ("model", "", "model='': must be a non-empty string of at most 96 characters"),
    ("reason", "r" * 257, "reason='rrrr"),
    ("reason", 5, "reason=5: must be a string of at most 256 characters"),
])
def test_a_field_out_of_bounds_is_refused_naming_field_value_and_rule(field: str, value: object, words: str) -> None:
    with pytest.raises(NodeInventoryError) as caught:
        parse_inventory("n1", _raw(_card(**{field: value})))
    assert "node n1" in str(caught.value) and words in str(caught.value)
    assert len(str(caught.value)) < 400  # a huge value is not echoed whole


def test_values_at_the_bounds_are_accepted() -> None:
    cards = [_card(index=i, uuid="U" * 96, model="M" * 96, memory_mib=MAX_MEMORY_MIB, healthy=False,
                   reason="\u00e9" * 256) for i in range(MAX_CARDS)]
    raw = json.dumps(cards)  # ensure_ascii: every reason character becomes \uXXXX (6 characters)
    assert len(raw) <= BOUNDS.raw_chars
    assert len(parse_inventory("n1", raw)) == MAX_CARDS


def test_more_cards_than_the_bound_are_refused() -> None:
    raw = _raw(*(_card(index=i) for i in range(MAX_CARDS + 1)))
    with pytest.raises(NodeInventoryError, match=f"lists {MAX_CARDS + 1} cards: at most {MAX_CARDS} per node"):
        parse_inventory("n1", raw)


def test_the_raw_length_is_checked_before_decoding() -> None:
    raw = "[" + " " * BOUNDS.raw_chars + "]"  # valid JSON, an empty list, but too long
    with pytest.raises(NodeInventoryError, match="65538 characters: must be a string of at most 65536"):
        parse_inventory("n1", raw)


def test_the_encoder_refuses_what_readers_refuse() -> None:
    with pytest.raises(NodeInventoryError, match="memory_mib"):
        encode_inventory([CardSpec(0, "GPU-0", "H200", 2**64)])
    with pytest.raises(NodeInventoryError, match="at most 16 per node"):
        encode_inventory([CardSpec(i, f"GPU-{i}", "H200", 1024) for i in range(MAX_CARDS + 1)])


def test_the_node_manager_clips_a_long_health_reason_instead_of_failing_to_publish() -> None:
    cards = [CardSpec(0, "GPU-0", "H200", 143771)]
    _, notes = node_metadata(cards, {0: "XID 79 " * 100}, "best-effort")  # type: ignore[arg-type]
    (card,) = parse_inventory("n1", notes["qgpu.io/gpus"])
    assert not card.healthy and len(card.reason) == BOUNDS.reason_chars and card.reason == clip_reason("XID 79 " * 100)
