"""Is an allocation record consistent with the pod it sits on? The node's own check, pure.

Why, beside the signature: the node is the last line of defence. A signed record says the extender
chose these cards; this check says the grant is no larger than what the pod itself asks for, read
from the pod's own resources with the same parser the webhook and the extender use
(``model.requests.parse_pod``). A record granting a whole card to a pod that asks for 10% of one is
refused whoever wrote it (a hand-written record, a bug, an extender whose key leaked).

The parser runs with limits wide enough for any cluster setting (``min_shared_memory_mib`` and the
rest are admission rules, enforced by the webhook and the extender with the cluster's limits): the
node compares shapes, it does not re-judge admission.
"""

from __future__ import annotations

from qgpu_runtime.contract.record import AllocationRecord, ContainerPlacement
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, CardLimits, ContainerRequest, PodRequest

SHAPE_LIMITS = CardLimits(gib_per_shared_pod=1, min_shared_memory_mib=1, max_card_memory_mib=1 << 30,
                          max_cards_per_node=1 << 10)
"""Limits under which every pod the cluster admitted parses (the node checks shapes only)."""


def record_refusal(record: AllocationRecord, request: PodRequest, bound_to: str) -> str | None:
    """Why ``record`` grants more than ``request`` asks for (or on another node); None when consistent."""
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
        why = _container_refusal(placement, container)
        if why:
            return f"container {placement.name!r}: {why}"
    return None


def _container_refusal(placement: ContainerPlacement, asked: ContainerRequest) -> str | None:
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
        if asked.memory_pct is None and share.memory_mib > asked.memory_mib:
            return (f"card {share.index}: memory_mib={share.memory_mib}, the container asks for {asked.memory_mib}: "
                    "a record may grant at most what is asked")
    return None
