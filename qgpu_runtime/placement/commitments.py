"""Per-node commitments: what every binder (any process) has promised on a node's cards.

The extender's cache and per-node lock only serialise binds inside one process. Two extenders (or
two kube-schedulers with leader election off, each with its own extender) each see a card free and
both bind onto it. The cure is one object per node that the apiserver arbitrates: a bind reads it,
re-checks its chosen cards against it, and writes it back with a resourceVersion precondition, so of
two binds deciding on the same state only one write succeeds and the other re-decides on fresh state.
The object's I/O lives in :mod:`qgpu_runtime.extender.commitments`; this module is the pure part: the
document format, the fit check and pruning. No I/O, no clock (times come in as arguments). ``since_ns``
is the writer's wall clock, for people and earlier releases; pruning goes by how long the pruning
binder itself has seen an entry (contract/observed.py), since binders' clocks disagree.

Document (annotation ``qgpu.io/commitments`` of the node's Lease), compact JSON::

    {"version": 1, "node": "gpu-1",
     "pods": {"<pod uid>": {"pod": "ns/name", "since_ns": 1700000000000000000,
                            "cards": [{"index": 0, "core_milli": 300, "memory_mib": 5120, "exclusive": false}]}}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping

from qgpu_runtime.contract.inventory import MAX_CARDS, MAX_INDEX, MAX_MEMORY_MIB
from qgpu_runtime.contract.names import COMMITMENTS
from qgpu_runtime.jsondoc import load_json
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD
from qgpu_runtime.placement.state import CardShare, ContainerPlacement, Placement

DOCUMENT_VERSION = 1


class CommitmentError(ValueError):
    """A commitment document that cannot be read; the message names the field, value and rule."""


@dataclass(frozen=True)
class CardUse:
    """One pod's total use of one card (all its containers on that card)."""

    index: int
    core_milli: int
    memory_mib: int
    exclusive: bool = False


@dataclass(frozen=True)
class Commitment:
    """One pod's promise on one node."""

    uid: str
    pod: str  # namespace/name, for people reading the Lease
    since_ns: int
    cards: tuple[CardUse, ...]

    @classmethod
    def of(cls, uid: str, pod: str, placement: Placement, now_ns: int) -> "Commitment":
        """The commitment a placement makes: its shares summed per card."""
        core: dict[int, int] = {}
        memory: dict[int, int] = {}
        exclusive: set[int] = set()
        for container in placement.containers:
            for share in container.shares:
                core[share.index] = core.get(share.index, 0) + share.core_milli
                memory[share.index] = memory.get(share.index, 0) + share.memory_mib
                if container.exclusive:
                    exclusive.add(share.index)
        return cls(uid, pod, now_ns, tuple(CardUse(i, core[i], memory[i], i in exclusive) for i in sorted(core)))

    def placement(self, node: str, uuids: Mapping[int, str]) -> Placement:
        """This commitment as a booking for a ClusterState (one pseudo-container per card, so an
        exclusive card and a shared one of the same pod stay what they are)."""
        return Placement(node, tuple(
            ContainerPlacement(f"card-{use.index}", (CardShare(use.index, uuids.get(use.index, ""), use.core_milli,
                                                               use.memory_mib),), use.exclusive)
            for use in self.cards))


@dataclass(frozen=True)
class NodeCommitments:
    node: str
    pods: Mapping[str, Commitment] = field(default_factory=dict)

    def to_json(self) -> str:
        doc = {"version": DOCUMENT_VERSION, "node": self.node, "pods": {
            uid: {"pod": c.pod, "since_ns": c.since_ns,
                  "cards": [{"index": u.index, "core_milli": u.core_milli, "memory_mib": u.memory_mib,
                             "exclusive": u.exclusive} for u in c.cards]}
            for uid, c in sorted(self.pods.items())}}
        return json.dumps(doc, separators=(",", ":"))

    def with_pod(self, commitment: Commitment) -> "NodeCommitments":
        return NodeCommitments(self.node, {**self.pods, commitment.uid: commitment})

    def without(self, uids: Iterable[str]) -> "NodeCommitments":
        drop = set(uids)
        return NodeCommitments(self.node, {u: c for u, c in self.pods.items() if u not in drop})


def _int(doc: Mapping[str, Any], name: str, where: str, minimum: int = 0, maximum: int | None = None) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CommitmentError(f"{COMMITMENTS}: {where}{name}={value!r}: must be an integer")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"within {minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise CommitmentError(f"{COMMITMENTS}: {where}{name}={value}: must be {bound}")
    return value


def parse_commitments(raw: str | None, node: str) -> NodeCommitments:
    """Decode the annotation (None or empty: nothing committed yet). Refuses a document written for
    another node, an unknown version and malformed fields, naming them."""
    if not raw:
        return NodeCommitments(node)
    doc = load_json(raw, dict, COMMITMENTS, CommitmentError)
    if doc.get("version") != DOCUMENT_VERSION:
        raise CommitmentError(f"{COMMITMENTS}: version={doc.get('version')!r}: only version {DOCUMENT_VERSION} is known")
    if doc.get("node") != node:
        raise CommitmentError(f"{COMMITMENTS}: node={doc.get('node')!r}: the document of node {node!r} must name it")
    pods_doc = doc.get("pods")
    if not isinstance(pods_doc, dict):
        raise CommitmentError(f"{COMMITMENTS}: pods={pods_doc!r}: must be an object keyed by pod UID")
    pods: dict[str, Commitment] = {}
    for uid, entry in pods_doc.items():
        where = f"pods[{uid!r}]."
        if not uid or not isinstance(entry, dict):
            raise CommitmentError(f"{COMMITMENTS}: pods[{uid!r}]={entry!r}: must be an object under a non-empty UID")
        pod = entry.get("pod")
        if not isinstance(pod, str):
            raise CommitmentError(f"{COMMITMENTS}: {where}pod={pod!r}: must be a string namespace/name")
        cards_doc = entry.get("cards")
        if not isinstance(cards_doc, list):
            raise CommitmentError(f"{COMMITMENTS}: {where}cards={cards_doc!r}: must be a list")
        cards = []
        for j, card in enumerate(cards_doc):
            at = f"{where}cards[{j}]."
            if not isinstance(card, dict):
                raise CommitmentError(f"{COMMITMENTS}: {at[:-1]}={card!r}: must be an object")
            exclusive = card.get("exclusive", False)
            if not isinstance(exclusive, bool):
                raise CommitmentError(f"{COMMITMENTS}: {at}exclusive={exclusive!r}: must be true or false")
            # the inventory's bounds: a number past them would overflow the engine's int64 arrays
            cards.append(CardUse(_int(card, "index", at, 0, MAX_INDEX), _int(card, "core_milli", at, 0, CORE_MILLI_PER_CARD),
                                 _int(card, "memory_mib", at, 0, MAX_MEMORY_MIB), exclusive))
        if len(cards) > MAX_CARDS:
            raise CommitmentError(f"{COMMITMENTS}: {where}cards: {len(cards)} entries: at most {MAX_CARDS}, a node's cards")
        pods[uid] = Commitment(uid, pod, _int(entry, "since_ns", where, 0, 2**63 - 1), tuple(cards))
    return NodeCommitments(node, pods)


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
