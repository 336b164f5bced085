"""The booking lifecycle of each pod the extender tracks: one state object per pod.

For one pod key the extender remembers up to five things, each with its own lifetime:
- ``entry``: the pod's last watch event (its record, node, bind time, phase);
- ``held_since``: filter held its best node's cards for it (a guess until the bind);
- ``authorization``: the nodes filter passed for it, so a bind elsewhere is refused;
- ``pinned``: the record our own bind is writing; older events cannot overwrite its booking;
- ``stale``: a record known dead (expired, or given up by the scheduler), never booked again.

They used to be five dicts keyed by pod, which every path had to keep in step. ``PodStates`` keeps
one ``PodState`` per key, drops it once nothing is left in it, and counts the authorized pods so
the hold cap is checked in O(1) on filter's hot path. Not thread-safe on its own: the cache's lock
guards it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class PodEntry:
    """The parts of a pod the cache needs, taken from its last event."""

    key: str
    uid: str
    node_name: str
    record_raw: str | None
    bind_time_ns: int | None
    terminal: bool
    cpu_milli: int
    memory_mib: int


@dataclass(frozen=True)
class BindAuthorization:
    """What filter allowed for one pod: bind to one of ``nodes``, for the pod with this UID."""

    uid: str
    nodes: frozenset[str]
    since_ns: int


@dataclass
class PodState:
    key: str
    entry: PodEntry | None = None
    held_since: int | None = None
    authorization: BindAuthorization | None = None
    pinned: str | None = None
    stale: str | None = None

    def empty(self) -> bool:
        return (self.entry is None and self.held_since is None and self.authorization is None
                and self.pinned is None and self.stale is None)


class PodStates:
    """PodState by pod key."""

    def __init__(self) -> None:
        self._by_key: dict[str, PodState] = {}
        self._authorized = 0
        self._held: set[str] = set()  # keys with held_since, so holds are found without a full scan

    def get(self, key: str) -> PodState | None:
        return self._by_key.get(key)

    def _of(self, key: str) -> PodState:
        state = self._by_key.get(key)
        if state is None:
            state = self._by_key[key] = PodState(key)
        return state

    def _tidy(self, state: PodState) -> None:
        if state.empty():
            self._by_key.pop(state.key, None)

    # -- last event --------------------------------------------------------------------------
    def entry(self, key: str) -> PodEntry | None:
        state = self._by_key.get(key)
        return state.entry if state else None

    def set_entry(self, entry: PodEntry) -> None:
        self._of(entry.key).entry = entry

    def drop_entry(self, key: str) -> None:
        state = self._by_key.get(key)
        if state is not None:
            state.entry = None
            self._tidy(state)

    def entries(self) -> Iterator[PodEntry]:
        return (s.entry for s in list(self._by_key.values()) if s.entry is not None)

    # -- tentative holds -----------------------------------------------------------------------
    def held(self, key: str) -> bool:
        return key in self._held

    def hold(self, key: str, now_ns: int) -> None:
        self._of(key).held_since = now_ns
        self._held.add(key)

    def unhold(self, key: str) -> None:
        state = self._by_key.get(key)
        if state is not None and state.held_since is not None:
            state.held_since = None
            self._held.discard(key)
            self._tidy(state)

    def holds(self) -> list[tuple[str, int]]:
        """(key, since) of every held pod."""
        return [(k, self._by_key[k].held_since) for k in list(self._held)]  # type: ignore[misc]

    # -- bind authorizations -------------------------------------------------------------------
    def authorization(self, key: str) -> BindAuthorization | None:
        state = self._by_key.get(key)
        return state.authorization if state else None

    def authorize(self, key: str, allowed: BindAuthorization) -> None:
        state = self._of(key)
        if state.authorization is None:
            self._authorized += 1
        state.authorization = allowed

    def deauthorize(self, key: str) -> None:
        state = self._by_key.get(key)
        if state is not None and state.authorization is not None:
            state.authorization = None
            self._authorized -= 1
            self._tidy(state)

    def authorized_count(self) -> int:
        return self._authorized

    def authorizations(self) -> list[tuple[str, BindAuthorization]]:
        return [(s.key, s.authorization) for s in list(self._by_key.values()) if s.authorization is not None]

    # -- our own binds in flight, and dead records ------------------------------------------------
    def pinned(self, key: str) -> str | None:
        state = self._by_key.get(key)
        return state.pinned if state else None

    def pin(self, key: str, record_raw: str) -> None:
        self._of(key).pinned = record_raw

    def unpin(self, key: str) -> None:
        state = self._by_key.get(key)
        if state is not None:
            state.pinned = None
            self._tidy(state)

    def stale(self, key: str) -> str | None:
        state = self._by_key.get(key)
        return state.stale if state else None

    def mark_stale(self, key: str, record_raw: str) -> None:
        self._of(key).stale = record_raw

    def clear_stale(self, key: str) -> None:
        state = self._by_key.get(key)
        if state is not None:
            state.stale = None
            self._tidy(state)

    def __len__(self) -> int:
        return len(self._by_key)
