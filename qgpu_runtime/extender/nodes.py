"""Node objects → the placement engine's NodeSpec (the extender's view of a node).

A node's cards come from its inventory annotation (contract/inventory.py); cards the node manager
marks unhealthy are left out, so nothing new lands on them. A node of a DRA pool (label
``qgpu.io/pool-mode=dra``, ``dra_pool``) serves only what DRA maps: ``nvidia.com/gpu`` through the
whole-card DeviceClass; the cache refuses it every other dialect (no device plugin runs there). CPU and memory come from
``status.allocatable``. Pure functions over API dicts.

Everything here is written by the node itself (its manager's token, its kubelet), so every number
is bounded before it reaches the placement engine's int64 arrays: a node whose data is out of
bounds raises :class:`NodeInventoryError` naming the field, and the cache keeps it out of
placement with that reason. One node can hurt only itself.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Mapping

from qgpu_runtime.contract.inventory import CARDS, InventoryCard, NodeInventoryError, parse_inventory
from qgpu_runtime.contract.names import POOL_MODE_LABEL
from qgpu_runtime.model.requests import parse_quantity
from qgpu_runtime.placement.state import ALLOC_MODE_LABEL, ISOLATION_POLICY_LABEL, MIXED_LABEL, CardSpec, NodeSpec

__all__ = ["NodeInventoryError", "dra_pool", "failed_cards", "node_inventory", "node_spec", "refused_spec"]

DRA_POOL_REASON = ("node of a DRA pool: its cards reach pods through ResourceClaims (label the namespace "
                   "qgpu.io/gpu-mode=dra, docs/dra.md); only nvidia.com/gpu is mapped there")


def dra_pool(spec: NodeSpec) -> bool:
    """Whether the node's cards are served by qgpu's DRA driver rather than its device plugins."""
    return spec.labels.get(POOL_MODE_LABEL) == "dra"


READ_LABELS = frozenset({POOL_MODE_LABEL, MIXED_LABEL, ALLOC_MODE_LABEL, ISOLATION_POLICY_LABEL})
"""The node labels placement reads; the cache keeps no other. A node may carry as many labels as
its object's size allows (about 1.5 MB), and a label nobody reads must neither cost memory per
node nor, when it changes, rebuild the state."""

MAX_NODE_CPU_CORES = 1 << 20
"""A node's allocatable CPU: about a thousand times today's largest single machines, and small
enough that its millicores (and their sum over 100,000 nodes) stay far inside int64. The
quantity parser's own cap (2^63 - 1 cores) would overflow once multiplied into millicores."""


def _quantity(value: Any, default: Decimal = Decimal(0)) -> Decimal:
    try:
        return parse_quantity(value)
    except ValueError:
        return default


def _capacity(node: str, field: str, value: Any, high: Decimal) -> Decimal:
    amount = _quantity(value)
    if not 0 <= amount <= high:
        raise NodeInventoryError(f"node {node}: status.allocatable.{field}={str(value)[:40]!r}: must be from 0 to {high}")
    return amount


def _read_labels(meta: Mapping[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (meta.get("labels") or {}).items() if k in READ_LABELS}


def refused_spec(node: Mapping[str, Any]) -> NodeSpec:
    """The spec of a node whose data :func:`node_spec` refused: nothing to place on (no cards, no
    CPU, no memory), its labels kept so the DRA pool flag still holds."""
    meta = node.get("metadata") or {}
    return NodeSpec(str(meta.get("name") or ""), 0, 0, (), _read_labels(meta))


def node_inventory(node: Mapping[str, Any]) -> tuple[InventoryCard, ...]:
    """Every card of the node's inventory annotation, healthy or not; none without the annotation.

    Raises :class:`NodeInventoryError` for an inventory out of bounds."""
    meta = node.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(CARDS)
    return () if raw is None else parse_inventory(str(meta.get("name") or ""), raw)


def node_spec(node: Mapping[str, Any], inventory: tuple[InventoryCard, ...] | None = None) -> NodeSpec:
    """NodeSpec of an API node; a node without the annotation has no cards (CPU-only).
    ``inventory``: :func:`node_inventory` of this node when the caller read it already.

    Raises :class:`NodeInventoryError` for an inventory or a capacity out of bounds."""
    meta = node.get("metadata") or {}
    name = str(meta.get("name") or "")
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    labels = _read_labels(meta)
    cpu = _capacity(name, "cpu", allocatable.get("cpu", 0), Decimal(MAX_NODE_CPU_CORES))
    memory = _capacity(name, "memory", allocatable.get("memory", 0), Decimal(2**63 - 1))
    if inventory is None:
        inventory = node_inventory(node)
    cards = tuple(CardSpec(c.index, c.uuid, c.model, c.memory_mib) for c in inventory if c.healthy)
    return NodeSpec(
        name=name,
        cpu_milli=int(cpu * 1000),
        memory_mib=int(memory / (1024 * 1024)),
        cards=cards,
        labels=labels,
    )


def failed_cards(inventory: tuple[InventoryCard, ...]) -> dict[int, tuple[str, str]]:
    """The cards a node's inventory (:func:`node_inventory`) marks unhealthy: index -> (UUID, reason)."""
    return {c.index: (c.uuid, c.reason) for c in inventory if not c.healthy}
