"""The extended resources the device plugin can serve, and how each one counts a card.

Kubelet only counts devices, so every resource is advertised as N device IDs per card, where N
is the resource's unit count on that card (100 per card for percent resources, one per GiB for
qgpu-memory, one per 256 MiB for vcuda-memory, one per card for whole-card resources). Device IDs
name their card (``<short>-<card index>-<n>``) so pod-resources answers can be read back to cards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model import requests as rq


@dataclass(frozen=True)
class ResourceKind:
    name: str
    short: str
    units_per_card: Callable[[CardInfo], int]
    description: str

    @property
    def socket_name(self) -> str:
        return f"qgpu-{self.short}.sock"

    def device_id(self, card_index: int, unit: int) -> str:
        return f"{self.short}-{card_index}-{unit}"

    def device_ids(self, card: CardInfo) -> list[str]:
        return [self.device_id(card.index, n) for n in range(self.units_per_card(card))]


def card_of_device(device_id: str) -> int | None:
    """The card index a device ID names, or None when it is not one of ours."""
    parts = device_id.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return int(parts[1])


CATALOG: dict[str, ResourceKind] = {k.name: k for k in (
    ResourceKind(rq.QGPU_CORE, "qgpu-core", lambda c: 100, "percent of a card's compute"),
    ResourceKind(rq.QGPU_CORE_GREEDY, "qgpu-core-greedy", lambda c: 100, "offline pods' percent of a card's compute"),
    ResourceKind(rq.QGPU_MEMORY, "qgpu-memory", lambda c: c.memory_mib // 1024, "GiB of a card's memory"),
    ResourceKind(rq.VCUDA_CORE, "vcuda-core", lambda c: 100, "TKEStack vcuda: percent of a card"),
    ResourceKind(rq.VCUDA_MEMORY, "vcuda-memory", lambda c: c.memory_mib // rq.VCUDA_MEMORY_UNIT_MIB, "TKEStack vcuda: 256 MiB units"),
    ResourceKind(rq.T9K_GPU, "t9k-gpu", lambda c: 1, "T9k: whole cards"),
    ResourceKind(rq.T9K_GPU_PERCENT, "t9k-gpu-percent", lambda c: 100, "T9k: percent of a card's memory"),
    ResourceKind(rq.NVIDIA_GPU, "nvidia-gpu", lambda c: 1, "NVIDIA: whole cards"),
)}

DEFAULT_RESOURCES = (rq.QGPU_CORE, rq.QGPU_MEMORY, rq.QGPU_CORE_GREEDY)


def parse_resources(value: str) -> tuple[ResourceKind, ...]:
    """``--resources`` (comma-separated full names) -> kinds, in the order given."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise ValueError("--resources: empty; name at least one of " + ", ".join(CATALOG))
    unknown = [n for n in names if n not in CATALOG]
    if unknown:
        raise ValueError(f"--resources: {', '.join(unknown)} unknown; choose from {', '.join(CATALOG)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--resources: {value!r} names a resource twice")
    return tuple(CATALOG[n] for n in names)
