"""Bind's booking: pick the cards on the node the scheduler chose, book them and pin the record.

:meth:`Reservations.reserve` books the pod on one node, steering around what other binders
committed there (their commitments are booked for that one decision only, and filter's tentative
holds on the node yield to them). When filter held the pod's cards on that very node for the same
request and no other binder's commitment is to be steered around, the hold becomes the booking as
it is, without deciding again. The booking is *pinned* until the watch delivers the record our
bind wrote (podevents.py). :meth:`Reservations.unreserve` undoes it after a failed bind.

Not thread-safe on its own: the cache's lock guards it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from qgpu_runtime.contract.record import AllocationRecord
from qgpu_runtime.extender.bookings import Bookings
from qgpu_runtime.extender.podstate import PodStates
from qgpu_runtime.model.requests import PodRequest
from qgpu_runtime.placement import engine
from qgpu_runtime.placement.state import ClusterState, Placement, StateError

UNKNOWN_NODE = "node unknown to qgpu (not in the extender's node cache)"


class Reservations:
    """Books binds of this process on the cache's state."""

    def __init__(self, policy: Any, policy_name: str, pods: PodStates, bookings: Bookings,
                 state: Callable[[], ClusterState], report: Callable[[str], None]) -> None:
        self.policy = policy
        self.policy_name = policy_name
        self._pods = pods
        self._bookings = bookings
        self._state = state  # the cache's current state, rebuilt when the nodes changed
        self._report = report

    def reserve(self, key: str, request: PodRequest, node: str, now_ns: int,
                others: Mapping[str, Placement]) -> AllocationRecord:
        """Book pod ``key`` on ``node`` around ``others``; raises engine.Unschedulable when the
        node cannot take the pod (any more)."""
        state = self._state()
        self._pods.unpin(key)
        placement = self._held_here(state, key, request, node) if not others else None
        if placement is not None:
            self._bookings.keep_hold(key)
        else:
            placement = self._place(state, key, request, node, others)
        record = placement.record(self.policy_name, now_ns)
        self._pods.pin(key, record.to_json())
        self._pods.clear_stale(key)
        return record

    def _held_here(self, state: ClusterState, key: str, request: PodRequest, node: str) -> Placement | None:
        """Filter's hold of the pod when it is on ``node`` and was chosen for this very request.

        Its cards are booked in this state already, so every decision since was made around them,
        and they are what :func:`engine.place` on the node picked for the request at filter time;
        deciding again would cost the placement engine once more per bind (docs/benchmarks.md,
        issue 23) for, at most, other cards of the same node. With other binders' commitments to
        steer around (``others``), or when the request or the node differ, the bind decides anew."""
        held = state.bookings.get(key)
        if held is None or held.node != node or self._pods.held_for(key) != request:  # None: no hold
            return None
        return held

    def _place(self, state: ClusterState, key: str, request: PodRequest, node: str,
               others: Mapping[str, Placement]) -> Placement:
        """Release the pod's booking (a hold elsewhere, an earlier bind) and choose its cards on ``node``."""
        self._bookings.release(state, key)
        if node not in state.index:
            raise engine.Unschedulable(key, {node: UNKNOWN_NODE})
        mask = np.zeros(state.node_count, dtype=bool)
        mask[state.index[node]] = True
        added = self._book_others(state, node, others)
        try:
            placement = engine.place(state, request, self.policy, mask)
        finally:
            for other in added:
                state.release(other)  # booked only for this decision: the arrays are as before
        self._bookings.commit(state, key, placement)
        return placement

    def _book_others(self, state: ClusterState, node: str, others: Mapping[str, Placement]) -> list[str]:
        """Book other binders' commitments for one decision. A tentative hold of ours (a guess
        made at filter time) yields to them: it is dropped when they collide."""
        added = []
        for other, placement in others.items():
            try:
                state.commit(other, placement)
            except StateError:
                self._bookings.drop_holds(state, node)
                try:
                    state.commit(other, placement)
                except StateError as exc:  # the fit check against the commitments refuses the bind
                    self._report(f"node {node}: another binder's commitment does not fit this cache: {exc}")
                    continue
            added.append(other)
        return added

    def unreserve(self, key: str) -> None:
        """Undo :meth:`reserve` after a failed bind (the caller removed the record)."""
        self._pods.unpin(key)
        self._bookings.set_aside(self._state(), key)
        entry = self._pods.entry(key)
        if entry is not None and entry.record_raw is not None and not entry.node_name:
            self._pods.mark_stale(key, entry.record_raw)
