"""The card inventory of a node (annotation ``qgpu.io/gpus``): one encoder, one strict decoder.

The node manager writes it (node/nodeinfo.py); the extender reads it to know a node's cards and
`qgpu status` to show them. A JSON list, one object per card: ``index`` (int ≥ 0, unique),
``uuid`` and ``model`` (non-empty strings), ``memory_mib`` (int > 0), ``healthy`` (bool, default
true) and, for an unhealthy card, ``reason``. docs/annotations.md is normative.

Rolling upgrades follow the rule of contract/record.py: readers ignore fields they do not know and
refuse a missing or mistyped required field, so a later release may add optional fields.
Pure functions over strings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Protocol

from qgpu_runtime.contract.names import INVENTORY
from qgpu_runtime.jsondoc import load_json

CARDS = INVENTORY


class NodeInventoryError(ValueError):
    """A node's card inventory cannot be read; the message names the node, field and rule."""


@dataclass(frozen=True)
class InventoryCard:
    index: int
    uuid: str
    model: str
    memory_mib: int
    healthy: bool = True
    reason: str = ""


class _Card(Protocol):
    index: int
    uuid: str
    model: str
    memory_mib: int


def encode_inventory(cards: Iterable[_Card], unhealthy: dict[int, str] | frozenset[int] = frozenset()) -> str:
    """The annotation value for these cards; ``unhealthy`` maps a card index to its reason (or is a
    set of indices when no reason is known)."""
    reasons = unhealthy if isinstance(unhealthy, dict) else {i: "" for i in unhealthy}
    doc = []
    for c in cards:
        entry: dict[str, object] = {"index": c.index, "uuid": c.uuid, "model": c.model, "memory_mib": c.memory_mib,
                                    "healthy": c.index not in reasons}
        if reasons.get(c.index):
            entry["reason"] = reasons[c.index]
        doc.append(entry)
    return json.dumps(doc, separators=(",", ":"))


cards_annotation = encode_inventory
"""Tests and benchmarks build fake nodes with this name."""


def parse_inventory(node_name: str, raw: str) -> tuple[InventoryCard, ...]:
    """Every card of the annotation, healthy or not, in the order written."""
    doc = load_json(raw, list, f"node {node_name}: annotation {CARDS}", NodeInventoryError)
    cards: list[InventoryCard] = []
    for i, card in enumerate(doc):
        if not isinstance(card, dict):
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}]={card!r}: must be an object")
        index, memory = card.get("index"), card.get("memory_mib")
        uuid, model = card.get("uuid"), card.get("model")
        healthy, reason = card.get("healthy", True), card.get("reason", "")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}].index={index!r}: must be an integer >= 0")
        if not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0:
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}].memory_mib={memory!r}: must be an integer > 0")
        if not isinstance(uuid, str) or not uuid or not isinstance(model, str) or not model:
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}] uuid={uuid!r} model={model!r}: both must be non-empty strings")
        if not isinstance(healthy, bool):
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}].healthy={healthy!r}: must be true or false")
        if not isinstance(reason, str):
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}].reason={reason!r}: must be a string")
        cards.append(InventoryCard(index, uuid, model, memory, healthy, reason))
    indices = [c.index for c in cards]
    if len(set(indices)) != len(indices):
        raise NodeInventoryError(f"node {node_name}: {CARDS}: card indices repeat")
    return tuple(cards)
