"""The booking lifecycle of each pod the extender tracks: one state object per pod.

For one pod key the extender remembers up to five things, each with its own lifetime:
- ``entry``: the pod's last watch event (its record, node, bind time, phase);
- ``held_since``: filter held its best node's cards for it (a guess until the bind), with
  ``held_for``, the request those cards were chosen for (a bind of the same request to that node
  takes them as they are: reservations.py);
- ``authorization``: the nodes filter passed for it, so a bind elsewhere is refused;
- ``pinned``: the record our own bind is writing; older events cannot overwrite its booking;
- ``stale``: a record known dead (expired, or given up by the scheduler), never booked again.

They used to be five dicts keyed by pod, which every path had to keep in step. ``PodStates`` keeps
one ``PodState`` per key, drops it once nothing is left in it, and counts the authorized pods, in
all and per namespace, so the hold caps are checked in O(1) on filter's hot path. Not thread-safe
on its own: the cache's lock guards it.

Holds are shared fairly between namespaces (issue 21 §5): pods that filter passed and that never
reach their bind (stuck in kube-scheduler's PreBind, say) keep their holds until the assume timeout,
and three of them once filled ``--max-holds`` and kept another namespace's pod out for 74 s. So no
namespace holds more than its share (``--max-holds-per-namespace``), and when all holds are taken,
a pod of a namespace holding fewer takes the oldest hold of the namespace holding most
(:meth:`PodStates.room_for`); the evicted pod's bind is then refused like any bind filter did not
allow, and kube-scheduler schedules it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from qgpu_runtime.contract.record import AllocationRecord
from qgpu_runtime.model.requests import PodRequest

_SEPARATOR = "\n"  # never in a node name (a DNS subdomain)


class NodeNameSet:
    """An immutable, exact set of node names, kept as one string.

    Every filter authorizes its pod for the nodes it passed, up to the whole cluster, and the pod
    keeps that until it is bound. As a frozenset, 5,000 names are a 16,384-slot table that Python's
    cycle collector walks on every collection while the pod waits; with a few hundred pods pending,
    each collection stalled filter for 10-80 ms at 5,000 nodes (docs/benchmarks.md, issue 14 §2).
    A str is not tracked by the collector, is built in one join, and answers membership with one
    substring search between separators, which only bind asks. A name holding the separator is
    no node's name and is left out.
    """

    __slots__ = ("_joined", "_count")

    def __init__(self, names: Iterable[str]) -> None:
        kept = [n for n in names if _SEPARATOR not in n]
        self._joined = _SEPARATOR + _SEPARATOR.join(kept) + _SEPARATOR if kept else ""
        self._count = len(kept)

    def __contains__(self, name: object) -> bool:
        return (isinstance(name, str) and _SEPARATOR not in name
                and f"{_SEPARATOR}{name}{_SEPARATOR}" in self._joined)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        return iter(self._joined[1:-1].split(_SEPARATOR) if self._count else ())

    def __repr__(self) -> str:
        return f"NodeNameSet({self._count} names)"


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
    priority: int = 0  # spec.priority, set by the apiserver's Priority admission from the PriorityClass
    deleting: bool = False  # metadata.deletionTimestamp is set: the pod is terminating
    nominated: str = ""  # status.nominatedNodeName: where kube-scheduler's preemption made room for it
    labels: tuple[tuple[str, str], ...] = ()  # metadata.labels: which PodDisruptionBudgets select it
    # ``record_raw`` as parsed when its signature was checked (None: not parsed, or malformed): the
    # booking's sync takes it instead of parsing the same text again
    record: AllocationRecord | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class BindAuthorization:
    """What filter allowed for one pod: bind to one of ``nodes``, for the pod with this UID."""

    uid: str
    nodes: NodeNameSet
    since_ns: int


def namespace_of(key: str) -> str:
    """The namespace of a pod key ``namespace/name``."""
    return key.split("/", 1)[0]


@dataclass(frozen=True)
class HoldRoom:
    """Whether a pod not yet authorized may take a hold: ``refusal`` says why not (None: it may),
    ``evict`` names the pod whose hold it takes first (None: there is room)."""

    refusal: str | None = None
    evict: str | None = None


@dataclass
class PodState:
    key: str
    entry: PodEntry | None = None
    held_since: int | None = None
    held_for: PodRequest | None = None
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
        self._per_namespace: dict[str, int] = {}  # authorized pods by namespace, none at 0
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

    def hold(self, key: str, now_ns: int, request: PodRequest | None = None) -> None:
        """``request``: what the held cards were chosen for (None: not known to be the pod's)."""
        state = self._of(key)
        state.held_since, state.held_for = now_ns, request
        self._held.add(key)

    def held_for(self, key: str) -> PodRequest | None:
        """The request pod ``key``'s hold was chosen for; None when it holds nothing or it is not known."""
        state = self._by_key.get(key)
        return state.held_for if state is not None and state.held_since is not None else None

    def unhold(self, key: str) -> None:
        state = self._by_key.get(key)
        if state is not None and state.held_since is not None:
            state.held_since = state.held_for = None
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
            namespace = namespace_of(key)
            self._per_namespace[namespace] = self._per_namespace.get(namespace, 0) + 1
        state.authorization = allowed

    def deauthorize(self, key: str) -> None:
        state = self._by_key.get(key)
        if state is not None and state.authorization is not None:
            state.authorization = None
            self._authorized -= 1
            namespace = namespace_of(key)
            left = self._per_namespace.get(namespace, 0) - 1
            if left > 0:
                self._per_namespace[namespace] = left
            else:
                self._per_namespace.pop(namespace, None)
            self._tidy(state)

    def authorized_count(self) -> int:
        return self._authorized

    def authorized_in(self, namespace: str) -> int:
        return self._per_namespace.get(namespace, 0)

    def room_for(self, key: str, max_holds: int, per_namespace: int) -> HoldRoom:
        """May pod ``key`` (not authorized yet) take a hold? Its namespace below ``per_namespace``,
        and either fewer than ``max_holds`` in all, or a namespace holding at least two more than
        its own would then hold, whose oldest hold not being bound right now it takes over. O(1)
        below the caps; at ``max_holds``, one pass over the namespaces and the busiest one's pods."""
        namespace = namespace_of(key)
        mine = self.authorized_in(namespace)
        full = self._authorized >= max_holds
        if mine >= per_namespace and not full:
            return HoldRoom(refusal=(
                f"namespace {namespace!r} already has {mine} pods holding cards that await their bind (at most "
                f"{per_namespace} per namespace, --max-holds-per-namespace); pod {key} is refused until some of "
                f"them are bound or expire"))
        if not full:
            return HoldRoom()
        busiest, most = max(self._per_namespace.items(), key=lambda item: (item[1], item[0]))
        if most > mine + 1 and mine < per_namespace:
            victim = self._oldest_unpinned(busiest)
            if victim is not None:
                return HoldRoom(evict=victim)
        return HoldRoom(refusal=(
            f"{self._authorized} pods already hold cards and await their bind (at most {max_holds}, --max-holds; "
            f"namespace {namespace!r} holds {mine}, the most any namespace holds is {most}); pod {key} is refused "
            f"until some are bound or expire"))

    def _oldest_unpinned(self, namespace: str) -> str | None:
        """The pod of ``namespace`` authorized longest ago whose bind is not in flight."""
        prefix = namespace + "/"
        candidates = [(s.authorization.since_ns, s.key) for s in self._by_key.values()
                      if s.authorization is not None and s.pinned is None and s.key.startswith(prefix)]
        return min(candidates)[1] if candidates else None

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
