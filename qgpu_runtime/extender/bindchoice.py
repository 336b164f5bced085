"""Choose and book the cards of a bind so that no other bind can take the same capacity.

Under a per-node lock (binds of this process to one node queue here, not at the apiserver) the
cache picks the cards and books them. Without node commitments that is all: binds are safe against
this process's binds only (one active extender). With them, the choice is made safe against every
binder writing the same Leases: read the node's commitment Lease, prune the entries of pods gone,
bound elsewhere or watched past the grace, choose around what others committed, check the choice,
and write the Lease back on the resourceVersion it was read at; a 409 means another binder won the
race, so the booking is undone and the decision made again on fresh state (bounded attempts).
After a failed Binding, :meth:`BindChoice.withdraw` takes our entry out of the Lease again, and
:meth:`BindChoice.correct` makes a pod bound here by another binder count as its record says.

With a :class:`~.presence.BinderPresence` (node commitments ``auto``), each bind asks it first
whether to commit: not while this extender is the only live binder. It then books in the cache
only and tells the presence when its Binding ended, so that a second binder arriving later finds
it in the node's Lease (:meth:`BindChoice.publish`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, defaultdict
from typing import Any, Callable

from qgpu_runtime.contract.leases import Commitment, CommitmentError
from qgpu_runtime.contract.observed import FirstSeen
from qgpu_runtime.contract.record import ALLOCATION, AllocationRecord, RecordError, parse_record
from qgpu_runtime.extender.bindresult import BindError
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.extender.commitments import CommitmentConflict, LeaseCommitments, Snapshot
from qgpu_runtime.extender.presence import BinderPresence, NotConfirmed, RecentBind
from qgpu_runtime.kube.errors import brief as short
from qgpu_runtime.placement.commitments import observed, over_commitment, stale
from qgpu_runtime.placement.engine import Unschedulable
from qgpu_runtime.placement.state import Placement, StateError

log = logging.getLogger("qgpu_runtime.extender.binder")  # the binder's log, as before the split

WRITTEN_ENTRIES = 4096  # own Lease entries remembered (older ones are another process's to this one)


class BindChoice:
    """The cards of each bind, decided under the node's lock and, with ``commitments``, its Lease."""

    def __init__(self, cache: AllocationCache, commitments: LeaseCommitments | None, clock_ns: Callable[[], int],
                 commit_attempts: int, commitment_grace_ns: int, on_conflict: Callable[[], None],
                 monotonic_ns: Callable[[], int], presence: BinderPresence | None = None) -> None:
        self.cache = cache
        self.presence = presence
        self.commitments = commitments
        self.clock_ns = clock_ns
        self.commit_attempts = commit_attempts
        self.commitment_grace_ns = commitment_grace_ns
        self.on_conflict = on_conflict
        self.monotonic_ns = monotonic_ns
        self.conflicts = 0  # lost Lease writes, each followed by a fresh decision
        self._seen = FirstSeen()  # node -> when this binder first saw each entry of its Lease
        self._node_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._locks_guard = threading.Lock()
        # (node, pod UID) -> the stamp of the entry this binder last wrote for it: an entry of the
        # pod with another stamp is another binder's (or an earlier process's) and is not overwritten
        self._written: OrderedDict[tuple[str, str], int] = OrderedDict()

    def _node_lock(self, node: str) -> threading.Lock:
        with self._locks_guard:
            return self._node_locks[node]

    def choose(self, pod: dict[str, Any], request: Any, node: str,
               must_commit: bool = False) -> tuple[AllocationRecord, int, bool]:
        """Book the pod's cards on ``node``: its record, the time it was chosen at, and whether it
        was committed through the node's Lease. An uncommitted choice under a presence must be
        followed by :meth:`ended`. ``must_commit``: commit whenever commitments are on, even with
        this binder alone (a group's held member, whose booking outlives the bind)."""
        committed = self.commitments is not None
        if committed and self.presence is not None:
            meta = pod["metadata"]
            try:
                committed = self.presence.begin()
            except NotConfirmed as exc:
                raise BindError(f"pod {meta.get('namespace') or 'default'}/{meta['name']}: not bound: this extender "
                                f"may not bind yet: {exc}") from exc
            if must_commit and not committed:
                self.presence.finish(None)  # not an uncommitted bind after all
                committed = True
        if committed:
            return (*self._reserve_committed(pod, request, node), True)
        try:
            with self._node_lock(node):
                now = self.clock_ns()
                return self._reserve(pod, request, node, now), now, False
        except BaseException:
            self.ended(node, pod, None, 0, False)
            raise

    def ended(self, node: str, pod: dict[str, Any], record: AllocationRecord | None, now: int, committed: bool) -> None:
        """An uncommitted bind under a presence ended; ``record``: the one its Binding carried, None
        when there was none."""
        if committed or self.presence is None:
            return
        bound = None
        if record is not None:
            meta = pod["metadata"]
            key = f"{meta.get('namespace') or 'default'}/{meta['name']}"
            bound = RecentBind(node, Commitment.of(str(meta.get("uid") or key), key, Placement.of_record(record), now),
                               self.presence.monotonic())
        self.presence.finish(bound)

    def publish(self, recent: list[RecentBind]) -> None:
        """Write uncommitted binds into their nodes' Leases (the presence's flush before it says it
        commits); raises when a node's Lease cannot be written."""
        assert self.commitments is not None
        by_node: dict[str, list[Commitment]] = defaultdict(list)
        for bind in recent:
            by_node[bind.node].append(bind.commitment)
        for node, entries in by_node.items():
            with self._node_lock(node):
                for _ in range(self.commit_attempts):
                    snapshot = self.commitments.read_fresh(node)
                    doc = snapshot.commitments
                    for entry in entries:
                        if entry.uid not in doc.pods:
                            doc = doc.with_pod(entry)
                    if doc == snapshot.commitments:
                        break
                    try:
                        self.commitments.write(snapshot, doc)
                        break
                    except CommitmentConflict:
                        continue
                else:
                    raise BindError(f"node {node}: its commitments changed under {self.commit_attempts} attempts in a row")

    def _reserve(self, pod: dict[str, Any], request: Any, node: str, now: int,
                 others: dict[str, Placement] | None = None) -> AllocationRecord:
        try:
            return self.cache.reserve(pod, request, node, now, others)
        except (Unschedulable, StateError) as exc:
            meta = pod["metadata"]
            reason = exc.reasons.get(node, str(exc)) if isinstance(exc, Unschedulable) else str(exc)
            raise BindError(f"pod {meta.get('namespace') or 'default'}/{meta['name']}: node {node} cannot take it: "
                            f"{reason}") from exc

    def _reserve_committed(self, pod: dict[str, Any], request: Any, node: str) -> tuple[AllocationRecord, int]:
        """Decide and commit through the node's Lease: read it, choose cards around what every
        binder committed, check the choice, write the Lease back on the resourceVersion it was read
        at. A 409 means another binder committed meanwhile: decide again on what it wrote."""
        assert self.commitments is not None
        committed = self.cache.committed
        meta = pod["metadata"]
        key, uid = f"{meta.get('namespace') or 'default'}/{meta['name']}", str(meta.get("uid", ""))
        for _ in range(self.commit_attempts):
            with self._node_lock(node):  # binds of this process to one node queue here, not at the apiserver
                snapshot = self._read_commitments(key, node)
                now = self.clock_ns()
                held = snapshot.commitments
                ages = self._seen.ages(node, observed(held), self.monotonic_ns())
                held = held.without(stale(held, committed.fates(held.pods, node), ages, self.commitment_grace_ns))
                self._refuse_rival_entry(key, node, held.pods.get(uid or key), ages.get(uid or key, 0))
                record = self._reserve(pod, request, node, now, committed.foreign_commitments(held, uid))
                mine = Commitment.of(uid or key, key, Placement.of_record(record), now)
                # Records first: for a bound pod the record on it is the truth, and a Lease entry of the
                # same UID (written before an uncommitted bind's record, until corrected) is not counted.
                problems = over_commitment(committed.card_capacity(node),
                                           [*committed.booked_on(node, key), *held.pods.values()], mine)
                if problems:
                    self.cache.unreserve(pod, record.to_json())
                    raise BindError(f"pod {key}: node {node} cannot take it: committed by other binds: "
                                    f"{'; '.join(problems)}")
                # remembered as ours before the write: a write that lands while its answer is lost
                # comes back from the retry as a conflict, and the entry read then is this one
                self._wrote(node, mine)
                try:
                    self.commitments.write(snapshot, held.with_pod(mine))
                except CommitmentConflict:
                    self.cache.unreserve(pod, record.to_json())
                    self.conflicts += 1
                    self.on_conflict()
                    continue
                except Exception as exc:
                    self.cache.unreserve(pod, record.to_json())
                    raise BindError(f"pod {key}: cannot write the commitment of node {node}: {short(exc)}") from exc
                return record, now
        raise BindError(f"pod {key}: node {node}'s commitments changed under {self.commit_attempts} attempts in a row "
                        f"(other binders are busy on it); not bound, the scheduler will retry")

    def _refuse_rival_entry(self, key: str, node: str, entry: Commitment | None, age_ns: float) -> None:
        """Refuse to decide a pod that the node's Lease already holds under another binder's entry.

        Both kube-schedulers run every pod's cycle, so two binders bind the same pod at once. Were
        the second to write its own choice over the first's entry, the Lease would say card A while
        the first binder's Binding puts the record's card B on the pod; until the second binder's
        watch delivered that record (or it corrected the entry after its Binding failed), its own
        next decisions on the node would count the pod on A and could fill B past its capacity. The
        first entry stands; this bind fails and kube-scheduler retries the pod (which by then is
        bound, or its entry pruned as gone, bound elsewhere or unbound past the grace)."""
        if entry is None:
            return
        with self._locks_guard:
            if self._written.get((node, entry.uid)) == entry.since_ns:
                return  # our own entry (an earlier attempt whose withdrawal did not go through)
        raise BindError(f"pod {key}: not bound to {node}: another binder committed this pod there "
                        f"{age_ns / 1e9:.1f} s ago (cards {', '.join(str(u.index) for u in entry.cards) or 'none'}) "
                        f"and its choice stands; the scheduler will retry the pod")

    def _wrote(self, node: str, entry: Commitment) -> None:
        with self._locks_guard:
            self._written[(node, entry.uid)] = entry.since_ns
            self._written.move_to_end((node, entry.uid))
            while len(self._written) > WRITTEN_ENTRIES:
                self._written.popitem(last=False)

    def _read_commitments(self, key: str, node: str) -> Snapshot:
        assert self.commitments is not None
        try:
            return self.commitments.read(node)
        except CommitmentError as exc:
            raise BindError(f"pod {key}: node {node}: its commitment Lease is unreadable: {exc}") from exc
        except Exception as exc:
            raise BindError(f"pod {key}: cannot read the commitments of node {node}: {short(exc)}") from exc

    def correct(self, node: str, pod: dict[str, Any]) -> None:
        """Best effort: make the pod's entry in the node's Lease what its record says."""
        meta = pod.get("metadata") or {}
        uid, raw = str(meta.get("uid") or ""), (meta.get("annotations") or {}).get(ALLOCATION)
        if self.commitments is None or not uid or not raw:
            return
        try:
            placement = Placement.of_record(parse_record(raw))
        except RecordError:
            return
        for _ in range(3):
            try:
                snapshot = self.commitments.read(node)
                entry = snapshot.commitments.pods.get(uid)
                key = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
                truth = Commitment.of(uid, key, placement, entry.since_ns if entry else self.clock_ns())
                if entry == truth:
                    return
                self.commitments.write(snapshot, snapshot.commitments.with_pod(truth))
                return
            except CommitmentConflict:
                continue
            except Exception as exc:  # noqa: BLE001 - the record still counts in every cache
                log.info("node %s: could not correct the commitment of pod uid %s: %s", node, uid, short(exc))
                return

    def withdraw(self, node: str, uid: str, committed: bool = True) -> None:
        """Best effort after a failed Binding: take our entry out of the node's Lease (there is none
        unless the bind was ``committed``). Should this fail, the entry is pruned by the next bind
        on the node once its pod is seen elsewhere or gone, or after the grace."""
        if self.commitments is None or not uid or not committed:
            return
        for _ in range(3):
            try:
                snapshot = self.commitments.read(node)
                if uid not in snapshot.commitments.pods:
                    return
                self.commitments.write(snapshot, snapshot.commitments.without([uid]))
                return
            except CommitmentConflict:
                continue
            except Exception as exc:  # noqa: BLE001 - pruning covers it
                log.info("node %s: could not withdraw the commitment of pod uid %s: %s", node, uid, short(exc))
                return
