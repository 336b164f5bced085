"""The card inventory of a node (annotation ``qgpu.io/gpus``): one encoder, one strict decoder.

The node manager writes it (node/nodeinfo.py); the extender reads it to know a node's cards and
`qgpu status` to show them. A JSON list, one object per card: ``index`` (int ≥ 0, unique),
``uuid`` and ``model`` (non-empty strings), ``memory_mib`` (int > 0), ``healthy`` (bool, default
true) and, for an unhealthy card, ``reason``. docs/annotations.md is normative.

Every field is bounded (:class:`InventoryBounds`), and the raw text before it is decoded: the
annotation is written by one node's manager (its own token), and that node must be able to hurt
only itself. An unbounded value did hurt everyone: ``memory_mib: 2**64`` made every filter of
the extender fail (numpy's int64 arrays overflow), 3,500 cards took its cache from 35 to 687 MiB.
The encoder refuses what the decoder refuses, so a healthy node never publishes a value the
extender would throw away.

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


MAX_CARDS = 16
"""Cards per node. The largest single machines NVIDIA builds carry 16 (DGX-2/HGX-2); DGX and HGX
H100, H200 and B200 carry 8. The extender's arrays are [nodes, max cards of any node] wide, so this
bound is what one node can make every node's row cost."""
MAX_INDEX = 255
"""A card's index as NVML numbers it (0 .. device count - 1); 255 leaves room for gaps left by
cards hidden from the node manager, and keeps the value far inside int64."""
MAX_MEMORY_MIB = 1 << 20
"""1 TiB per card: about 7x an H200 (141 GB, 143,771 MiB as nvidia-smi reports it) and 5x a B200
(192 GB); a value above it is not a card but a number chosen to overflow someone."""
MAX_ID_CHARS = 96
"""``uuid`` and ``model``: NVML's own buffers for both are 96 bytes (NVML_DEVICE_UUID_V2_BUFFER_SIZE,
NVML_DEVICE_NAME_V2_BUFFER_SIZE)."""
MAX_REASON_CHARS = 256
"""``reason`` of an unhealthy card: one health message (an XID and its text); the node manager
clips longer ones (:func:`clip_reason`)."""
MAX_RAW_CHARS = 64 * 1024
"""The annotation's text, checked before JSON decoding: 16 cards whose every string is at its
bound and written with ``\\uXXXX`` escapes (6 characters each) take about 45,000 characters, so
every valid inventory fits; the apiserver's own limit (256 KiB for all annotations together)
is four times that."""


@dataclass(frozen=True)
class InventoryBounds:
    """The limits of one inventory, in one value so tests and docs can name them."""

    cards: int = MAX_CARDS
    index: int = MAX_INDEX
    memory_mib: int = MAX_MEMORY_MIB
    id_chars: int = MAX_ID_CHARS
    reason_chars: int = MAX_REASON_CHARS
    raw_chars: int = MAX_RAW_CHARS


BOUNDS = InventoryBounds()


def clip_reason(reason: str, bounds: InventoryBounds = BOUNDS) -> str:
    """A health reason short enough to publish (the writer's side of ``reason_chars``)."""
    return reason if len(reason) <= bounds.reason_chars else reason[: bounds.reason_chars - 1] + "…"


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
    doc: list[dict[str, object]] = []
    for c in cards:
        entry: dict[str, object] = {"index": c.index, "uuid": c.uuid, "model": c.model, "memory_mib": c.memory_mib,
                                    "healthy": c.index not in reasons}
        if reasons.get(c.index):
            entry["reason"] = reasons[c.index]
        doc.append(entry)
    raw = json.dumps(doc, separators=(",", ":"))
    parse_inventory("(this node)", raw)  # refuse to publish what every reader would refuse
    return raw


cards_annotation = encode_inventory
"""Tests and benchmarks build fake nodes with this name."""


def _int_field(node: str, i: int, name: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise NodeInventoryError(f"node {node}: {CARDS}[{i}].{name}={_show(value)}: must be an integer "
                                 f"from {low} to {high}")
    return value


def _str_field(node: str, i: int, name: str, value: object, high: int, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty) or len(value) > high:
        rule = f"a {'' if empty else 'non-empty '}string of at most {high} characters"
        raise NodeInventoryError(f"node {node}: {CARDS}[{i}].{name}={_show(value)}: must be {rule}")
    return value


def _show(value: object) -> str:
    """A value for an error message, cut short: the message must not repeat a huge value."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def parse_inventory(node_name: str, raw: str, bounds: InventoryBounds = BOUNDS) -> tuple[InventoryCard, ...]:
    """Every card of the annotation, healthy or not, in the order written.

    Raises :class:`NodeInventoryError` naming the node, field, value and rule for anything outside
    ``bounds``; the raw length is checked before the text is decoded.
    """
    if not isinstance(raw, str) or len(raw) > bounds.raw_chars:
        size = len(raw) if isinstance(raw, str) else type(raw).__name__
        raise NodeInventoryError(f"node {node_name}: annotation {CARDS} has {size} characters: "
                                 f"must be a string of at most {bounds.raw_chars}")
    doc = load_json(raw, list, f"node {node_name}: annotation {CARDS}", NodeInventoryError)
    if len(doc) > bounds.cards:
        raise NodeInventoryError(f"node {node_name}: annotation {CARDS} lists {len(doc)} cards: "
                                 f"at most {bounds.cards} per node")
    cards: list[InventoryCard] = []
    for i, card in enumerate(doc):
        if not isinstance(card, dict):
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}]={_show(card)}: must be an object")
        index = _int_field(node_name, i, "index", card.get("index"), 0, bounds.index)
        memory = _int_field(node_name, i, "memory_mib", card.get("memory_mib"), 1, bounds.memory_mib)
        uuid = _str_field(node_name, i, "uuid", card.get("uuid"), bounds.id_chars)
        model = _str_field(node_name, i, "model", card.get("model"), bounds.id_chars)
        healthy = card.get("healthy", True)
        if not isinstance(healthy, bool):
            raise NodeInventoryError(f"node {node_name}: {CARDS}[{i}].healthy={_show(healthy)}: must be true or false")
        reason = _str_field(node_name, i, "reason", card.get("reason", ""), bounds.reason_chars, empty=True)
        cards.append(InventoryCard(index, uuid, model, memory, healthy, reason))
    indices = [c.index for c in cards]
    if len(set(indices)) != len(indices):
        raise NodeInventoryError(f"node {node_name}: {CARDS}: card indices repeat")
    return tuple(cards)
