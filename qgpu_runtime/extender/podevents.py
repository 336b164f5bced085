"""Pod events into bookings: what each pod's record books, and when a record is dead.

Bookings come from allocation records on pods:
- a pod with a record and ``spec.nodeName`` is *bound*: booked until it ends or is deleted;
- a pod with a record but no node is *assumed* (the bind is in flight, or it died half-way): booked
  until ``assume_ttl_ns`` after its ``qgpu.io/bind-time``, then released and its record returned for
  deletion (:meth:`PodEvents.expire`); it is also released at once when the scheduler asks about
  that pod again, since then the scheduler has given up on that bind
  (:meth:`PodEvents.forget_stale_assumption`).
A bind this process is writing right now is *pinned*: watch events that still carry an older record
for that pod cannot overwrite the in-memory booking until the event carrying our record arrives.
An assumed record whose bind-time lies beyond now + ``assume_ttl_ns`` (another replica's clock far
ahead) is expired at once.

Not thread-safe on its own: the cache's lock guards it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from qgpu_runtime.contract.record import RecordError, parse_record
from qgpu_runtime.extender.bookings import Bookings
from qgpu_runtime.extender.podmirror import PodMirror
from qgpu_runtime.extender.podstate import PodEntry, PodStates
from qgpu_runtime.extender.recordtrust import pod_key
from qgpu_runtime.placement.state import ClusterState, Placement, StateError


@dataclass(frozen=True)
class Expired:
    """An assumed record whose bind never happened: the I/O layer deletes it from the pod."""

    namespace: str
    name: str
    uid: str
    record_raw: str


class PodEvents:
    """Applies pod events to the pods' states, the mirror and the bookings."""

    def __init__(self, pods: PodStates, mirror: PodMirror, bookings: Bookings,
                 report: Callable[[str], None]) -> None:
        self._pods = pods
        self._mirror = mirror
        self._bookings = bookings
        self._report = report

    def apply(self, state: ClusterState, event: str, pod: Mapping[str, Any], entry: PodEntry) -> None:
        """One watch event of ``pod`` (``entry``: the pod as the cache keeps it)."""
        old = self._pods.entry(entry.key)
        if event == "DELETED" or entry.terminal or entry.node_name:
            self._mirror.drop_unbound(entry.uid)
            self._pods.deauthorize(entry.key)
        elif entry.uid:
            self._mirror.set_unbound(entry.uid, pod)
        if event == "DELETED" or entry.terminal:
            self._mirror.drop_seen(entry.uid)
            self._mirror.forget(entry.uid)
            self._pods.drop_entry(entry.key)
            self._pods.unpin(entry.key)
            self._pods.clear_stale(entry.key)
            self._bookings.release(state, entry.key)
            return
        if old is not None and old.uid != entry.uid:
            self._mirror.drop_unbound(old.uid)
            self._mirror.forget(old.uid)
            self._pods.deauthorize(entry.key)
            self._bookings.release(state, entry.key)  # same name, new pod
            self._pods.unpin(entry.key)
            self._pods.clear_stale(entry.key)
        self._pods.set_entry(entry)
        if entry.uid:
            self._mirror.link(entry.uid, entry.key)
        if self._pods.held(entry.key) and not entry.node_name and entry.record_raw is None:
            return  # status updates of a pod being scheduled: keep the hold
        pinned = self._pods.pinned(entry.key)
        if pinned is not None:
            if entry.record_raw != pinned:
                return  # an event from before our own write: our booking stands
            self._pods.unpin(entry.key)
        self.sync(state, entry)

    def sync(self, state: ClusterState, entry: PodEntry) -> None:
        """Make the state's booking for this pod match its record."""
        if entry.record_raw is None or (not entry.node_name and self._pods.stale(entry.key) == entry.record_raw):
            self._bookings.release(state, entry.key)
            return
        try:
            record = entry.record if entry.record is not None else parse_record(entry.record_raw)
        except RecordError as exc:
            self._report(f"pod {entry.key}: {exc}")
            self._bookings.release(state, entry.key)
            return
        if entry.node_name and entry.node_name != record.node:
            self._report(f"pod {entry.key}: bound to {entry.node_name} but its record names {record.node}; record ignored")
            self._bookings.release(state, entry.key)
            return
        # on the cards the node lists now: a card gone unhealthy leaves the pod's other cards booked
        placement = state.on_known_cards(Placement.of_record(record, entry.cpu_milli, entry.memory_mib))
        current = state.bookings.get(entry.key)
        if current == placement:
            return
        self._bookings.release(state, entry.key)
        if placement.node not in state.index:
            return  # node not seen yet; booked when it arrives (rebuild replays pods below)
        try:
            self._bookings.commit(state, entry.key, placement)
        except StateError:
            # A record is the truth, a hold only filter's guess: holds on the node (made, e.g., by a
            # filter that arrived before the caches synced) yield. Otherwise the cache would count
            # less than the records book, and filter would keep offering a node that is full.
            self._bookings.drop_holds(state, placement.node)
            try:
                self._bookings.commit(state, entry.key, placement)
            except StateError as exc:
                self._report(f"pod {entry.key}: record does not fit the cache: {exc}")

    def replay(self, state: ClusterState) -> None:
        """After a rebuild: book every pod's record as the new node set takes it (our binds in
        flight aside): those not booked yet, and those booked on fewer cards than they name (a card
        that was unhealthy is back: the pod's share of it is booked again)."""
        for entry in self._pods.entries():
            if self._pods.pinned(entry.key) is None and (
                    entry.key not in state.bookings or (entry.record_raw is not None and not self._pods.held(entry.key))):
                self.sync(state, entry)

    def forget_stale_assumption(self, state: ClusterState, pod: Mapping[str, Any]) -> None:
        """The scheduler is placing this pod again, so any hold or unbound record of it is dead."""
        key = pod_key(pod)
        if (pod.get("spec") or {}).get("nodeName") or key not in state.bookings or self._pods.pinned(key) is not None:
            return
        entry = self._pods.entry(key)
        if entry is not None and entry.node_name:
            return
        self._bookings.release(state, key)
        if entry is not None and entry.record_raw is not None:
            self._pods.mark_stale(key, entry.record_raw)

    def expire(self, state: ClusterState, now_ns: int, ttl_ns: int) -> list[Expired]:
        """Release assumed records older than the TTL (or stamped beyond now + the TTL), marked
        dead; returned so the caller deletes them (until the deletion shows in the watch)."""
        out: list[Expired] = []
        for entry in self._pods.entries():
            if entry.node_name or entry.record_raw is None or self._pods.pinned(entry.key) is not None:
                continue
            if entry.bind_time_ns is not None and -ttl_ns <= now_ns - entry.bind_time_ns < ttl_ns:
                continue  # in flight; a bind-time beyond now + the timeout is a clock far ahead: expired now
            self._bookings.release(state, entry.key)
            self._pods.mark_stale(entry.key, entry.record_raw)
            ns, name = entry.key.split("/", 1)
            out.append(Expired(ns, name, entry.uid, entry.record_raw))
        return out
