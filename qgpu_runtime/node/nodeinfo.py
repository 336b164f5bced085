"""Node labels and annotations describing the GPUs, for the scheduler and for people.

Labels carry what selectors need (count, model, memory per card); the inventory annotation
carries the full card list (contract/inventory.py; label values cannot hold it). Capacity itself
comes from the device plugin, except HAMi's share sizes (:func:`share_size_capacity`).
"""

from __future__ import annotations

import re
from typing import Sequence

from qgpu_runtime.contract.inventory import clip_reason, encode_inventory
from qgpu_runtime.contract.names import (
    INVENTORY,
    LABEL_GPU_COUNT,
    LABEL_GPU_MEMORY,
    LABEL_GPU_MODEL,
    NODE_ISOLATION_POLICY,
)
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model.requests import HAMI_GPUCORES, HAMI_GPUMEM, HAMI_GPUMEM_PCT


def label_value(text: str) -> str:
    """A label value: [A-Za-z0-9._-], at most 63, starting and ending alphanumeric."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-_.")
    return value[:63].rstrip("-_.")


def node_metadata(cards: Sequence[CardInfo], unhealthy: dict[int, str], policy: str) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations). Mixed models are labelled with the first card's and listed in full."""
    labels = {LABEL_GPU_COUNT: str(len(cards))}
    if cards:
        labels[LABEL_GPU_MODEL] = label_value(cards[0].model)
        labels[LABEL_GPU_MEMORY] = str(min(c.memory_mib for c in cards))
    reasons = {index: clip_reason(reason) for index, reason in unhealthy.items()}
    return labels, {INVENTORY: encode_inventory(cards, reasons), NODE_ISOLATION_POLICY: policy}


def share_size_capacity(cards: Sequence[CardInfo]) -> dict[str, str]:
    """HAMi's ``nvidia.com/gpumem`` (MiB), ``gpumem-percentage`` and ``gpucores`` (percent) as node
    capacity: the node's totals, which the shares the extender places never exceed. A node that has
    them is a device-plugin node for them in kube-scheduler's eyes; without them, where a DeviceClass
    maps ``nvidia.com/gpu`` to DRA (KEP-5004), its DynamicResources plugin looks for a class of these
    names too and refuses HAMi's pods on every node ("cannot fit resource")."""
    return {HAMI_GPUMEM: str(sum(c.memory_mib for c in cards)), HAMI_GPUMEM_PCT: str(100 * len(cards)),
            HAMI_GPUCORES: str(100 * len(cards))}
