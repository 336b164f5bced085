"""What the extender believes about the cluster: nodes, pods, and the cards their records book.

Fed by watch events (see :mod:`qgpu_runtime.extender.watch`) and by the extender's own binds. All I/O
stays outside: events come in as API dicts, the clock comes in as an argument, and the records to
delete after expiry go out as return values. One lock guards everything, so a filter never sees a
half-applied bind and two binds can never book the same free capacity twice.

Bookings come from allocation records on pods:
- a pod with a record and ``spec.nodeName`` is *bound*: booked until it ends or is deleted;
- a pod with a record but no node is *assumed* (the bind is in flight, or it died half-way): booked
  until ``assume_ttl_ns`` after its ``qgpu.io/bind-time``, then released and its record returned for
  deletion; it is also released at once when the scheduler asks about that pod again, since then
  the scheduler has given up on that bind.
A bind this process is writing right now is *pinned*: watch events that still carry an older record
for that pod cannot overwrite the in-memory booking until the event carrying our record arrives.

Filter also books *tentatively*: the pod's best node (by the engine) is held for it from filter
until its bind. kube-scheduler binds asynchronously and starts the next pod's cycle at once; without
the tentative hold, the next filter would not see the previous pod's choice and, under binpack, pick
the very same card, only for one of the two binds to fail. The hold is released when the pod is
filtered again, when bind chooses another node, or after the assume timeout.

Filter also *authorizes* the bind: the pod (by key and UID) may be bound only to a node that filter
passed for it, until its bind, its deletion or the assume timeout. At most ``max_holds`` pods are
authorized (and hold cards) at once; a filter past that is refused with :class:`HoldLimit`, so no
caller, however many filters it sends, holds more than that many pods' worth of cards, and each
pod holds at most one node's.

Only records the extender signed for their pod are booked (contract/signature.py): a pod's annotations
are its owner's to write, so a record without a valid signature, or signed for another pod, node or
bind-time, books nothing and is reported (``problems``, the log). An assumed record whose bind-time
lies beyond now + ``assume_ttl_ns`` (another replica's clock far ahead) is expired at once.

The cache also keeps the full API object of every unbound live pod (by UID), as the watch delivers
it: the extender takes a pod's requests from there, not from the scheduler's request body.

Its parts: this module is the event mirror (nodes, pods by UID) and the lock that makes filter,
prioritize, bind and events atomic; each pod's booking lifecycle (last event, hold, authorization,
pinned and stale records) is one ``PodState`` in extender/podstate.py; what the hot path remembers
between calls (the last filter's scores, the never-fits rows per request shape) is extender/memo.py.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from itertools import compress
from typing import Any, Iterable, Mapping

import numpy as np

from qgpu_runtime.contract.names import FINISHED_PHASES
from qgpu_runtime.contract.record import ALLOCATION, BIND_TIME, AllocationRecord, RecordError, parse_record
from qgpu_runtime.contract.signature import RecordVerifier, UntrustedRecord, trusted_record
from qgpu_runtime.extender.memo import FilterMemo, NeverFits
from qgpu_runtime.extender.nodes import DRA_POOL_REASON, NodeInventoryError, dra_pool, node_spec, refused_spec
from qgpu_runtime.extender.podstate import BindAuthorization, NodeNameSet, PodEntry, PodStates
from qgpu_runtime.model.requests import DEFAULT_LIMITS, CardLimits, Dialect, PodRequest, RequestError, parse_pod
from qgpu_runtime.placement import engine
from qgpu_runtime.placement.commitments import Commitment, NodeCommitments, PodFate, as_placement
from qgpu_runtime.placement.state import ClusterState, NodeSpec, Placement, StateError

log = logging.getLogger(__name__)

TERMINAL_PHASES = FINISHED_PHASES
SEEN_PODS = 4096
DEFAULT_MAX_HOLDS = 1000


def default_holds_per_namespace(max_holds: int) -> int:
    """Half of ``max_holds``, rounded up: one namespace's pods stuck before their bind leave the
    other half to everyone else (podstate.py, ``PodStates.room_for``)."""
    return (max_holds + 1) // 2
GONE_PODS = 4096
PHANTOM = "commitment:"  # booking keys of other binders' commitments, present only inside reserve()
UNKNOWN_NODE = "node unknown to qgpu (not in the extender's node cache)"


@dataclass(frozen=True)
class FilterOutcome:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    held: str | None = None  # the node now held for the pod (its best)


class HoldLimit(RuntimeError):
    """Filter refused: ``max_holds`` pods already hold cards and await their bind."""


@dataclass(frozen=True)
class Expired:
    """An assumed record whose bind never happened: the I/O layer deletes it from the pod."""

    namespace: str
    name: str
    uid: str
    record_raw: str


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"


def _entry(pod: Mapping[str, Any], verifier: RecordVerifier) -> tuple[PodEntry, str | None]:
    """The pod as the cache keeps it, and why its record is not believed (None: no record, or a
    signed one). An unbelieved record is left out of the entry: the pod books nothing."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    record_raw = annotations.get(ALLOCATION)
    refusal = None
    if record_raw is not None:
        try:
            trusted_record(pod, verifier)
        except UntrustedRecord as exc:
            refusal, record_raw = str(exc), None
        except RecordError:
            pass  # malformed: _sync_booking reports it and books nothing
    try:
        bind_time: int | None = int(annotations.get(BIND_TIME, ""))
    except ValueError:
        bind_time = None
    cpu = mem = 0
    if record_raw is not None:  # CPU and memory only matter for pods that book cards
        try:
            request = parse_pod(pod)
            cpu, mem = request.cpu_milli, request.memory_mib
        except RequestError:
            pass
    return PodEntry(
        key=pod_key(pod),
        uid=str(meta.get("uid") or ""),
        node_name=str((pod.get("spec") or {}).get("nodeName") or ""),
        record_raw=record_raw,
        bind_time_ns=bind_time,
        terminal=(pod.get("status") or {}).get("phase") in TERMINAL_PHASES,
        cpu_milli=cpu,
        memory_mib=mem,
    ), refusal


class AllocationCache:
    """Nodes, pods and the ClusterState their records add up to; safe to share between threads."""

    def __init__(self, policy: Any, policy_name: str, limits: CardLimits = DEFAULT_LIMITS, assume_ttl_ns: int = 60 * 10**9,
                 max_holds: int = DEFAULT_MAX_HOLDS, max_holds_per_namespace: int | None = None, *, verifier: RecordVerifier):
        if max_holds < 1:
            raise ValueError(f"max_holds={max_holds}: must be >= 1")
        per_namespace = default_holds_per_namespace(max_holds) if max_holds_per_namespace is None else max_holds_per_namespace
        if per_namespace < 1:
            raise ValueError(f"max_holds_per_namespace={per_namespace}: must be >= 1")
        self.max_holds = max_holds
        self.verifier = verifier  # the extender's own public key: only records it signed are booked
        self._untrusted: dict[str, str] = {}  # pod key -> the refusal last reported (one report per change)
        self.max_holds_per_namespace = per_namespace
        self.hold_evictions = 0  # holds taken from the busiest namespace for another's pod (podstate.py)
        self.policy = policy
        self.policy_name = policy_name
        self.limits = limits
        self.assume_ttl_ns = assume_ttl_ns
        self.lock = threading.RLock()
        self._specs: dict[str, NodeSpec] = {}
        self._dra_pool: set[str] = set()  # nodes of DRA pools (extender/nodes.py dra_pool)
        self._invalid: dict[str, str] = {}  # node -> why its data was refused (extender/nodes.py)
        self._dra_rows = np.zeros(0, dtype=bool)  # by row of the current state: node of a DRA pool
        self._pods = PodStates()  # the booking lifecycle: one PodState per pod key
        self._state: ClusterState | None = None
        self._empty: ClusterState | None = None
        self._version = 0
        self._seen: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._unbound: dict[str, dict[str, Any]] = {}  # UID -> the pod as the apiserver has it
        self._uid_key: dict[str, str] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._never = NeverFits()
        self._memo: FilterMemo | None = None
        self.problems: list[str] = []
        self.synced = threading.Event()

    # -- state ---------------------------------------------------------------------------------

    def state(self) -> ClusterState:
        """The current ClusterState, rebuilt (bookings replayed) when the node set changed."""
        with self.lock:
            if self._state is None:
                specs = [self._specs[n] for n in sorted(self._specs)]
                fresh = ClusterState(specs, self.limits)
                old = self._bookings()
                for key, placement in old.items():
                    if placement.node not in fresh.index:
                        continue  # the node left; its pods are gone or will be
                    try:
                        fresh.commit(key, placement)  # version bumped below
                    except StateError as exc:
                        self._problem(f"cannot replay booking of {key} after a node change: {exc}")
                self._state = fresh
                self._dra_rows = np.fromiter((n in self._dra_pool for n in fresh.names), dtype=bool, count=fresh.node_count)
                self._version += 1
                self._never.clear()
                self._empty = ClusterState(specs, self.limits)
                for entry in self._pods.entries():
                    if entry.key not in fresh.bookings and self._pods.pinned(entry.key) is None:
                        self._sync_booking(fresh, entry)
            return self._state

    def _commit(self, state: ClusterState, key: str, placement: Placement) -> None:
        state.commit(key, placement)
        self._version += 1

    def _release(self, state: ClusterState, key: str) -> Placement | None:
        self._pods.unhold(key)
        self._version += 1
        return state.release(key)

    def _bookings(self) -> dict[str, Placement]:
        if self._state is not None:
            return dict(self._state.bookings)
        return {}

    def _problem(self, message: str) -> None:
        log.warning("%s", message)
        self.problems.append(message)
        del self.problems[:-100]

    def booking(self, key: str) -> Placement | None:
        with self.lock:
            return self.state().bookings.get(key)

    def node_specs(self) -> dict[str, NodeSpec]:
        """Every known node's spec by name (a copy; the DRA view takes CPU and memory from it)."""
        with self.lock:
            return dict(self._specs)

    def node_names(self) -> list[str]:
        with self.lock:
            return sorted(self._specs)

    # -- node events ---------------------------------------------------------------------------

    def apply_node(self, event: str, node: Mapping[str, Any]) -> None:
        name = str((node.get("metadata") or {}).get("name") or "")
        with self.lock:
            if event == "DELETED":
                self._dra_pool.discard(name)
                self._invalid.pop(name, None)
                if self._specs.pop(name, None) is not None:
                    self._state = None
                return
            try:
                spec = node_spec(node)
                self._invalid.pop(name, None)
            except NodeInventoryError as exc:
                # The node's own data is out of bounds: it takes nothing, and filter says why.
                if self._invalid.get(name) != str(exc):
                    self._problem(str(exc))
                self._invalid[name] = str(exc)
                spec = refused_spec(node)
            if dra_pool(spec):
                self._dra_pool.add(name)
            else:
                self._dra_pool.discard(name)
            if self._specs.get(name) != spec:
                self._specs[name] = spec
                self._state = None

    def replace_nodes(self, nodes: Iterable[Mapping[str, Any]]) -> None:
        """A full relist: nodes missing from it are gone."""
        with self.lock:
            seen = set()
            for node in nodes:
                seen.add(str((node.get("metadata") or {}).get("name") or ""))
                self.apply_node("MODIFIED", node)
            for name in list(self._specs):
                if name not in seen:
                    self.apply_node("DELETED", {"metadata": {"name": name}})

    # -- pod events ----------------------------------------------------------------------------

    def apply_pod(self, event: str, pod: Mapping[str, Any]) -> None:
        entry, refusal = _entry(pod, self.verifier)
        with self.lock:
            self._note_untrusted(entry.key, None if event == "DELETED" or entry.terminal else refusal)
            state = self.state()
            old = self._pods.entry(entry.key)
            if event == "DELETED" or entry.terminal or entry.node_name:
                self._unbound.pop(entry.uid, None)
                self._pods.deauthorize(entry.key)
            elif entry.uid:
                self._unbound[entry.uid] = dict(pod)
            if event == "DELETED" or entry.terminal:
                self._seen.pop(entry.uid, None)
                self._forget_uid(entry.uid)
                self._pods.drop_entry(entry.key)
                self._pods.unpin(entry.key)
                self._pods.clear_stale(entry.key)
                self._release(state, entry.key)
                return
            if old is not None and old.uid != entry.uid:
                self._unbound.pop(old.uid, None)
                self._forget_uid(old.uid)
                self._pods.deauthorize(entry.key)
                self._release(state, entry.key)  # same name, new pod
                self._pods.unpin(entry.key)
                self._pods.clear_stale(entry.key)
            self._pods.set_entry(entry)
            if entry.uid:
                self._uid_key[entry.uid] = entry.key
            if self._pods.held(entry.key) and not entry.node_name and entry.record_raw is None:
                return  # status updates of a pod being scheduled: keep the hold
            pinned = self._pods.pinned(entry.key)
            if pinned is not None:
                if entry.record_raw != pinned:
                    return  # an event from before our own write: our booking stands
                self._pods.unpin(entry.key)
            self._sync_booking(state, entry)

    def _note_untrusted(self, key: str, refusal: str | None) -> None:
        if refusal is None:
            self._untrusted.pop(key, None)
        elif self._untrusted.get(key) != refusal:
            self._untrusted[key] = refusal
            self._problem(f"pod {key}: allocation record not trusted, booked nowhere: {refusal}")

    def untrusted(self) -> dict[str, str]:
        """Pods whose records are refused as not qgpu's, with the reason (a copy)."""
        with self.lock:
            return dict(self._untrusted)

    def _forget_uid(self, uid: str) -> None:
        if not uid:
            return
        self._uid_key.pop(uid, None)
        self._gone[uid] = None
        self._gone.move_to_end(uid)
        while len(self._gone) > GONE_PODS:
            self._gone.popitem(last=False)

    def replace_pods(self, pods: Iterable[Mapping[str, Any]]) -> None:
        with self.lock:
            seen = set()
            for pod in pods:
                seen.add(pod_key(pod))
                self.apply_pod("MODIFIED", pod)
            for entry in list(self._pods.entries()):
                if entry.key not in seen:
                    ns, name = entry.key.split("/", 1)
                    self.apply_pod("DELETED", {"metadata": {"namespace": ns, "name": name, "uid": entry.uid}})

    def _sync_booking(self, state: ClusterState, entry: PodEntry) -> None:
        """Make the state's booking for this pod match its record."""
        if entry.record_raw is None or (not entry.node_name and self._pods.stale(entry.key) == entry.record_raw):
            self._release(state, entry.key)
            return
        try:
            record = parse_record(entry.record_raw)
        except RecordError as exc:
            self._problem(f"pod {entry.key}: {exc}")
            self._release(state, entry.key)
            return
        if entry.node_name and entry.node_name != record.node:
            self._problem(f"pod {entry.key}: bound to {entry.node_name} but its record names {record.node}; record ignored")
            self._release(state, entry.key)
            return
        placement = Placement.of_record(record, entry.cpu_milli, entry.memory_mib)
        current = state.bookings.get(entry.key)
        if current == placement:
            return
        self._release(state, entry.key)
        if placement.node not in state.index:
            return  # node not seen yet; booked when it arrives (rebuild replays pods below)
        try:
            self._commit(state, entry.key, placement)
        except StateError:
            # A record is the truth, a hold only filter's guess: holds on the node (made, e.g., by a
            # filter that arrived before the caches synced) yield. Otherwise the cache would count
            # less than the records book, and filter would keep offering a node that is full.
            self._drop_holds(state, placement.node)
            try:
                self._commit(state, entry.key, placement)
            except StateError as exc:
                self._problem(f"pod {entry.key}: record does not fit the cache: {exc}")

    # -- extender operations -------------------------------------------------------------------

    def _forget_stale_assumption(self, state: ClusterState, pod: Mapping[str, Any]) -> None:
        """The scheduler is placing this pod again, so any hold or unbound record of it is dead."""
        key = pod_key(pod)
        if (pod.get("spec") or {}).get("nodeName") or key not in state.bookings or self._pods.pinned(key) is not None:
            return
        entry = self._pods.entry(key)
        if entry is not None and entry.node_name:
            return
        self._release(state, key)
        if entry is not None and entry.record_raw is not None:
            self._pods.mark_stale(key, entry.record_raw)

    def seen_pod(self, uid: str) -> dict[str, Any] | None:
        """The pod as the scheduler last sent it to filter (bind gets only its name and UID)."""
        with self.lock:
            return self._seen.get(uid)

    def unbound_pod(self, uid: str) -> dict[str, Any] | None:
        """The unbound live pod with this UID as the watch last delivered it, or None."""
        with self.lock:
            return self._unbound.get(uid)

    def _check_hold_room(self, key: str) -> None:
        if self._pods.authorization(key) is not None:
            return
        room = self._pods.room_for(key, self.max_holds, self.max_holds_per_namespace)
        if room.refusal is not None:
            raise HoldLimit(room.refusal)
        if room.evict is not None:
            log.warning("pod %s: its hold goes to pod %s of a namespace holding fewer (--max-holds %d reached); "
                        "its bind is refused and kube-scheduler schedules it again", room.evict, key, self.max_holds)
            self._release(self.state(), room.evict)
            self._pods.deauthorize(room.evict)
            self.hold_evictions += 1

    def authorize(self, pod: Mapping[str, Any], names: list[str], now_ns: int) -> None:
        """Let ``pod`` be bound to one of ``names`` (a filter that holds no cards: a pod asking
        for nothing qgpu manages). Raises :class:`HoldLimit` at the cap."""
        key = pod_key(pod)
        with self.lock:
            self._check_hold_room(key)
            self._set_authorization(key, pod, names, now_ns)

    def _set_authorization(self, key: str, pod: Mapping[str, Any], names: list[str], now_ns: int) -> None:
        if names:
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            self._pods.authorize(key, BindAuthorization(uid, NodeNameSet(names), now_ns))
        else:
            self._pods.deauthorize(key)

    def bind_refusal(self, key: str, uid: str, node: str) -> str | None:
        """Why a bind of pod ``key`` (``uid``) to ``node`` is not one filter allowed; None if it is."""
        with self.lock:
            allowed = self._pods.authorization(key)
        if allowed is None:
            return (f"pod {key}: no filter of this extender passed it (or its hold expired or was released): "
                    "a bind must follow a filter")
        if uid != allowed.uid:
            return f"pod {key}: uid {uid!r} is not the uid {allowed.uid!r} that filter passed"
        if node not in allowed.nodes:
            return f"pod {key}: node {node} is not one that filter passed for it"
        return None

    def holds(self) -> int:
        """Pods authorized to bind (holding cards if they asked for any)."""
        with self.lock:
            return self._pods.authorized_count()

    def filter(self, pod: Mapping[str, Any], request: PodRequest, names: list[str], now_ns: int = 0) -> FilterOutcome:
        """Raises :class:`HoldLimit` when ``max_holds`` other pods await their bind."""
        key = pod_key(pod)
        with self.lock:
            self._check_hold_room(key)
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            if uid:
                self._seen[uid] = dict(pod)
                self._seen.move_to_end(uid)
                while len(self._seen) > SEEN_PODS:
                    self._seen.popitem(last=False)
            state = self.state()
            self._forget_stale_assumption(state, pod)
            scored = engine.score_rows(state, request, self.policy, state.rows_of(names))
            ok = scored.score >= 0
            failed: dict[str, str] = {}
            unresolvable: dict[str, str] = {}
            refused = None
            if self._dra_pool and any(c.dialect is not Dialect.NVIDIA for c in request.containers):
                # DRA pools map nvidia.com/gpu only; any other dialect would find no device plugin there
                dra = engine.at_rows(self._dra_rows, scored.rows, False)
                if dra.any():
                    unresolvable.update(dict.fromkeys(compress(names, dra.tolist()), DRA_POOL_REASON))
                    ok, refused = ok & ~dra, dra
                    scored.score[dra] = -1  # so the hold below never picks one
            if not ok.all():
                # Unknown nodes and nodes this shape could not fit even empty: preemption cannot help.
                never = self._never_fits(request)
                hopeless = ~ok & engine.at_rows(never, scored.rows, True)
                if refused is not None:
                    hopeless &= ~refused
                    ok_or_refused = ok | refused
                else:
                    ok_or_refused = ok
                for into, pick in ((unresolvable, hopeless), (failed, ~ok_or_refused & ~hopeless)):
                    if pick.any():
                        into.update(zip(compress(names, pick.tolist()),
                                        map(engine.REASONS.__getitem__, scored.code[pick].tolist())))
                self._name_invalid(failed, unresolvable)
            held = self._hold(state, key, request, scored, names, now_ns) if ok.any() else None
            passed = list(compress(names, ok.tolist()))
            self._set_authorization(key, pod, passed, now_ns)
            self._memo = FilterMemo(key, self._version, scored.node_score, state, passed, scored.rows[ok])
        return FilterOutcome(passed, failed, unresolvable, held)

    def _name_invalid(self, failed: dict[str, str], unresolvable: dict[str, str]) -> None:
        """Nodes whose data was refused fail with that reason (not "no GPUs"), as unresolvable:
        preemption on them cannot help until their manager publishes a valid inventory."""
        for name, why in self._invalid.items():
            if name in failed or name in unresolvable:
                failed.pop(name, None)
                unresolvable[name] = f"qgpu refused this node's data: {why}"

    def _never_fits(self, request: PodRequest) -> np.ndarray:
        """By state row: nodes that could not take this shape of request even empty (memo.py)."""
        assert self._empty is not None
        return self._never.rows(self._empty, request, self.policy)

    def _hold(self, state: ClusterState, key: str, request: PodRequest, scored: engine.Scored, names: list[str], now_ns: int) -> str | None:
        at = int(np.argmax(scored.score))  # the first of the best, in the scheduler's order
        best = names[at]
        try:
            # The cards the ranking chose on that node: what place() restricted to it would pick.
            placement = engine.placement_at(state, request, scored, int(scored.rows[at]))
            self._commit(state, key, placement)
        except (engine.Unschedulable, StateError) as exc:
            log.warning("pod %s: could not hold %s after filter: %s", key, best, exc)
            return None
        self._pods.hold(key, now_ns)
        return best

    def prioritize_scores(self, pod: Mapping[str, Any], request: PodRequest, names: list[str]) -> np.ndarray:
        """Scores aligned with ``names`` as if this pod held nothing yet (its own tentative hold is
        set aside); 0 for nodes that failed."""
        key = pod_key(pod)
        with self.lock:
            state = self.state()
            memo = self._memo
            if memo is not None and memo.state is state and names == memo.passed:
                rows = memo.passed_rows  # the list filter just answered, as kube-scheduler sends it back
            else:
                rows = state.rows_of(names)
            if memo is not None and memo.key == key and memo.version == self._version:
                node_score = memo.node_score  # nothing changed since this pod's filter
            else:
                held = state.bookings.get(key) if self._pods.held(key) else None
                if held is not None:
                    state.release(key)
                try:
                    node_score = engine.score_rows(state, request, self.policy, rows).node_score
                finally:
                    if held is not None:
                        state.commit(key, held)
        return engine.at_rows(node_score, rows, 0).clip(0, engine.MAX_SCORE)

    def prioritize(self, pod: Mapping[str, Any], request: PodRequest, names: list[str]) -> dict[str, int]:
        """:meth:`prioritize_scores` as a dict by node name."""
        return dict(zip(names, self.prioritize_scores(pod, request, names).tolist()))

    def reserve(self, pod: Mapping[str, Any], request: PodRequest, node: str, now_ns: int,
                others: Mapping[str, Placement] | None = None) -> AllocationRecord:
        """Pick cards on ``node`` and book them, pinned until our record shows up in the watch.

        ``others``: what other binders committed on the node that this cache does not book (from
        :meth:`foreign_commitments`); the choice steers around them. Raises engine.Unschedulable
        when the node cannot take the pod (any more).
        """
        key = pod_key(pod)
        with self.lock:
            state = self.state()
            self._pods.unpin(key)
            self._release(state, key)
            if node not in state.index:
                raise engine.Unschedulable(key, {node: UNKNOWN_NODE})
            mask = np.zeros(state.node_count, dtype=bool)
            mask[state.index[node]] = True
            added = self._book_others(state, node, others or {})
            try:
                placement = engine.place(state, request, self.policy, mask)
            finally:
                for other in added:
                    state.release(other)  # booked only for this decision: the arrays are as before
            self._commit(state, key, placement)
            record = placement.record(self.policy_name, now_ns)
            self._pods.pin(key, record.to_json())
            self._pods.clear_stale(key)
            return record

    def _book_others(self, state: ClusterState, node: str, others: Mapping[str, Placement]) -> list[str]:
        """Book other binders' commitments for one decision. A tentative hold of ours (a guess
        made at filter time) yields to them: it is dropped when they collide."""
        added = []
        for other, placement in others.items():
            try:
                state.commit(other, placement)
            except StateError:
                self._drop_holds(state, node)
                try:
                    state.commit(other, placement)
                except StateError as exc:  # the fit check against the commitments refuses the bind
                    self._problem(f"node {node}: another binder's commitment does not fit this cache: {exc}")
                    continue
            added.append(other)
        return added

    def _drop_holds(self, state: ClusterState, node: str) -> None:
        for held in [k for k, _ in self._pods.holds() if (b := state.bookings.get(k)) and b.node == node]:
            self._release(state, held)

    # -- commitments (other binders' promises, see placement/commitments.py) ---------------------

    def card_capacity(self, node: str) -> dict[int, int]:
        """Card index → memory MiB of ``node`` (empty for a node the cache does not know)."""
        with self.lock:
            spec = self._specs.get(node)
            return {c.index: c.memory_mib for c in spec.cards} if spec else {}

    def booked_on(self, node: str, except_key: str = "") -> list[Commitment]:
        """What this cache books on ``node`` from allocation records (bound pods, binds in flight),
        as commitments; filter's tentative holds are guesses, not promises, and are left out."""
        with self.lock:
            out = []
            for key, placement in self.state().bookings.items():
                if placement.node != node or key == except_key or self._pods.held(key) or key.startswith(PHANTOM):
                    continue
                entry = self._pods.entry(key)
                out.append(Commitment.of(entry.uid if entry and entry.uid else key, key, placement, 0))
            return out

    def foreign_commitments(self, commitments: NodeCommitments, except_uid: str) -> dict[str, Placement]:
        """The entries of ``commitments`` this cache does not already book from a record, as
        placements for :meth:`reserve`."""
        with self.lock:
            spec = self._specs.get(commitments.node)
            uuids = {c.index: c.uuid for c in spec.cards} if spec else {}
            state = self.state()
            out = {}
            for uid, c in commitments.pods.items():
                if uid == except_uid:
                    continue
                key = self._uid_key.get(uid)
                if key is not None and not self._pods.held(key) and key in state.bookings:
                    continue
                out[PHANTOM + uid] = as_placement(c, commitments.node, uuids)
            return out

    def fates(self, uids: Iterable[str], node: str) -> dict[str, PodFate]:
        """What this cache knows of each pod, for pruning a node's commitments."""
        with self.lock:
            out = {}
            for uid in uids:
                if uid in self._gone:
                    out[uid] = PodFate.GONE
                    continue
                entry = self._pods.entry(self._uid_key.get(uid, ""))
                if entry is None:
                    out[uid] = PodFate.UNKNOWN
                elif not entry.node_name:
                    out[uid] = PodFate.PENDING
                else:
                    out[uid] = PodFate.BOUND_HERE if entry.node_name == node else PodFate.BOUND_ELSEWHERE
            return out

    def unreserve(self, pod: Mapping[str, Any]) -> None:
        """Undo :meth:`reserve` after a failed bind (the caller removed the record)."""
        key = pod_key(pod)
        with self.lock:
            self._pods.unpin(key)
            self.state().release(key)
            entry = self._pods.entry(key)
            if entry is not None and entry.record_raw is not None and not entry.node_name:
                self._pods.mark_stale(key, entry.record_raw)

    def expire(self, now_ns: int) -> list[Expired]:
        """Release assumed records older than the TTL; return them so the caller deletes them.

        A record comes back on every call until its deletion shows up in the watch, so a failed
        delete is simply retried on the next round.
        """
        out: list[Expired] = []
        with self.lock:
            state = self.state()
            for key, since in self._pods.holds():
                if now_ns - since >= self.assume_ttl_ns and self._pods.pinned(key) is None:
                    self._release(state, key)
            for key, allowed in self._pods.authorizations():
                if now_ns - allowed.since_ns >= self.assume_ttl_ns and self._pods.pinned(key) is None:
                    self._pods.deauthorize(key)
            for entry in self._pods.entries():
                if entry.node_name or entry.record_raw is None or self._pods.pinned(entry.key) is not None:
                    continue
                if entry.bind_time_ns is not None and -self.assume_ttl_ns <= now_ns - entry.bind_time_ns < self.assume_ttl_ns:
                    continue  # in flight; a bind-time beyond now + the timeout is a clock far ahead: expired now
                self._release(state, entry.key)
                self._pods.mark_stale(entry.key, entry.record_raw)
                ns, name = entry.key.split("/", 1)
                out.append(Expired(ns, name, entry.uid, entry.record_raw))
        return out
