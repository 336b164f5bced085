"""Filter's holds and bind authorizations: who may hold cards until their bind, and where.

Filter books *tentatively*: the pod's best node (by the engine) is held for it from filter until
its bind. kube-scheduler binds asynchronously and starts the next pod's cycle at once; without the
tentative hold, the next filter would not see the previous pod's choice and, under binpack, pick
the very same card, only for one of the two binds to fail. The hold is released when the pod is
filtered again, when bind chooses another node, or after the assume timeout.

Filter also *authorizes* the bind: the pod (by key and UID) may be bound only to a node that filter
passed for it, until its bind, its deletion or the assume timeout. At most ``max_holds`` pods are
authorized (and hold cards) at once, and no namespace more than its share (podstate.py,
``PodStates.room_for``); a filter past that is refused with :class:`HoldLimit`, so no caller,
however many filters it sends, holds more than that many pods' worth of cards, and each pod holds
at most one node's.

Not thread-safe on its own: the cache's lock guards it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import numpy as np

from qgpu_runtime.extender.bookings import Bookings
from qgpu_runtime.extender.podstate import BindAuthorization, NodeNameSet, PodStates
from qgpu_runtime.model.requests import PodRequest
from qgpu_runtime.placement import engine
from qgpu_runtime.placement.state import ClusterState, StateError

log = logging.getLogger("qgpu_runtime.extender.cache")  # the cache's log, as before the split

DEFAULT_MAX_HOLDS = 1000


def default_holds_per_namespace(max_holds: int) -> int:
    """Half of ``max_holds``, rounded up: one namespace's pods stuck before their bind leave the
    other half to everyone else (podstate.py, ``PodStates.room_for``)."""
    return (max_holds + 1) // 2


class HoldLimit(RuntimeError):
    """Filter refused: ``max_holds`` pods already hold cards and await their bind."""


class HoldGate:
    """The caps on authorized pods, the tentative holds and the bind authorizations."""

    def __init__(self, pods: PodStates, bookings: Bookings, state: Callable[[], ClusterState],
                 max_holds: int, per_namespace: int) -> None:
        self.max_holds = max_holds
        self.per_namespace = per_namespace
        self.evictions = 0  # holds taken from the busiest namespace for another's pod (podstate.py)
        self._pods = pods
        self._bookings = bookings
        self._state = state  # the cache's current state, rebuilt when the nodes changed

    def check_room(self, key: str) -> None:
        """Raises :class:`HoldLimit` unless pod ``key`` is authorized already or may be now."""
        if self._pods.authorization(key) is not None:
            return
        room = self._pods.room_for(key, self.max_holds, self.per_namespace)
        if room.refusal is not None:
            raise HoldLimit(room.refusal)
        if room.evict is not None:
            log.warning("pod %s: its hold goes to pod %s of a namespace holding fewer (--max-holds %d reached); "
                        "its bind is refused and kube-scheduler schedules it again", room.evict, key, self.max_holds)
            self._bookings.release(self._state(), room.evict)
            self._pods.deauthorize(room.evict)
            self.evictions += 1

    def authorize(self, key: str, pod: Mapping[str, Any], names: list[str], now_ns: int) -> None:
        """Let ``pod`` be bound to one of ``names`` (none: no bind is allowed any more)."""
        if names:
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            self._pods.authorize(key, BindAuthorization(uid, NodeNameSet(names), now_ns))
        else:
            self._pods.deauthorize(key)

    def refusal(self, key: str, uid: str, node: str) -> str | None:
        """Why a bind of pod ``key`` (``uid``) to ``node`` is not one filter allowed; None if it is."""
        allowed = self._pods.authorization(key)
        if allowed is None:
            return (f"pod {key}: no filter of this extender passed it (or its hold expired or was released): "
                    "a bind must follow a filter")
        if uid != allowed.uid:
            return f"pod {key}: uid {uid!r} is not the uid {allowed.uid!r} that filter passed"
        if node not in allowed.nodes:
            return f"pod {key}: node {node} is not one that filter passed for it"
        return None

    def count(self) -> int:
        """Pods authorized to bind (holding cards if they asked for any)."""
        return self._pods.authorized_count()

    def hold(self, state: ClusterState, key: str, request: PodRequest, scored: engine.Scored, names: list[str],
             now_ns: int) -> str | None:
        """Hold the cards the ranking chose on the best node for the pod; that node, or None."""
        at = int(np.argmax(scored.score))  # the first of the best, in the scheduler's order
        best = names[at]
        try:
            # The cards the ranking chose on that node: what place() restricted to it would pick.
            placement = engine.placement_at(state, request, scored, int(scored.rows[at]))
            self._bookings.commit(state, key, placement)
        except (engine.Unschedulable, StateError) as exc:
            log.warning("pod %s: could not hold %s after filter: %s", key, best, exc)
            return None
        self._pods.hold(key, now_ns, request)
        return best

    def expire(self, state: ClusterState, now_ns: int, ttl_ns: int) -> None:
        """Release holds and withdraw authorizations older than the TTL (binds in flight aside)."""
        for key, since in self._pods.holds():
            if now_ns - since >= ttl_ns and self._pods.pinned(key) is None:
                self._bookings.release(state, key)
        for key, allowed in self._pods.authorizations():
            if now_ns - allowed.since_ns >= ttl_ns and self._pods.pinned(key) is None:
                self._pods.deauthorize(key)
