"""Node labels and annotations describing the GPUs, for the scheduler and for people.

Labels carry what selectors need (count, model, memory per card); an annotation carries the full
card list as JSON (label values cannot hold it). Capacity itself comes from the device plugin.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from qgpu_runtime.gpu.types import CardInfo

LABEL_COUNT = "qgpu.io/gpu-count"
LABEL_MODEL = "qgpu.io/gpu-model"
LABEL_MEMORY = "qgpu.io/gpu-memory-mib"
ANNOTATION_CARDS = "qgpu.io/gpus"
ANNOTATION_POLICY = "qgpu.io/isolation-policy"


def label_value(text: str) -> str:
    """A label value: [A-Za-z0-9._-], at most 63, starting and ending alphanumeric."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-_.")
    return value[:63].rstrip("-_.")


def node_metadata(cards: Sequence[CardInfo], unhealthy: dict[int, str], policy: str) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations). Mixed models are labelled with the first card's and listed in full."""
    labels = {LABEL_COUNT: str(len(cards))}
    if cards:
        labels[LABEL_MODEL] = label_value(cards[0].model)
        labels[LABEL_MEMORY] = str(min(c.memory_mib for c in cards))
    cards_json = json.dumps([
        {"index": c.index, "uuid": c.uuid, "model": c.model, "memory_mib": c.memory_mib,
         "healthy": c.index not in unhealthy, **({"reason": unhealthy[c.index]} if c.index in unhealthy else {})}
        for c in cards], separators=(",", ":"))
    return labels, {ANNOTATION_CARDS: cards_json, ANNOTATION_POLICY: policy}
