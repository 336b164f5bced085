"""What the extender believes about the cluster: nodes, pods, and the cards their records book.

Fed by watch events (see :mod:`qgpu_runtime.extender.watch`) and by the extender's own binds. All I/O
stays outside: events come in as API dicts, the clock comes in as an argument, and the records to
delete after expiry go out as return values. One lock guards everything, so a filter never sees a
half-applied bind and two binds can never book the same free capacity twice.

:class:`AllocationCache` is the one door and owns that lock: each of its methods takes it and hands
the work to the parts below it, none of which locks on its own (``CommittedView``, which the binder
calls directly, takes the same lock):
- the node mirror, extender/nodeview.py; the pods' API objects by UID, extender/podmirror.py;
- which records are believed, and the pod as the cache keeps it, extender/recordtrust.py;
- each pod's booking lifecycle (last event, hold, authorization, pinned and stale records),
  extender/podstate.py; pod events into bookings and the expiry of dead records, extender/podevents.py;
- the ClusterState the bookings add up to, with its version and per-node index, extender/bookings.py;
- filter's holds and bind authorizations, extender/holds.py; filter's verdicts and prioritize's
  scores, extender/scoring.py (its memo, extender/memo.py); bind's booking, extender/reservations.py;
- the answers the node commitments need, extender/committed.py;
- T9k groups held at bind until complete (their members' bookings are binds' pinned bookings),
  extender/groups.py;
- the preempt verb's victims, chosen at card level (placement/preemption.py), and the cards they
  free held for the preemptor while they terminate, extender/nominations.py.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from itertools import compress
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from qgpu_runtime.contract.names import FINISHED_PHASES
from qgpu_runtime.contract.record import AllocationRecord
from qgpu_runtime.contract.signature import RecordVerifier
from qgpu_runtime.extender.bookings import Bookings
from qgpu_runtime.extender.budgets import DisruptionBudgets
from qgpu_runtime.extender.committed import CommittedView
from qgpu_runtime.extender.evictor import FailedCard, Target, targets
from qgpu_runtime.extender.groups import (
    DEFAULT_GROUP_TIMEOUT_S,
    GroupError,
    GroupKey,
    Groups,
    HeldMember,
    Listed,
    Progress,
    group_of,
    min_members,
)
from qgpu_runtime.extender.holds import DEFAULT_MAX_HOLDS, HoldGate, HoldLimit, default_holds_per_namespace
from qgpu_runtime.extender.memo import FilterMemo, ParsedRequests
from qgpu_runtime.extender.nodeview import NodeView, node_name
from qgpu_runtime.extender.nominations import NOMINATED, Nominations
from qgpu_runtime.extender.podevents import Expired, PodEvents
from qgpu_runtime.extender.podmirror import PodMirror
from qgpu_runtime.extender.podstate import PodEntry, PodStates, namespace_of
from qgpu_runtime.extender.recordtrust import UntrustedRecords, entry_of, pod_key, pod_priority
from qgpu_runtime.extender.reservations import Reservations
from qgpu_runtime.extender.scoring import Scorer
from qgpu_runtime.kube.podslim import kept
from qgpu_runtime.model.requests import DEFAULT_LIMITS, CardLimits, Dialect, PodRequest
from qgpu_runtime.placement.disruption import PodLabels, violating
from qgpu_runtime.placement.preemption import Candidate, FitBudget, choose_victims
from qgpu_runtime.placement.state import ClusterState, NodeSpec, Placement

__all__ = ["DEFAULT_MAX_HOLDS", "AllocationCache", "Expired", "FilterOutcome", "GroupError", "HoldLimit",
           "default_holds_per_namespace", "pod_key"]

log = logging.getLogger(__name__)

_SHOWN_ERROR = 200


def _cut(exc: BaseException) -> str:
    """An error's text for a log line, cut: it may quote what a pod's owner wrote."""
    text = str(exc)
    return text if len(text) <= _SHOWN_ERROR else f"{text[:_SHOWN_ERROR]}... ({len(text)} characters)"


@dataclass(frozen=True)
class FilterOutcome:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    held: str | None = None  # the node now held for the pod (its best)


@dataclass(frozen=True)
class NodePreemption:
    """The preempt verb's answer for one node: the victims' UIDs, and how many of them a
    PodDisruptionBudget protects (kube-scheduler ranks the nodes by that count first)."""

    uids: tuple[str, ...]
    pdb_violations: int


class AllocationCache:
    """Nodes, pods and the ClusterState their records add up to; safe to share between threads."""

    def __init__(self, policy: Any, policy_name: str, limits: CardLimits = DEFAULT_LIMITS, assume_ttl_ns: int = 60 * 10**9,
                 max_holds: int = DEFAULT_MAX_HOLDS, max_holds_per_namespace: int | None = None, *, verifier: RecordVerifier,
                 group_timeout_ns: int = int(DEFAULT_GROUP_TIMEOUT_S * 1e9), group_settle_ns: int = 0):
        if max_holds < 1:
            raise ValueError(f"max_holds={max_holds}: must be >= 1")
        per_namespace = default_holds_per_namespace(max_holds) if max_holds_per_namespace is None else max_holds_per_namespace
        if per_namespace < 1:
            raise ValueError(f"max_holds_per_namespace={per_namespace}: must be >= 1")
        self.max_holds = max_holds
        self.verifier = verifier  # the extender's own public key: only records it signed are booked
        self.max_holds_per_namespace = per_namespace
        self.policy = policy
        self.policy_name = policy_name
        self.limits = limits
        # pods as the apiserver has them, parsed once per version for filter, prioritize and bind
        self.requests = ParsedRequests()
        self.assume_ttl_ns = assume_ttl_ns
        self.lock = threading.RLock()
        self.problems: list[str] = []
        self.synced = threading.Event()
        self._nodes = NodeView(self._problem)
        self._pods = PodStates()  # the booking lifecycle: one PodState per pod key
        self._mirror = PodMirror()
        self._untrusted = UntrustedRecords(self._problem)  # pod key -> the refusal last reported
        # pod key -> (record, when): binds whose Binding failed without an answer on whether it landed
        self._unknown_binds: dict[str, tuple[str, int]] = {}
        self._booked = Bookings(limits, self._pods, self._problem)
        self._events = PodEvents(self._pods, self._mirror, self._booked, self._problem)
        self._holds = HoldGate(self._pods, self._booked, self.state, max_holds, per_namespace)
        self._scorer = Scorer(policy, self._nodes, self._booked, self._pods)
        self._reservations = Reservations(policy, policy_name, self._pods, self._booked, self.state, self._problem)
        self._groups = Groups(group_timeout_ns, group_settle_ns)
        self._nominations = Nominations(self._pods, self._booked, policy, self._problem)
        self.budgets = DisruptionBudgets(self._problem)  # fed by the watch; read by preempt
        self.group_timeout_s = group_timeout_ns / 1e9
        self.committed = CommittedView(self.lock, self.state, self._nodes, self._pods, self._mirror, self._booked)
        # pod key -> (resourceVersion, reason) of the live pods whose latest event could not be applied
        self._unapplied: dict[str, tuple[str, str]] = {}

    def _problem(self, message: str) -> None:
        log.warning("%s", message)
        self.problems.append(message)
        del self.problems[:-100]

    @property
    def hold_evictions(self) -> int:
        """Holds taken from the busiest namespace for another's pod (podstate.py)."""
        return self._holds.evictions

    @property
    def _memo(self) -> FilterMemo | None:
        return self._scorer.memo

    @_memo.setter
    def _memo(self, memo: FilterMemo | None) -> None:
        self._scorer.memo = memo

    # -- state and queries ---------------------------------------------------------------------

    def state(self) -> ClusterState:
        """The current ClusterState, rebuilt (bookings replayed) when the node set changed."""
        with self.lock:
            state = self._booked.current
            if state is None:
                state = self._booked.rebuild(self._nodes.sorted_specs(), self._nodes.dra_pool)
                self._scorer.never.clear()
                self._events.replay(state)
            return state

    def booking(self, key: str) -> Placement | None:
        with self.lock:
            return self.state().bookings.get(key)

    def node_specs(self) -> dict[str, NodeSpec]:
        """Every known node's spec by name (a copy; the DRA view takes CPU and memory from it)."""
        with self.lock:
            return self._nodes.specs()

    def node_names(self) -> list[str]:
        with self.lock:
            return self._nodes.names()

    def failed_cards(self) -> tuple[dict[str, dict[int, FailedCard]], list[Target]]:
        """The unhealthy cards of device-plugin nodes (DRA pools have device taints) and the pods whose
        signed records hold them (extender/evictor.py). Scans the pods only while a card is failed."""
        with self.lock:
            failed = {node: {i: FailedCard(i, uuid, reason) for i, (uuid, reason) in cards.items()}
                      for node, cards in self._nodes.failed.items() if node not in self._nodes.dra_pool}
            return failed, (targets(failed, self._pods.entries()) if failed else [])

    def untrusted(self) -> dict[str, str]:
        """Pods whose records are refused as not qgpu's, with the reason (a copy)."""
        with self.lock:
            return self._untrusted.copy()

    def seen_pod(self, uid: str) -> dict[str, Any] | None:
        """The pod filter last decided for, as the apiserver has it (bind gets only its name and UID)."""
        with self.lock:
            return self._mirror.seen(uid)

    def unbound_pod(self, uid: str) -> dict[str, Any] | None:
        """The unbound live pod with this UID as the watch last delivered it, or None."""
        with self.lock:
            return self._mirror.unbound(uid)

    def holds(self) -> int:
        """Pods authorized to bind (holding cards if they asked for any)."""
        with self.lock:
            return self._holds.count()

    # -- watch events --------------------------------------------------------------------------

    def apply_node(self, event: str, node: Mapping[str, Any]) -> None:
        with self.lock:
            changed = self._nodes.apply(event, node)
            if self._nodes.take_due() or changed:  # and what waited on the pacer (extender/pacing.py)
                self._booked.invalidate()

    def take_due_nodes(self) -> None:
        """Apply the node specs the pacer held back whose nodes may change again (the expiry loop
        asks every period, node events at each event). Only here, at the top of a locked call:
        inside one, a rebuild would leave the caller working on a discarded state."""
        with self.lock:
            if self._nodes.take_due():
                self._booked.invalidate()

    def replace_nodes(self, nodes: Iterable[Mapping[str, Any]]) -> None:
        """A full relist: nodes missing from it are gone."""
        with self.lock:
            seen = set()
            for node in nodes:
                seen.add(node_name(node))
                self.apply_node("MODIFIED", node)
            for name in list(self._nodes.specs()):
                if name not in seen:
                    self.apply_node("DELETED", {"metadata": {"name": name}})

    def apply_pod(self, event: str, pod: Mapping[str, Any]) -> None:
        """One watch event of ``pod``. Never raises: the watch of every pod, and each relist, goes
        through here, so one pod whose event cannot be applied (a value no parser foresaw) would
        otherwise stop the cache for all of them (:meth:`_unapplied_event` says what is kept)."""
        try:
            self._apply_pod(event, pod)
        except Exception as exc:  # noqa: BLE001 - one pod's event must not stop the watch of all pods
            self._unapplied_event(event, pod, exc)

    def _apply_pod(self, event: str, pod: Mapping[str, Any]) -> None:
        # What a pod's owner writes is read (kept, entry_of) before the first change below, so an
        # event that fails there changes nothing.
        pod = kept(pod)  # what every part below reads, and holds no more than (kube/podslim.py)
        entry, refusal = entry_of(pod, self.verifier)
        with self.lock:
            self._untrusted.note(entry.key, None if event == "DELETED" or entry.terminal else refusal)
            state = self.state()
            leaving = event == "DELETED" or entry.terminal
            # A victim's booking as it was before its release: kept for the pod that preempted it.
            victim = state.bookings.get(entry.key) if leaving and self._nominations.waits_for(entry.key) else None
            self._events.apply(state, event, pod, entry)
            if leaving and entry.uid:
                self.requests.forget(entry.uid)  # a deleted or finished pod's parse (extender/memo.py)
            if leaving and self._nominations.waits_for(entry.key):
                self._nominations.victim_left(state, entry.key, victim)
            if self._nominations.has(entry.key):
                offers = self._nominations.offers(entry.key)
                if leaving or entry.node_name or any(o.uid != entry.uid for o in offers.values()):
                    self._nominations.clear(state, entry.key)  # bound, gone, or another pod of that name
                else:
                    self._nominations.nominated(state, entry.key, entry.nominated)
            # A member deleted or replaced drops its group hold; the event above released its booking.
            self._groups.observe(entry.key, pod, event == "DELETED" or entry.terminal, bool(entry.node_name))
            self._unapplied.pop(entry.key, None)

    def _unapplied_event(self, event: str, pod: Mapping[str, Any], exc: Exception) -> None:
        """An event of ``pod`` that raised ``exc``: reported once per pod version and reason, and
        kept in :meth:`unapplied` (the ``qgpu_extender_unapplied_pods`` gauge) until one applies.

        The pod keeps the state the cache had of it (its booking, hold and group membership): the
        event is skipped, and a relist still listing the pod does not take it for gone. Dropping it
        instead would free the cards a bound pod holds on its node, and the next filter would give
        them to another pod (two pods on one card's share); keeping it at worst keeps cards booked
        that were meanwhile freed (a refusal, never an over-commit) until an event of the pod
        applies, it ends, or a relist leaves it out. A pod whose first event fails (after a restart:
        no state yet) books nothing until one applies: the node's own check of its grants
        (node/overbooking.py) is then what keeps a second pod off its cards. An event that says the
        pod left (DELETED, Succeeded, Failed) is applied as the bare deletion a relist makes, which
        reads nothing of the pod but its name and UID: a pod that is gone holds no cards."""
        try:
            key = pod_key(pod)
            meta = pod.get("metadata") or {}
            uid, version = str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")
            leaving = event == "DELETED" or (pod.get("status") or {}).get("phase") in FINISHED_PHASES
        except Exception:  # noqa: BLE001 - not even its name can be read: nothing of it can be kept either
            log.warning("a pod %s event the cache cannot read was skipped (%s)", event, _cut(exc))
            return
        ns, name = key.split("/", 1)
        with self.lock:
            if leaving:
                self._unapplied.pop(key, None)
                self._problem(f"pod {key}: its {event} event could not be applied ({_cut(exc)}); "
                              "applied as the pod's deletion")
                try:
                    self._apply_pod("DELETED", {"metadata": {"namespace": ns, "name": name, "uid": uid}})
                except Exception as again:  # noqa: BLE001 - the next relist, which no longer lists it, tries again
                    log.warning("pod %s: its deletion could not be applied either (%s)", key, _cut(again))
                return
            reason = f"{type(exc).__name__}: {_cut(exc)}"
            if self._unapplied.get(key) == (version, reason):
                return  # this version of the pod was reported already (a relist delivers it again)
            self._unapplied[key] = (version, reason)
            self._problem(f"pod {key}: its {event} event (resourceVersion {version or 'unknown'}) could not be applied "
                          f"({reason}); the pod keeps the state the cache had of it until an event of it applies")

    def unapplied(self) -> dict[str, str]:
        """Live pods whose latest event could not be applied, with the reason (a copy)."""
        with self.lock:
            return {key: reason for key, (_, reason) in self._unapplied.items()}

    def replace_pods(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """A full relist. A pod whose event cannot be applied is still listed: it keeps its state
        (:meth:`_unapplied_event`) and the others are applied."""
        with self.lock:
            seen = set()
            for pod in pods:
                self.apply_pod("MODIFIED", pod)  # never raises
                try:
                    seen.add(pod_key(pod))
                except Exception:  # noqa: BLE001 - reported by apply_pod; nameless, it keeps nothing
                    continue
            for entry in list(self._pods.entries()):
                if entry.key not in seen:
                    ns, name = entry.key.split("/", 1)
                    self.apply_pod("DELETED", {"metadata": {"namespace": ns, "name": name, "uid": entry.uid}})
            for key in [k for k in self._unapplied if k not in seen]:
                del self._unapplied[key]  # gone while the watch was down

    # -- the scheduler's verbs -----------------------------------------------------------------

    def authorize(self, pod: Mapping[str, Any], names: list[str], now_ns: int) -> None:
        """Let ``pod`` be bound to one of ``names`` (a filter that holds no cards: a pod asking
        for nothing qgpu manages). Raises :class:`HoldLimit` at the cap."""
        key = pod_key(pod)
        with self.lock:
            self._holds.check_room(key)
            self._holds.authorize(key, pod, names, now_ns)

    def bind_refusal(self, key: str, uid: str, node: str) -> str | None:
        """Why a bind of pod ``key`` (``uid``) to ``node`` is not one filter allowed; None if it is."""
        with self.lock:
            return self._holds.refusal(key, uid, node)

    def filter(self, pod: Mapping[str, Any], request: PodRequest, names: list[str], now_ns: int = 0) -> FilterOutcome:
        """Raises :class:`HoldLimit` when ``max_holds`` other pods await their bind, and
        :class:`GroupError` for a group member that may not be held (bad annotation, the group
        resting after its timeout)."""
        key = pod_key(pod)
        group = group_of(pod)
        with self.lock:
            if group is not None:
                self._groups.check_may_hold(group, key, now_ns)
                min_members(pod)
            self._holds.check_room(key)
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            if uid:
                self._mirror.saw(uid, pod)
            held = self._groups.held(key)
            if held is not None and held.uid == uid and held.node in names:
                return self._filter_held(key, pod, held, names, now_ns)
            if held is not None:  # the scheduler no longer offers its node (or a new pod took the name)
                self._release_member(held)
            state = self.state()
            self._events.forget_stale_assumption(state, pod)
            aside = self._nominations.set_aside(state, key)  # what its preemption holds is its own
            try:
                verdict = self._scorer.judge(state, request, names)
                scored, ok = verdict.scored, verdict.ok
                held = self._holds.hold(state, key, request, scored, names, now_ns) if ok.any() else None
            finally:
                self._nominations.restore(state, key, aside)
            passed = list(compress(names, ok.tolist()))
            self._holds.authorize(key, pod, passed, now_ns)
            self._scorer.memo = FilterMemo(key, self._booked.version, scored.node_score, state, passed, scored.rows[ok])
        return FilterOutcome(passed, verdict.failed, verdict.unresolvable, held)

    def _filter_held(self, key: str, pod: Mapping[str, Any], held: HeldMember, names: list[str],
                     now_ns: int) -> FilterOutcome:
        """A group member whose bind holds cards passes only the held node, and keeps its hold."""
        self._holds.authorize(key, pod, [held.node], now_ns)
        reason = f"the pod's cards are held on node {held.node} while its group waits (all or none)"
        return FilterOutcome([held.node], {n: reason for n in names if n != held.node}, {}, held.node)

    def prioritize_scores(self, pod: Mapping[str, Any], request: PodRequest, names: list[str]) -> np.ndarray:
        """Scores aligned with ``names`` as if this pod held nothing yet (its own tentative hold is
        set aside); 0 for nodes that failed."""
        key = pod_key(pod)
        with self.lock:
            return self._scorer.prioritize(self.state(), key, request, names)

    def prioritize(self, pod: Mapping[str, Any], request: PodRequest, names: list[str]) -> dict[str, int]:
        """:meth:`prioritize_scores` as a dict by node name."""
        return dict(zip(names, self.prioritize_scores(pod, request, names).tolist()))

    # -- preemption (placement/preemption.py, extender/nominations.py) ---------------------------

    def preempt(self, pod: Mapping[str, Any], request: PodRequest, offered: Mapping[str, Sequence[str]],
                now_ns: int) -> dict[str, NodePreemption]:
        """Per node of ``offered`` (node -> the UIDs kube-scheduler's dry run would evict there),
        the victims that let ``pod`` fit at card level; nodes where none do are left out.

        Victims are pods this cache's watch has bound to that node, not terminating, of a priority
        (as the watch has it) strictly below the pod's. qgpu chooses among those that book cards;
        kube-scheduler's own victims that book none here (it chose them for CPU, memory or other
        node-level resources) are kept as it chose them. A victim a PodDisruptionBudget protects is
        evicted only where no set of unprotected ones helps, and counted in ``pdb_violations``
        (placement/disruption.py). Where qgpu names victims, what they free is offered to the pod
        (extender/nominations.py)."""
        key = pod_key(pod)
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        priority = pod_priority(pod)
        other_dialect = any(c.dialect is not Dialect.NVIDIA for c in request.containers)
        # Gathered under the lock; chosen outside it (the chooser works on one-node copies), so
        # filters are not held up by a preempt call.
        gathered: list[tuple[str, NodeSpec, dict[str, Placement], list[Candidate], list[PodEntry], list[PodEntry]]] = []
        with self.lock:
            state = self.state()
            self._nominations.clear(state, key)  # this answer replaces the previous one
            for node, scheduler_uids in offered.items():
                spec = self._nodes.spec(node)
                if spec is None or node not in state.index or (node in self._nodes.dra_pool and other_dialect):
                    continue  # filter answered these unresolvable: no eviction helps
                booked = {k: state.bookings[k] for k in self._booked.keys_on(node)
                          if k != key and not k.startswith(f"{NOMINATED}{key}|") and k in state.bookings}
                candidates = []
                entries = []
                for k, placement in booked.items():
                    entry = self._pods.entry(k)
                    if entry is not None and self._may_evict(entry, node, priority):
                        candidates.append(Candidate(k, entry.uid, entry.priority, placement))
                        entries.append(entry)
                # kube-scheduler's victims that book no card here: it chose them for CPU, memory or
                # other node-level resources qgpu does not book, and they stay as it chose them.
                node_level = []
                for other in scheduler_uids:
                    other_key = self._mirror.key_of(other)
                    entry = self._pods.entry(other_key) if other_key else None
                    if entry is not None and entry.uid == other and other_key not in state.bookings \
                            and self._may_evict(entry, node, priority):
                        node_level.append(entry)
                gathered.append((node, spec, booked, candidates, entries, node_level))
        budget = FitBudget()
        chosen = []
        for node, spec, booked, candidates, entries, node_level in gathered:
            hit = self._protected(entries + node_level)
            candidates = [replace(c, violating=True) if c.key in hit else c for c in candidates]
            eviction = choose_victims(spec, booked, candidates, request, self.policy, self.limits, budget)
            if eviction is not None and (eviction.victims or node_level):
                chosen.append((node, eviction, node_level, sum(e.key in hit for e in node_level)))
        out: dict[str, NodePreemption] = {}
        with self.lock:
            state = self.state()
            for node, eviction, node_level, node_level_violating in chosen:
                if eviction.victims and len(self._nominations) < self.max_holds:
                    self._nominations.offer(state, key, uid, node, request,
                                            [v.key for v in eviction.victims if v.key in state.bookings], now_ns)
                uids = tuple(v.uid for v in eviction.victims) + tuple(e.uid for e in node_level)
                out[node] = NodePreemption(uids, eviction.pdb_violations + node_level_violating)
        return out

    def _protected(self, entries: list[PodEntry]) -> frozenset[str]:
        """The keys of ``entries`` (one node's potential victims) a PodDisruptionBudget protects,
        split as kube-scheduler splits them: most important first (higher priority, then bound
        earlier; placement/disruption.py)."""
        budgets = self.budgets.in_namespaces(namespace_of(e.key) for e in entries)
        if not budgets:
            return frozenset()
        order = sorted(entries, key=lambda e: (-e.priority, e.bind_time_ns or 0, e.key))
        return violating([PodLabels(e.key, dict(e.labels)) for e in order], budgets)

    @staticmethod
    def _may_evict(entry: PodEntry, node: str, priority: int) -> bool:
        return (bool(entry.uid) and entry.node_name == node and not entry.deleting and not entry.terminal
                and entry.priority < priority)

    def nominated(self, key: str) -> dict[str, set[str]]:
        """The preempt offers of pod ``key``: node -> the victims' keys not gone yet (a copy)."""
        with self.lock:
            return {node: set(o.waiting) for node, o in self._nominations.offers(key).items()}

    # -- binds ---------------------------------------------------------------------------------

    def reserve(self, pod: Mapping[str, Any], request: PodRequest, node: str, now_ns: int,
                others: Mapping[str, Placement] | None = None) -> AllocationRecord:
        """Pick cards on ``node`` and book them, pinned until our record shows up in the watch.

        ``others``: what other binders committed on the node that this cache does not book (from
        ``committed.foreign_commitments``); the choice steers around them. Raises
        engine.Unschedulable when the node cannot take the pod (any more).
        """
        key = pod_key(pod)
        with self.lock:
            return self._reservations.reserve(key, request, node, now_ns, others or {})

    def unreserve(self, pod: Mapping[str, Any], record_raw: str) -> None:
        """Undo :meth:`reserve` after a failed bind (the caller removed the record): only while the
        pod's name still holds that bind's pinned record. The name may book another pod by then (the
        pod deleted and created again, as a StatefulSet does, while the Binding was retried; or a
        second bind of the same pod that won): releasing it would free cards a bound pod uses."""
        key = pod_key(pod)
        with self.lock:
            if self._pods.pinned(key) != record_raw:
                return
            self._reservations.unreserve(key)

    def bound_node(self, key: str, uid: str) -> str | None:
        """The node the watch shows pod ``key`` (of that UID) bound to, None when it shows none."""
        with self.lock:
            entry = self._pods.entry(key)
            return entry.node_name or None if entry is not None and entry.uid == uid else None

    def outcome_unknown(self, pod: Mapping[str, Any], record_raw: str, now_ns: int) -> None:
        """A bind whose Binding failed and whose pod could not be read: it may have landed (its
        answer lost), so its booking stays pinned, as a bind in flight's does, until the pod is
        seen bound or deleted, or :meth:`expire` finds it older than the TTL (then a pod bound
        after all is booked by the record on it)."""
        with self.lock:
            if self._pods.pinned(pod_key(pod)) == record_raw:
                self._unknown_binds[pod_key(pod)] = (record_raw, now_ns)

    # -- groups (extender/groups.py) -------------------------------------------------------------

    def group_held(self, key: str) -> HeldMember | None:
        with self.lock:
            return self._groups.held(key)

    def check_group(self, group: GroupKey, key: str, now_ns: int) -> None:
        """Raises :class:`GroupError` when the group may not hold now (resting, too many members)."""
        with self.lock:
            self._groups.check_may_hold(group, key, now_ns)

    def hold_for_group(self, group: GroupKey, member: HeldMember, now_ns: int) -> None:
        """Keep the booking :meth:`reserve` made for ``member`` (pinned) as its group's hold."""
        with self.lock:
            self._groups.hold(group, member, now_ns)

    def group_progress(self, group: GroupKey, key: str, listed: Iterable[Listed] = ()) -> Progress:
        """``listed``: the group's pods as the apiserver listed them just now (the watch may lag)."""
        listed = list(listed)
        with self.lock:
            keys = set(self._groups.members(group)) | {m.key for m in listed}
            placed = [k for k in keys if self._pods.pinned(k) is not None]
            return self._groups.progress(group, key, placed, listed)

    def take_group(self, group: GroupKey) -> list[HeldMember]:
        """The group's held members, no longer held: their Bindings go out now (bookings stay pinned)."""
        with self.lock:
            return self._groups.take(group)

    def release_member(self, member: HeldMember) -> None:
        with self.lock:
            self._release_member(member)

    def _release_member(self, member: HeldMember) -> None:
        self._groups.drop_hold(member.key)
        self._reservations.unreserve(member.key)
        self._pods.deauthorize(member.key)

    def expire_groups(self, now_ns: int) -> list[tuple[GroupKey, list[HeldMember]]]:
        """Release the holds of groups incomplete ``group timeout`` after their first hold."""
        with self.lock:
            expired = self._groups.expire(now_ns)
            for _, members in expired:
                for member in members:
                    self._reservations.unreserve(member.key)
                    self._pods.deauthorize(member.key)
            return expired

    def expire(self, now_ns: int) -> list[Expired]:
        """Release holds, authorizations and assumed records older than the TTL; return the
        records so the caller deletes them.

        A record comes back on every call until its deletion shows up in the watch, so a failed
        delete is simply retried on the next round.
        """
        self.take_due_nodes()
        with self.lock:
            state = self.state()
            for key, (raw, since) in list(self._unknown_binds.items()):
                if self._pods.pinned(key) != raw:
                    del self._unknown_binds[key]  # seen bound, bound again or released meanwhile
                elif now_ns - since >= self.assume_ttl_ns:
                    del self._unknown_binds[key]
                    self._reservations.unreserve(key)
                    entry = self._pods.entry(key)
                    if entry is not None and entry.node_name:  # bound after all, with the record the pin hid
                        self._events.sync(state, entry)
            self._holds.expire(state, now_ns, self.assume_ttl_ns)
            self._nominations.expire(state, now_ns, self.assume_ttl_ns)
            return self._events.expire(state, now_ns, self.assume_ttl_ns)
