"""Is an allocation record consistent with the pod it sits on? The node's own check, pure.

Why, beside the signature: the node is the last line of defence. A signed record says the extender
chose these cards; this check says the grant is no larger than what the pod itself asks for, read
from the pod's own resources with the same parser the webhook and the extender use
(``model.requests.parse_pod``). A record granting a whole card to a pod that asks for 10% of one is
refused whoever wrote it (a hand-written record, a bug, an extender whose key leaked).

A share asked as a percent of a card's memory (KAI ``gpu-fraction``, T9k ``nvidia-gpu-percent``,
HAMi ``nvidia.com/gpumem-percentage``, nano-gpu ``gpu-percent``) is bounded by what that percent of
the named card's memory comes to, rounded as the placement engine books it
(``model.requests.percent_share_memory_mib``). The card's size is the node's own inventory (the
cards the node manager discovered), never the record's: a record naming a card this node does not
have (index unknown, or another UUID there) cannot be bounded and is refused.

The parser runs with limits wide enough for any cluster setting (``min_shared_memory_mib`` and the
rest are admission rules, enforced by the webhook and the extender with the cluster's limits): the
node compares shapes, it does not re-judge admission.
"""

from __future__ import annotations

from typing import Mapping

from qgpu_runtime.contract.record import AllocationRecord, CardShare, ContainerPlacement
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, CardLimits, ContainerRequest, PodRequest, percent_share_memory_mib

SHAPE_LIMITS = CardLimits(gib_per_shared_pod=1, min_shared_memory_mib=1, max_card_memory_mib=1 << 30,
                          max_cards_per_node=1 << 10)
"""Limits under which every pod the cluster admitted parses (the node checks shapes only)."""


def record_refusal(record: AllocationRecord, request: PodRequest, bound_to: str, cards: Mapping[int, CardInfo]) -> str | None:
    """Why ``record`` grants more than ``request`` asks for (or on another node); None when consistent.
    ``cards``: this node's cards by index, as the node manager discovered them."""
    if record.node != bound_to:
        return f"record node={record.node!r} but the pod's spec.nodeName={bound_to!r}: must be equal"
    if record.klass is not request.klass:
        return f"record class={record.klass.value!r} but the pod asks for class {request.klass.value!r}: must be equal"
    asked = {c.name: c for c in request.containers}
    for placement in record.containers:
        container = asked.get(placement.name)
        if container is None:
            return (f"record grants container {placement.name!r} cards, but that container asks for no GPU "
                    "resource: a record may grant only what the pod asks for")
        why = _container_refusal(placement, container, cards)
        if why:
            return f"container {placement.name!r}: {why}"
    return None


def _container_refusal(placement: ContainerPlacement, asked: ContainerRequest, cards: Mapping[int, CardInfo]) -> str | None:
    shares = placement.shares
    indices = [s.index for s in shares]
    if len(set(indices)) != len(indices):
        return f"record names card(s) {indices}: each card at most once"
    if not asked.whole_node and len(shares) != asked.cards:
        return f"record grants {len(shares)} card(s), the container asks for {asked.cards}: must be equal"
    for share in shares:
        if asked.exclusive or asked.whole_node:
            if share.core_milli != CORE_MILLI_PER_CARD:
                return (f"card {share.index}: core_milli={share.core_milli} for a whole-card request: "
                        f"must be {CORE_MILLI_PER_CARD}")
            continue
        if share.core_milli > asked.core_milli:
            return (f"card {share.index}: core_milli={share.core_milli}, the container asks for {asked.core_milli}: "
                    "a record may grant at most what is asked")
        if asked.memory_pct is not None:
            why = _percent_refusal(share, asked.memory_pct, cards)
            if why:
                return why
        elif share.memory_mib > asked.memory_mib:
            return (f"card {share.index}: memory_mib={share.memory_mib}, the container asks for {asked.memory_mib}: "
                    "a record may grant at most what is asked")
    return None


def _percent_refusal(share: CardShare, pct: int, cards: Mapping[int, CardInfo]) -> str | None:
    """A percent-of-memory share: at most ``pct`` % of the named card's memory, the card's size
    taken from this node's inventory; a card this node does not have is refused (fail closed)."""
    card = cards.get(share.index)
    if card is None or card.uuid != share.uuid:
        have = f"card {share.index} is {card.uuid}" if card else f"this node has no card {share.index}"
        return (f"card {share.index} ({share.uuid}): {have}, so the {pct}% of its memory the container asks for "
                "cannot be bounded: a record may grant only this node's cards")
    allowed = percent_share_memory_mib(card.memory_mib, pct)
    if share.memory_mib > allowed:
        return (f"card {share.index} ({share.uuid}): memory_mib={share.memory_mib}, the container asks for {pct}% of "
                f"the card's {card.memory_mib} MiB = {allowed} MiB: a record may grant at most what is asked")
    return None
