"""The extended resources the device plugin can serve, and how each one counts a card.

Kubelet only counts devices, so every resource is advertised as N device IDs per card, where N
is the resource's unit count on that card (100 per card for percent resources, one per GiB for
qgpu-memory and for nvidia.com/gpu, which HAMi's and KAI's shares use too, one per 256 MiB for
vcuda-memory, one per card for T9k's whole cards). Device IDs
name their card (``<short>-<card index>-<n>``) so pod-resources answers can be read back to cards.
T9k's ``nvidia-gpu-node`` is the exception: it counts nodes, so it is one device per node
(``<short>-node-0``), healthy only while every card is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model import requests as rq


@dataclass(frozen=True)
class ResourceKind:
    name: str
    short: str
    units_per_card: Callable[[CardInfo], int]
    description: str
    whole_node: bool = False  # one device for the node, not units per card

    @property
    def socket_name(self) -> str:
        return f"qgpu-{self.short}.sock"

    def device_id(self, card_index: int, unit: int) -> str:
        return f"{self.short}-{card_index}-{unit}"

    def device_ids(self, card: CardInfo) -> list[str]:
        return [self.device_id(card.index, n) for n in range(self.units_per_card(card))]

    @property
    def node_device_id(self) -> str:
        return f"{self.short}-node-0"

    def advertised(self, cards: Iterable[CardInfo]) -> dict[str, tuple[int, ...]]:
        """Every device ID advertised for this resource -> the cards whose health it carries."""
        cards = list(cards)
        if self.whole_node:
            return {self.node_device_id: tuple(c.index for c in cards)} if cards else {}
        return {d: (c.index,) for c in cards for d in self.device_ids(c)}

    def check_request(self, cards: dict[int, CardInfo], device_ids: Sequence[str]) -> None:
        """Refuse IDs this resource never advertised, and IDs named twice: kubelet only hands out
        advertised devices, once each, so either means a confused kubelet or a forged call, and
        answering it would grant cards nobody accounted for. ValueError names the ID and the rule."""
        seen: set[str] = set()
        for d in device_ids:
            if d in seen:
                raise ValueError(f"device ID {d!r} is named twice in one Allocate of {self.name}: each device "
                                 "is granted at most once")
            seen.add(d)
            if self.whole_node:
                if d != self.node_device_id:
                    raise ValueError(f"device ID {d!r} is not one this node advertises for {self.name}: the node "
                                     f"has one device, {self.node_device_id!r}")
                continue
            card = card_of_device(d)
            if card is None or d.rsplit("-", 2)[0] != self.short:
                raise ValueError(f"device ID {d!r} is not one this node advertises for {self.name}: IDs are "
                                 f"'{self.short}-<card index>-<unit>' in plain decimal")
            if card not in cards:
                raise ValueError(f"device ID {d!r} of {self.name} names card {card}; this node has cards "
                                 f"{sorted(cards)}")
            unit, units = int(d.rsplit("-", 1)[1]), self.units_per_card(cards[card])
            if unit >= units:
                raise ValueError(f"device ID {d!r} of {self.name}: unit {unit} is out of range; card {card} "
                                 f"has units 0..{units - 1}")


def canonical_index(text: str) -> int | None:
    """``text`` as an index written the way this plugin writes one (ASCII digits, no leading zero),
    else None. ``str.isdigit`` and ``int`` also take ``03``, ``٣`` and ``²``: spellings of IDs that
    were never advertised, which must not pass for the advertised ones."""
    if not (text.isascii() and text.isdigit()) or (len(text) > 1 and text[0] == "0"):
        return None
    return int(text)


def card_of_device(device_id: str) -> int | None:
    """The card index a device ID names, or None when it is not one of ours."""
    parts = device_id.rsplit("-", 2)
    if len(parts) != 3 or canonical_index(parts[2]) is None:
        return None
    return canonical_index(parts[1])


CATALOG: dict[str, ResourceKind] = {k.name: k for k in (
    ResourceKind(rq.QGPU_CORE, "qgpu-core", lambda c: 100, "percent of a card's compute"),
    ResourceKind(rq.QGPU_CORE_GREEDY, "qgpu-core-greedy", lambda c: 100, "offline pods' percent of a card's compute"),
    ResourceKind(rq.QGPU_MEMORY, "qgpu-memory", lambda c: c.memory_mib // 1024, "GiB of a card's memory"),
    ResourceKind(rq.VCUDA_CORE, "vcuda-core", lambda c: 100, "TKEStack vcuda: percent of a card"),
    ResourceKind(rq.VCUDA_MEMORY, "vcuda-memory", lambda c: c.memory_mib // rq.VCUDA_MEMORY_UNIT_MIB, "TKEStack vcuda: 256 MiB units"),
    ResourceKind(rq.T9K_GPU, "t9k-gpu", lambda c: 1, "T9k: whole cards"),
    ResourceKind(rq.T9K_GPU_PERCENT, "t9k-gpu-percent", lambda c: 100, "T9k: percent of a card's memory"),
    ResourceKind(rq.T9K_GPU_NODE, "t9k-gpu-node", lambda c: 0, "T9k: the whole node (one device per node)",
                 whole_node=True),
    ResourceKind(rq.NANO_PERCENT, "nano-gpu-percent", lambda c: 100, "nano-gpu: percent of a card"),
    ResourceKind(rq.NANO_CORE, "nano-gpu-core", lambda c: 100, "nano-gpu: percent of a card's compute"),
    ResourceKind(rq.NANO_MEMORY, "nano-gpu-memory", lambda c: c.memory_mib // 1024, "nano-gpu: GiB of a card's memory"),
    ResourceKind(rq.EGPU_CORE, "elasticgpu-core", lambda c: 100, "elastic GPU: percent of a card's compute"),
    ResourceKind(rq.EGPU_MEMORY, "elasticgpu-memory", lambda c: c.memory_mib // 1024, "elastic GPU: GiB of a card's memory"),
    # HAMi's vGPUs and KAI's fractions reach the kubelet as nvidia.com/gpu too (one device per share,
    # several shares per card), so the count per card must cover every share a card can take: the
    # extender's pod limit per card is at most one per GiB. Whole cards are the extender's to count.
    ResourceKind(rq.NVIDIA_GPU, "nvidia-gpu", lambda c: max(1, c.memory_mib // rq.MIB_PER_GIB),
                 "NVIDIA whole cards, HAMi vGPUs and KAI fractions: one device per GiB of the card"),
)}

# Every resource the extender can place: a pod of any dialect finds its resource advertised. Leave
# nvidia.com/gpu out (--resources) where NVIDIA's own device plugin runs: two plugins advertising
# one name make kubelet's count of it wrong (docs/node-manager.md, "Resources").
DEFAULT_RESOURCES = tuple(CATALOG)


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
