"""Node objects → the placement engine's NodeSpec.

A node's cards are published by the node manager in the annotation ``qgpu.io/gpus`` (written by
qgpu_runtime.node.nodeinfo; format in docs/annotations.md); cards it marks unhealthy are left out,
so nothing new lands on them. CPU and memory come from ``status.allocatable``. Pure functions over
API dicts.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any, Mapping

from qgpu_runtime.jsondoc import load_json
from qgpu_runtime.model.requests import parse_quantity
from qgpu_runtime.node.nodeinfo import ANNOTATION_CARDS as CARDS
from qgpu_runtime.placement.state import CardSpec, NodeSpec


class NodeInventoryError(ValueError):
    """A node's card inventory cannot be read; the message names the node, field and rule."""


def cards_annotation(cards: list[CardSpec] | tuple[CardSpec, ...], unhealthy: frozenset[int] = frozenset()) -> str:
    """Encode an inventory the way the node manager publishes it (tests and benchmarks)."""
    return json.dumps([{"index": c.index, "uuid": c.uuid, "model": c.model, "memory_mib": c.memory_mib,
                        "healthy": c.index not in unhealthy} for c in cards], separators=(",", ":"))


def parse_cards(node_name: str, raw: str) -> tuple[CardSpec, ...]:
    doc = load_json(raw, list, f"node {node_name}: annotation {CARDS}", NodeInventoryError)
    cards = []
    seen: list[int] = []
    for i, card in enumerate(doc):
        if not isinstance(card, dict):
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}]={card!r}: must be an object")
        index, memory = card.get("index"), card.get("memory_mib")
        uuid, model = card.get("uuid"), card.get("model")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}].index={index!r}: must be an integer >= 0")
        if not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0:
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}].memory_mib={memory!r}: must be an integer > 0")
        if not isinstance(uuid, str) or not uuid or not isinstance(model, str) or not model:
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}] uuid={uuid!r} model={model!r}: both must be non-empty strings")
        seen.append(index)
        if card.get("healthy", True) is not False:
            cards.append(CardSpec(index, uuid, model, memory))
    if len(set(seen)) != len(seen):
        raise NodeInventoryError(f"node {node_name}: {CARDS}: card indices repeat")
    return tuple(cards)


def _quantity(value: Any, default: Decimal = Decimal(0)) -> Decimal:
    try:
        return parse_quantity(value)
    except ValueError:
        return default


def node_spec(node: Mapping[str, Any]) -> NodeSpec:
    """NodeSpec of an API node; a node without the annotation has no cards (CPU-only)."""
    meta = node.get("metadata") or {}
    name = str(meta.get("name") or "")
    annotations = meta.get("annotations") or {}
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    cards = parse_cards(name, annotations[CARDS]) if CARDS in annotations else ()
    return NodeSpec(
        name=name,
        cpu_milli=int(_quantity(allocatable.get("cpu", 0)) * 1000),
        memory_mib=int(_quantity(allocatable.get("memory", 0)) / (1024 * 1024)),
        cards=cards,
        labels=dict(meta.get("labels") or {}),
    )

