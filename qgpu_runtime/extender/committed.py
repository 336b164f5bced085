"""What the cache knows, put the way node commitments speak (placement/commitments.py).

The binder makes its choice safe against other binders through each node's commitment Lease; it
asks the cache for the node's card capacity, for what the cache books there from allocation
records (as commitments), for the Lease's entries the cache does not book (to steer around them),
and for what became of each pod of an entry (to prune it). Each answer is taken under the cache's
lock; what this cache books on a node comes from the per-node index (bookings.py), not a scan of
every booking in the cluster.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from qgpu_runtime.contract.leases import Commitment, NodeCommitments
from qgpu_runtime.extender.bookings import Bookings
from qgpu_runtime.extender.nodeview import NodeView
from qgpu_runtime.extender.podmirror import PodMirror
from qgpu_runtime.extender.podstate import PodStates
from qgpu_runtime.placement.commitments import PodFate, as_placement
from qgpu_runtime.placement.state import ClusterState, Placement

PHANTOM = "commitment:"  # booking keys of other binders' commitments, present only inside reserve()


class CommittedView:
    """The cache's answers for the node-commitments protocol."""

    def __init__(self, lock: threading.RLock, state: Callable[[], ClusterState], nodes: NodeView,
                 pods: PodStates, mirror: PodMirror, bookings: Bookings) -> None:
        self._lock = lock  # the cache's one lock
        self._state = state
        self._nodes = nodes
        self._pods = pods
        self._mirror = mirror
        self._bookings = bookings

    def card_capacity(self, node: str) -> dict[int, int]:
        """Card index → memory MiB of ``node`` (empty for a node the cache does not know)."""
        with self._lock:
            spec = self._nodes.spec(node)
            return {c.index: c.memory_mib for c in spec.cards} if spec else {}

    def booked_on(self, node: str, except_key: str = "") -> list[Commitment]:
        """What this cache books on ``node`` from allocation records (bound pods, binds in flight),
        as commitments; filter's tentative holds are guesses, not promises, and are left out."""
        with self._lock:
            bookings = self._state().bookings
            out = []
            for key in self._bookings.keys_on(node):
                placement = bookings.get(key)
                if placement is None or placement.node != node or key == except_key or self._pods.held(key) \
                        or key.startswith(PHANTOM):
                    continue
                entry = self._pods.entry(key)
                out.append(Commitment.of(entry.uid if entry and entry.uid else key, key, placement, 0))
            return out

    def foreign_commitments(self, commitments: NodeCommitments, except_uid: str) -> dict[str, Placement]:
        """The entries of ``commitments`` this cache does not already book from a record, as
        placements for the cache's ``reserve``."""
        with self._lock:
            spec = self._nodes.spec(commitments.node)
            uuids = {c.index: c.uuid for c in spec.cards} if spec else {}
            state = self._state()
            out = {}
            for uid, c in commitments.pods.items():
                if uid == except_uid:
                    continue
                key = self._mirror.key_of(uid)
                if key is not None and not self._pods.held(key) and key in state.bookings:
                    continue
                out[PHANTOM + uid] = as_placement(c, commitments.node, uuids)
            return out

    def fates(self, uids: Iterable[str], node: str) -> dict[str, PodFate]:
        """What this cache knows of each pod, for pruning a node's commitments."""
        with self._lock:
            out = {}
            for uid in uids:
                if self._mirror.gone(uid):
                    out[uid] = PodFate.GONE
                    continue
                entry = self._pods.entry(self._mirror.key_of(uid) or "")
                if entry is None:
                    out[uid] = PodFate.UNKNOWN
                elif not entry.node_name:
                    out[uid] = PodFate.PENDING
                else:
                    out[uid] = PodFate.BOUND_HERE if entry.node_name == node else PodFate.BOUND_ELSEWHERE
            return out
