"""The ClusterState the cache's bookings add up to, and the one way to change it.

Every booking that outlives one call (a record's, a bind's, filter's tentative hold) is committed
and released here, so three things stay in step with the state's ``bookings``: the version number
(bumped on every change; the filter memo is valid only while it stands), a per-node index of the
booked pod keys (what :meth:`keys_on` answers without scanning the cluster), and the held set
(releasing a booking ends its hold). The state is rebuilt lazily after the node set changed, with
the rows of DRA-pool nodes and an empty copy of the state (for the never-fits rows, memo.py).

Not thread-safe on its own: the cache's lock guards it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from qgpu_runtime.extender.podstate import PodStates
from qgpu_runtime.model.requests import CardLimits
from qgpu_runtime.placement.state import ClusterState, NodeSpec, Placement, StateError


class Bookings:
    """The current ClusterState (None until rebuilt), its version and its per-node key index."""

    def __init__(self, limits: CardLimits, pods: PodStates, report: Callable[[str], None]) -> None:
        self.limits = limits
        self.current: ClusterState | None = None
        self._previous: ClusterState | None = None  # the state an invalidation set aside, to replay
        self.empty: ClusterState | None = None  # the same nodes with nothing booked
        self.version = 0
        self.dra_rows = np.zeros(0, dtype=bool)  # by row of the current state: node of a DRA pool
        self._by_node: dict[str, dict[str, None]] = {}  # node -> booked keys, in booking order
        self._pods = pods
        self._report = report

    def invalidate(self) -> None:
        """The node set changed: the next :meth:`rebuild` makes a new state, replaying this one's
        bookings (filter's holds and binds in flight have no record to be rebuilt from)."""
        if self.current is not None:
            self._previous = self.current
        self.current = None

    def rebuild(self, specs: list[NodeSpec], dra_pool: set[str]) -> ClusterState:
        """A new state for ``specs`` with the bookings that still have their node replayed."""
        fresh = ClusterState(specs, self.limits)
        before = self.current if self.current is not None else self._previous
        old = dict(before.bookings) if before is not None else {}
        self._previous = None
        for key, placement in old.items():
            if placement.node not in fresh.index:
                continue  # the node left; its pods are gone or will be
            # a record's (or a bind's in flight) on the cards the node lists now; filter's hold
            # whole or not at all (a hold of fewer cards than asked would become the bind's record)
            kept = placement if self._pods.held(key) else fresh.on_known_cards(placement)
            try:
                fresh.commit(key, kept)  # version bumped below
            except StateError as exc:
                self._report(f"cannot replay booking of {key} after a node change: {exc}")
        self.current = fresh
        self.dra_rows = np.fromiter((n in dra_pool for n in fresh.names), dtype=bool, count=fresh.node_count)
        self.version += 1
        self.empty = ClusterState(specs, self.limits)
        self._by_node = {}
        for key, placement in fresh.bookings.items():
            self._by_node.setdefault(placement.node, {})[key] = None
        return fresh

    def commit(self, state: ClusterState, key: str, placement: Placement) -> None:
        state.commit(key, placement)
        self._by_node.setdefault(placement.node, {})[key] = None
        self.version += 1

    def release(self, state: ClusterState, key: str) -> Placement | None:
        """Release the pod's booking and end its hold."""
        self._pods.unhold(key)
        self.version += 1
        return self.set_aside(state, key)

    def set_aside(self, state: ClusterState, key: str) -> Placement | None:
        """Release the booking only: the hold and the version stay (undoing a failed bind)."""
        placement = state.release(key)
        if placement is not None:
            keys = self._by_node.get(placement.node)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._by_node[placement.node]
        return placement

    def keep_hold(self, key: str) -> None:
        """The pod's hold becomes its booking as it is: the hold ends, the cards stay booked."""
        self._pods.unhold(key)
        self.version += 1

    def drop_holds(self, state: ClusterState, node: str) -> None:
        """Release filter's tentative holds on ``node`` (a record or a commitment needs the room)."""
        for held in [k for k, _ in self._pods.holds() if (b := state.bookings.get(k)) and b.node == node]:
            self.release(state, held)

    def keys_on(self, node: str) -> list[str]:
        """The keys booked on ``node`` in the order they were booked (the state's order)."""
        return list(self._by_node.get(node, ()))
