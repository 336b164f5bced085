"""Node objects → the placement engine's NodeSpec (the extender's view of a node).

A node's cards come from its inventory annotation (contract/inventory.py); cards the node manager
marks unhealthy are left out, so nothing new lands on them. A node of a DRA pool (label
``qgpu.io/pool-mode=dra``) has no cards here: its cards reach pods through ResourceClaims, and a pod
the extender bound there with an allocation record would find no device plugin to serve it. CPU and memory come from
``status.allocatable``. Pure functions over API dicts.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Mapping

from qgpu_runtime.contract.inventory import CARDS, NodeInventoryError, parse_inventory
from qgpu_runtime.contract.names import POOL_MODE_LABEL
from qgpu_runtime.model.requests import parse_quantity
from qgpu_runtime.placement.state import CardSpec, NodeSpec

__all__ = ["NodeInventoryError", "node_spec"]


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
    labels = dict(meta.get("labels") or {})
    served = CARDS in annotations and labels.get(POOL_MODE_LABEL) != "dra"
    cards = tuple(CardSpec(c.index, c.uuid, c.model, c.memory_mib)
                  for c in parse_inventory(name, annotations[CARDS]) if c.healthy) if served else ()
    return NodeSpec(
        name=name,
        cpu_milli=int(_quantity(allocatable.get("cpu", 0)) * 1000),
        memory_mib=int(_quantity(allocatable.get("memory", 0)) / (1024 * 1024)),
        cards=cards,
        labels=labels,
    )
