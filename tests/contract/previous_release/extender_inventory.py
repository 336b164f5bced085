"""FROZEN COPY, for version-skew tests only: the extender's inventory reader of qgpu 0.1.0
(commit bba0bd9, kube/nodes.py parse_cards), verbatim apart from this docstring and its imports.
Never import this from qgpu_runtime; never "fix" it.
"""

from __future__ import annotations

from qgpu_runtime.jsondoc import load_json
from qgpu_runtime.placement.state import CardSpec

CARDS = "qgpu.io/gpus"


class NodeInventoryError(ValueError):
    """A node's card inventory cannot be read; the message names the node, field and rule."""



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
