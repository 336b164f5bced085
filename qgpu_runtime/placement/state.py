"""Cluster state for placement: nodes and their cards as numpy arrays.

One struct-of-arrays holds every node and card so that a policy scores all nodes in a handful of
vector operations; that is what lets the extender answer for 5,000 nodes in milliseconds and the
simulator replay a 10,000-pod trace in seconds. The state is plain data: no I/O, no clock. It is
mutated only through :meth:`ClusterState.commit` and :meth:`ClusterState.release`, both keyed, so
replaying the same allocation twice or releasing twice changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Mapping, Sequence

import numpy as np

from qgpu_runtime.contract.names import ACCELERATOR_LABEL, ALLOC_MODE_LABEL, ISOLATION_POLICY_LABEL, MIXED_LABEL
from qgpu_runtime.contract.record import AllocationRecord, CardShare, ContainerPlacement, rfc3339
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, DEFAULT_LIMITS, AppClass, CardLimits

__all__ = ["ACCELERATOR_LABEL", "ALLOC_MODE_LABEL", "ISOLATION_POLICY_LABEL", "MIXED_LABEL", "CardShare",
           "ContainerPlacement", "CardSpec", "NodeSpec", "Placement", "StateError", "ClusterState"]

ALLOC_MODES = {"": 0, "xgn": 1, "sgn": 2}


@dataclass(frozen=True)
class CardSpec:
    """One physical card as discovered on a node."""

    index: int
    uuid: str
    model: str
    memory_mib: int


@dataclass(frozen=True)
class NodeSpec:
    """A node's schedulable capacity: CPU and memory for pods, and its cards."""

    name: str
    cpu_milli: int
    memory_mib: int
    cards: tuple[CardSpec, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """Where a pod goes: the node, and for each GPU container the cards and shares."""

    node: str
    containers: tuple[ContainerPlacement, ...]
    klass: AppClass = AppClass.NORMAL
    cpu_milli: int = 0
    memory_mib: int = 0

    @property
    def gpu_milli(self) -> int:
        return sum(s.core_milli for c in self.containers for s in c.shares)

    @classmethod
    def of_record(cls, record: AllocationRecord, cpu_milli: int = 0, memory_mib: int = 0) -> Placement:
        """The engine's view of an allocation record, to book it into a ClusterState."""
        return cls(record.node, record.containers, record.klass, cpu_milli, memory_mib)

    def record(self, policy: str, epoch_ns: int) -> AllocationRecord:
        """The allocation record a bind of this placement writes."""
        return AllocationRecord(self.node, policy, self.klass, rfc3339(epoch_ns), self.containers)


class StateError(ValueError):
    """A commit or release that would corrupt the state (unknown node or card, over-commit)."""


class ClusterState:
    """Nodes and cards, with free capacity, as arrays indexed [node] and [node, card slot].

    Card slot ``j`` of node ``n`` holds the card whose position in the node's spec is ``j``; its
    physical index is ``card_index[n, j]``. Slots beyond a node's card count are invalid.
    """

    def __init__(self, nodes: Sequence[NodeSpec], limits: CardLimits = DEFAULT_LIMITS, enforce_pod_limit: bool = True):
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            dupes = sorted({x for x in names if names.count(x) > 1})
            raise StateError(f"node names must be unique, repeated: {', '.join(dupes)}")
        self.limits = limits
        self.names: list[str] = names
        self.index: dict[str, int] = {name: i for i, name in enumerate(names)}
        n = len(nodes)
        c = max([len(node.cards) for node in nodes] + [1])
        self.models: dict[str, int] = {}
        self.cpu_cap = np.array([node.cpu_milli for node in nodes], dtype=np.int64)
        self.mem_cap = np.array([node.memory_mib for node in nodes], dtype=np.int64)
        self.cpu_free = self.cpu_cap.copy()
        self.mem_free = self.mem_cap.copy()
        self.n_cards = np.array([len(node.cards) for node in nodes], dtype=np.int64)
        self.card_valid = np.zeros((n, c), dtype=bool)
        self.card_model = np.full((n, c), -1, dtype=np.int64)
        self.card_index = np.full((n, c), -1, dtype=np.int64)
        self.card_mem_cap = np.zeros((n, c), dtype=np.int64)
        self.card_uuid: list[list[str]] = []
        self.mixed = np.zeros(n, dtype=bool)
        self.alloc_mode = np.zeros(n, dtype=np.int64)
        self.isolation_policy: list[str] = []
        for i, node in enumerate(nodes):
            labels = dict(node.labels)
            self.mixed[i] = labels.get(MIXED_LABEL) == "enable"
            self.alloc_mode[i] = ALLOC_MODES.get(labels.get(ALLOC_MODE_LABEL, ""), 0)
            self.isolation_policy.append(labels.get(ISOLATION_POLICY_LABEL, "best-effort"))
            uuids = []
            seen: set[int] = set()
            for j, card in enumerate(node.cards):
                if card.index in seen:
                    raise StateError(f"node {node.name}: card index {card.index} appears twice")
                if card.memory_mib <= 0:
                    raise StateError(f"node {node.name}: card {card.index} memory_mib={card.memory_mib}: must be positive")
                seen.add(card.index)
                self.card_valid[i, j] = True
                self.card_model[i, j] = self.models.setdefault(card.model, len(self.models))
                self.card_index[i, j] = card.index
                self.card_mem_cap[i, j] = card.memory_mib
                uuids.append(card.uuid)
            self.card_uuid.append(uuids)
        # Nodes grouped by the set of GPU models they carry (one group per distinct set, usually one
        # per model): what a pod naming its models can use is decided per group, not per card.
        self.model_groups: list[frozenset[str]] = []
        group_ids: dict[frozenset[str], int] = {}
        self.node_group = np.zeros(n, dtype=np.int64)
        for i, node in enumerate(nodes):
            key = frozenset(card.model for card in node.cards)
            self.node_group[i] = group_ids.setdefault(key, len(group_ids))
        self.model_groups = list(group_ids)
        self.core_free = np.where(self.card_valid, CORE_MILLI_PER_CARD, 0).astype(np.int64)
        self.mem_free_card = self.card_mem_cap.copy()
        per_card = np.maximum(1, self.card_mem_cap // (limits.gib_per_shared_pod * 1024))
        if not enforce_pod_limit:  # the trace replay: the published study had no such limit
            per_card = np.full_like(per_card, np.iinfo(np.int32).max)
        self.pod_limit = np.where(self.card_valid, per_card, 0).astype(np.int64)
        self.pods = np.zeros((n, c), dtype=np.int64)
        self.exclusive = np.zeros((n, c), dtype=bool)
        self.online = np.zeros((n, c), dtype=np.int64)
        self.offline = np.zeros((n, c), dtype=np.int64)
        self.bookings: dict[str, Placement] = {}

    # -- derived views -------------------------------------------------------------------------

    def group_cards(self) -> np.ndarray:
        """[G] cards on the nodes of each model group."""
        return np.bincount(self.node_group, weights=self.n_cards, minlength=len(self.model_groups))

    @property
    def node_count(self) -> int:
        return len(self.names)

    def rows_of(self, names: Sequence[str]) -> np.ndarray:
        """Each name's row, -1 for names this state does not know (one C-level pass)."""
        return np.fromiter(map(self.index.get, names, repeat(-1)), dtype=np.int64, count=len(names))

    @property
    def max_cards(self) -> int:
        return self.card_valid.shape[1]

    def card_free_whole(self) -> np.ndarray:
        """[N, C] cards nobody holds any part of."""
        return self.card_valid & (self.pods == 0) & ~self.exclusive & (self.core_free == CORE_MILLI_PER_CARD)

    def gpu_free_milli(self) -> np.ndarray:
        """[N] unallocated compute per node, in thousandths of a card."""
        return np.where(self.exclusive, 0, self.core_free).sum(axis=1)

    def gpu_capacity_milli(self) -> int:
        return int(self.card_valid.sum()) * CORE_MILLI_PER_CARD

    def gpu_allocated_milli(self) -> int:
        return self.gpu_capacity_milli() - int(self.gpu_free_milli().sum())

    def on_known_cards(self, placement: Placement) -> Placement:
        """``placement`` without its shares on cards its node does not list now: a card marked
        unhealthy leaves the node's spec while the pods on it keep running, and their shares of
        the node's other cards must stay booked. Unchanged when every card is known, or the node
        is not (commit refuses that)."""
        n = self.index.get(placement.node)
        if n is None:
            return placement
        known = set(self.card_index[n][self.card_valid[n]].tolist())
        if all(share.index in known for container in placement.containers for share in container.shares):
            return placement
        return replace(placement, containers=tuple(
            replace(container, shares=tuple(share for share in container.shares if share.index in known))
            for container in placement.containers))

    def slot_of(self, node: int, card_index: int) -> int:
        slots = np.nonzero(self.card_index[node] == card_index)[0]
        if not len(slots):
            raise StateError(f"node {self.names[node]} has no card with index {card_index}")
        return int(slots[0])

    # -- mutation ------------------------------------------------------------------------------

    def commit(self, key: str, placement: Placement) -> None:
        """Book a placement under ``key``. Re-committing the same key with the same placement is a
        no-op; a different placement under a booked key, or one that does not fit, is refused."""
        if key in self.bookings:
            if self.bookings[key] == placement:
                return
            raise StateError(f"{key}: already booked on {self.bookings[key].node}; release it first")
        if placement.node not in self.index:
            raise StateError(f"{key}: unknown node {placement.node!r}")
        n = self.index[placement.node]
        if self.cpu_free[n] < placement.cpu_milli or self.mem_free[n] < placement.memory_mib:
            raise StateError(f"{key}: node {placement.node} lacks CPU or memory for this placement")
        changes: list[tuple[int, CardShare, bool]] = []
        for container in placement.containers:
            for share in container.shares:
                changes.append((self.slot_of(n, share.index), share, container.exclusive))
        self._check(key, placement, n, changes)
        for slot, share, exclusive in changes:
            self._apply(n, slot, share, exclusive, placement.klass, +1)
        self.cpu_free[n] -= placement.cpu_milli
        self.mem_free[n] -= placement.memory_mib
        self.bookings[key] = placement

    def release(self, key: str) -> Placement | None:
        """Free what ``key`` booked; releasing an unknown key is a no-op (returns None)."""
        placement = self.bookings.pop(key, None)
        if placement is None:
            return None
        n = self.index[placement.node]
        for container in placement.containers:
            for share in container.shares:
                self._apply(n, self.slot_of(n, share.index), share, container.exclusive, placement.klass, -1)
        self.cpu_free[n] += placement.cpu_milli
        self.mem_free[n] += placement.memory_mib
        return placement

    def _check(self, key: str, placement: Placement, n: int, changes: list[tuple[int, CardShare, bool]]) -> None:
        core = self.core_free[n].copy()
        mem = self.mem_free_card[n].copy()
        pods = self.pods[n].copy()
        excl = self.exclusive[n].copy()
        for slot, share, exclusive in changes:
            where = f"{key}: node {placement.node} card {share.index}"
            if excl[slot]:
                raise StateError(f"{where} is held exclusively")
            if exclusive:
                if pods[slot] or core[slot] != CORE_MILLI_PER_CARD:
                    raise StateError(f"{where} is shared and cannot be taken whole")
                excl[slot] = True
                continue
            if share.core_milli > core[slot] or share.memory_mib > mem[slot]:
                raise StateError(f"{where} lacks capacity: core {core[slot]} < {share.core_milli} or memory {mem[slot]} < {share.memory_mib}")
            if pods[slot] >= self.pod_limit[n, slot]:
                raise StateError(f"{where} already holds {pods[slot]} shared containers (limit {self.pod_limit[n, slot]})")
            core[slot] -= share.core_milli
            mem[slot] -= share.memory_mib
            pods[slot] += 1

    def _apply(self, n: int, slot: int, share: CardShare, exclusive: bool, klass: AppClass, sign: int) -> None:
        if exclusive:
            self.exclusive[n, slot] = sign > 0
            return
        self.core_free[n, slot] -= sign * share.core_milli
        self.mem_free_card[n, slot] -= sign * share.memory_mib
        self.pods[n, slot] += sign
        if klass is AppClass.ONLINE:
            self.online[n, slot] += sign
        elif klass is AppClass.OFFLINE:
            self.offline[n, slot] += sign

