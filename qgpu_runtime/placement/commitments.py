"""Per-node commitments: what every binder (any process) has promised on a node's cards.

The extender's cache and per-node lock only serialise binds inside one process. Two extenders (or
two kube-schedulers with leader election off, each with its own extender) each see a card free and
both bind onto it. The cure is one object per node that the apiserver arbitrates: a bind reads it,
re-checks its chosen cards against it, and writes it back with a resourceVersion precondition, so of
two binds deciding on the same state only one write succeeds and the other re-decides on fresh state.
The document and its codec are the contract room's (:mod:`qgpu_runtime.contract.leases`), its I/O
is :mod:`qgpu_runtime.extender.commitments`; this module is the pure placement part: the fit check,
a commitment as a booking, and pruning. No I/O, no clock (times come in as arguments). Pruning goes
by how long the pruning binder itself has seen an entry (contract/observed.py), since binders'
clocks disagree.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable, Mapping

from qgpu_runtime.contract.leases import CardUse, Commitment, NodeCommitments
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD
from qgpu_runtime.placement.state import CardShare, ContainerPlacement, Placement


def as_placement(commitment: Commitment, node: str, uuids: Mapping[int, str]) -> Placement:
    """A commitment as a booking for a ClusterState (one pseudo-container per card, so an exclusive
    card and a shared one of the same pod stay what they are)."""
    return Placement(node, tuple(
        ContainerPlacement(f"card-{use.index}", (CardShare(use.index, uuids.get(use.index, ""), use.core_milli,
                                                           use.memory_mib),), use.exclusive)
        for use in commitment.cards))


def over_commitment(capacity: Mapping[int, int], held: Iterable[Commitment], new: Commitment) -> list[str]:
    """Why ``new`` cannot join ``held`` on a node whose cards have ``capacity`` (card index → memory
    MiB); empty when it fits. ``held`` is deduplicated by pod UID (the Lease and the allocation
    records name the same pod twice once it is bound) and never includes ``new``'s own pod.

    The rules are the engine's: core per card at most 100 %, memory at most the card's, and a card
    taken whole (exclusive) shares with nobody.
    """
    core: dict[int, int] = {}
    memory: dict[int, int] = {}
    holders: dict[int, int] = {}
    exclusive: set[int] = set()
    seen: set[str] = {new.uid}
    for c in held:
        if c.uid in seen:
            continue
        seen.add(c.uid)
        for use in c.cards:
            core[use.index] = core.get(use.index, 0) + use.core_milli
            memory[use.index] = memory.get(use.index, 0) + use.memory_mib
            holders[use.index] = holders.get(use.index, 0) + 1
            if use.exclusive:
                exclusive.add(use.index)
    problems = []
    for use in new.cards:
        card = f"card {use.index}"
        if use.index not in capacity:
            problems.append(f"{card}: the node has no such card")
            continue
        if use.index in exclusive:
            problems.append(f"{card}: taken whole by another pod")
            continue
        if use.exclusive and holders.get(use.index):
            problems.append(f"{card}: cannot be taken whole, {holders[use.index]} other pod(s) hold part of it")
            continue
        total_core = core.get(use.index, 0) + use.core_milli
        total_memory = memory.get(use.index, 0) + use.memory_mib
        if total_core > CORE_MILLI_PER_CARD:
            problems.append(f"{card}: core {total_core}‰ committed > {CORE_MILLI_PER_CARD}‰")
        if total_memory > capacity[use.index]:
            problems.append(f"{card}: memory {total_memory} MiB committed > {capacity[use.index]} MiB")
    return problems


class PodFate(Enum):
    """What the pruning binder knows about a committed pod."""

    BOUND_HERE = "bound to this node"
    BOUND_ELSEWHERE = "bound to another node"
    GONE = "deleted or finished"
    PENDING = "not bound yet"
    UNKNOWN = "not seen"


def observed(commitments: NodeCommitments) -> dict[str, tuple[int, tuple[CardUse, ...]]]:
    """What identifies each version of an entry, for :class:`~qgpu_runtime.contract.observed.FirstSeen`:
    an entry written again (new cards, a new stamp) is a new entry."""
    return {uid: (c.since_ns, c.cards) for uid, c in commitments.pods.items()}


def stale(commitments: NodeCommitments, fates: Mapping[str, PodFate], ages_ns: Mapping[str, int | float],
          grace_ns: int) -> list[str]:
    """UIDs whose entries can go when the document is rewritten.

    A pod deleted, finished or bound to another node no longer holds these cards. A pod not bound
    here (yet) keeps its entry until this binder has itself watched the entry for ``grace_ns``
    (``ages_ns``, by its own monotonic clock; an entry with no age was just seen): its binder may be
    between the Lease write and the Binding, or this binder's watch may lag the other's. After that
    the bind failed or the record on the bound pod (which every binder's cache counts) has taken over.
    The entry's ``since_ns`` is its writer's wall clock and decides nothing here: a writer whose clock
    runs ahead would stamp entries nobody ever prunes, one behind entries pruned on sight.
    """
    out = []
    for uid in commitments.pods:
        fate = fates.get(uid, PodFate.UNKNOWN)
        if fate in (PodFate.GONE, PodFate.BOUND_ELSEWHERE):
            out.append(uid)
        elif fate is not PodFate.BOUND_HERE and ages_ns.get(uid, 0) >= grace_ns:
            out.append(uid)
    return sorted(out)
