"""Bind: pick the cards, write the allocation record, create the Binding — as one API write.

A Binding (``POST /api/v1/namespaces/<ns>/pods/<name>/binding``, the ``pods/binding`` subresource
kube-scheduler itself uses and the ClusterRole grants) has its own ``metadata.annotations`` copied
onto the pod in the same storage update that sets ``spec.nodeName`` (kube-apiserver's BindingREST).
qgpu puts the allocation record there, so the record and the Binding succeed or fail together:
there is never a Binding without a record and never a record without a Binding, whatever dies
when. It also halves the API writes per pod compared with a patch followed by a Binding.

Steps:
1. book the cards in the cache (under the cache lock, with a per-node lock around the decision, so
   no concurrent bind of this process can take the same capacity);
2. with node commitments on (the default), make the choice safe against other processes too: read
   the node's commitment Lease, choose around what others committed there, check the choice and
   write the Lease back conditionally on its resourceVersion; a 409 means another binder won the
   race, so the booking is undone and the decision made again on fresh state (bounded attempts);
3. POST the Binding carrying the record, guarded by the pod's UID;
4. if it fails, release the booking (and withdraw the commitment). A 409 means the pod is bound already: when it is bound to the
   requested node (an earlier attempt of ours got through) the bind is reported as done.
The pod's spec is the apiserver's pod that the filter of this pod resolved (saving a GET; the
request body's copy is never used, see :mod:`.trust`); otherwise it is read from the API.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

from kubernetes import client

from qgpu_runtime.contract.leases import Commitment, CommitmentError
from qgpu_runtime.contract.names import ALLOCATION_SIGNATURE
from qgpu_runtime.contract.observed import FirstSeen
from qgpu_runtime.contract.record import ALLOCATION, BIND_TIME, AllocationRecord, RecordError, parse_record
from qgpu_runtime.contract.signature import RecordSigner, signed_annotations
from qgpu_runtime.extender.cache import AllocationCache, Expired
from qgpu_runtime.extender.commitments import CommitmentConflict, LeaseCommitments, Snapshot
from qgpu_runtime.kube.client import REQUEST_TIMEOUT, drain, raw_json
from qgpu_runtime.kube.errors import ApiError, Conflict, NotFound, call
from qgpu_runtime.kube.errors import brief as _short
from qgpu_runtime.kube.retry import is_transient, with_backoff
from qgpu_runtime.model.requests import CardLimits, RequestError, parse_pod
from qgpu_runtime.placement.commitments import observed, over_commitment, stale
from qgpu_runtime.placement.engine import Unschedulable
from qgpu_runtime.placement.state import Placement, StateError

log = logging.getLogger(__name__)


class BindError(RuntimeError):
    """The bind did not happen; nothing of it is left behind. The message says why."""


@dataclass(frozen=True)
class BindOutcome:
    node: str
    record: str | None  # None for pods that asked for no GPU


class AlreadyBound(Exception):
    def __init__(self, pod: dict[str, Any]):
        self.pod = pod


def _escape(annotation: str) -> str:
    return annotation.replace("~", "~0").replace("/", "~1")


class Binder:
    def __init__(self, api: client.CoreV1Api, cache: AllocationCache, limits: CardLimits,
                 clock_ns: Callable[[], int] = time.time_ns, attempts: int = 5,
                 timeout: tuple[float, float] = REQUEST_TIMEOUT, commitments: LeaseCommitments | None = None,
                 commit_attempts: int = 8, commitment_grace_ns: int = 60 * 10**9,
                 on_conflict: Callable[[], None] = lambda: None, monotonic_ns: Callable[[], int] = time.monotonic_ns,
                 *, signer: RecordSigner):
        """``commitments`` None: binds are safe only against the binds of this process (one active
        extender); with it, against every binder that writes the same Leases. A Lease entry of a pod
        not bound here is pruned once this binder has watched it for ``commitment_grace_ns`` by
        ``monotonic_ns`` (contract/observed.py), whatever its writer's clock stamped on it.
        ``signer``: the key every record is signed with; the cache must verify with its public half,
        or this extender would not book its own binds."""
        if commit_attempts < 1:
            raise ValueError(f"commit_attempts={commit_attempts}: must be >= 1")
        if signer.verifier.pem() != cache.verifier.pem():
            raise ValueError("record signing key: its public key is not the one the cache verifies records with")
        self.signer = signer
        self.commitments = commitments
        self.commit_attempts = commit_attempts
        self.commitment_grace_ns = commitment_grace_ns
        self.monotonic_ns = monotonic_ns
        self._seen = FirstSeen()  # node -> when this binder first saw each entry of its Lease
        self.conflicts = 0  # lost Lease writes, each followed by a fresh decision
        self.on_conflict = on_conflict
        self.api = api
        self.timeout = timeout
        self.cache = cache
        self.limits = limits
        self.clock_ns = clock_ns
        self.attempts = attempts
        self._node_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._locks_guard = threading.Lock()

    def _node_lock(self, node: str) -> threading.Lock:
        with self._locks_guard:
            return self._node_locks[node]

    def _read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return raw_json(with_backoff(
            lambda: call(self.api.read_namespaced_pod, name, namespace, _preload_content=False, _request_timeout=self.timeout),
            attempts=self.attempts))

    def read_pod_if_exists(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod from the apiserver, None if it does not exist (the trust check's fallback)."""
        from qgpu_runtime.extender.trust import PodUnavailable, UntrustedPod

        try:
            return self._read_pod(namespace, name)
        except NotFound:
            return None
        except ApiError as exc:
            error = PodUnavailable if is_transient(exc) else UntrustedPod
            raise error(f"pod {namespace}/{name}: cannot read it from the apiserver ({_short(exc)})") from exc
        except Exception as exc:
            if not is_transient(exc):
                raise
            raise PodUnavailable(f"pod {namespace}/{name}: the apiserver cannot be reached to read it "
                                 f"({_short(exc)}); retry when it answers") from exc

    def _pod(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        seen = self.cache.seen_pod(uid) if uid else None
        if seen is not None:
            return seen
        try:
            return self._read_pod(namespace, name)
        except ApiError as exc:
            raise BindError(f"pod {namespace}/{name}: cannot read it ({_short(exc)})") from exc

    def bind(self, namespace: str, name: str, uid: str, node: str) -> BindOutcome:
        """Bind, or raise :class:`BindError` with the reason; an apiserver that cannot be reached
        is such a reason (kube-scheduler sees the ``Error`` and retries), never an exception out."""
        try:
            return self._bind(namespace, name, uid, node)
        except BindError:
            raise
        except Exception as exc:
            if not is_transient(exc):
                raise
            raise BindError(f"pod {namespace}/{name}: the apiserver cannot be reached ({_short(exc)}); "
                            "not bound, retry when it answers") from exc

    def _bind(self, namespace: str, name: str, uid: str, node: str) -> BindOutcome:
        pod = self._pod(namespace, name, uid)
        meta = pod.get("metadata") or {}
        if uid and meta.get("uid") != uid:
            raise BindError(f"pod {namespace}/{name}: uid {meta.get('uid')} is not the scheduled uid {uid}; the pod was replaced")
        if (pod.get("spec") or {}).get("nodeName"):
            return self._bound_already(pod, node)
        try:
            request = parse_pod(pod, self.limits)
        except RequestError as exc:
            raise BindError(f"pod {namespace}/{name}: {exc}") from exc
        try:
            if not request.wants_gpu:
                self._create_binding(namespace, name, meta.get("uid", ""), node, {})
                return BindOutcome(node, None)
            return self._bind_gpu(pod, request, node)
        except AlreadyBound as done:
            return self._bound_already(done.pod, node)

    def _bound_already(self, pod: dict[str, Any], node: str) -> BindOutcome:
        meta = pod.get("metadata") or {}
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to != node:
            raise BindError(f"pod {meta.get('namespace')}/{meta.get('name')}: already bound to {bound_to}, not {node}")
        self.cache.apply_pod("MODIFIED", pod)  # whatever an earlier attempt wrote is the truth now
        return BindOutcome(node, (meta.get("annotations") or {}).get(ALLOCATION))

    def _bind_gpu(self, pod: dict[str, Any], request: Any, node: str) -> BindOutcome:
        meta = pod["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        if self.commitments is not None:
            record, now = self._reserve_committed(pod, request, node)
        else:
            with self._node_lock(node):
                now = self.clock_ns()
                record = self._reserve(pod, request, node, now)
        try:
            self._create_binding(namespace, name, meta.get("uid", ""), node,
                                 signed_annotations(record, now, str(meta.get("uid") or ""), self.signer))
        except AlreadyBound as done:
            self.cache.unreserve(pod)
            if (done.pod.get("spec") or {}).get("nodeName") != node:
                self._withdraw(node, str(meta.get("uid", "")))
            else:  # bound here by another binder: its record, not our choice, is what the node holds
                self._correct(node, done.pod)
            raise
        except Exception as exc:
            self.cache.unreserve(pod)
            self._withdraw(node, str(meta.get("uid", "")))
            raise BindError(f"pod {namespace}/{name}: binding to {node} failed, cards released: {_short(exc)}") from exc
        return BindOutcome(node, record.to_json())

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
        meta = pod["metadata"]
        key, uid = f"{meta.get('namespace') or 'default'}/{meta['name']}", str(meta.get("uid", ""))
        for _ in range(self.commit_attempts):
            with self._node_lock(node):  # binds of this process to one node queue here, not at the apiserver
                snapshot = self._read_commitments(key, node)
                now = self.clock_ns()
                held = snapshot.commitments
                ages = self._seen.ages(node, observed(held), self.monotonic_ns())
                held = held.without(stale(held, self.cache.fates(held.pods, node), ages, self.commitment_grace_ns))
                record = self._reserve(pod, request, node, now, self.cache.foreign_commitments(held, uid))
                mine = Commitment.of(uid or key, key, Placement.of_record(record), now)
                # Records first: for a bound pod the record on it is the truth, and a Lease entry of the
                # same UID (another binder's guess for it, overwritten by its loser) is not counted.
                problems = over_commitment(self.cache.card_capacity(node),
                                           [*self.cache.booked_on(node, key), *held.pods.values()], mine)
                if problems:
                    self.cache.unreserve(pod)
                    raise BindError(f"pod {key}: node {node} cannot take it: committed by other binds: "
                                    f"{'; '.join(problems)}")
                try:
                    self.commitments.write(snapshot, held.with_pod(mine))
                except CommitmentConflict:
                    self.cache.unreserve(pod)
                    self.conflicts += 1
                    self.on_conflict()
                    continue
                except Exception as exc:
                    self.cache.unreserve(pod)
                    raise BindError(f"pod {key}: cannot write the commitment of node {node}: {_short(exc)}") from exc
                return record, now
        raise BindError(f"pod {key}: node {node}'s commitments changed under {self.commit_attempts} attempts in a row "
                        f"(other binders are busy on it); not bound, the scheduler will retry")

    def _read_commitments(self, key: str, node: str) -> Snapshot:
        assert self.commitments is not None
        try:
            return self.commitments.read(node)
        except CommitmentError as exc:
            raise BindError(f"pod {key}: node {node}: its commitment Lease is unreadable: {exc}") from exc
        except Exception as exc:
            raise BindError(f"pod {key}: cannot read the commitments of node {node}: {_short(exc)}") from exc

    def _correct(self, node: str, pod: dict[str, Any]) -> None:
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
                log.info("node %s: could not correct the commitment of pod uid %s: %s", node, uid, _short(exc))
                return

    def _withdraw(self, node: str, uid: str) -> None:
        """Best effort after a failed Binding: take our entry out of the node's Lease. Should this
        fail, the entry is pruned by the next bind on the node once its pod is seen elsewhere or gone,
        or after the grace."""
        if self.commitments is None or not uid:
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
                log.info("node %s: could not withdraw the commitment of pod uid %s: %s", node, uid, _short(exc))
                return

    def _create_binding(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        metadata: dict[str, Any] = {"name": name, "namespace": namespace}
        if uid:
            metadata["uid"] = uid  # precondition: a replaced pod of the same name is not bound
        if annotations:
            metadata["annotations"] = annotations  # copied onto the pod with spec.nodeName, atomically
        body = client.V1Binding(metadata=client.V1ObjectMeta(**metadata),
                                target=client.V1ObjectReference(api_version="v1", kind="Node", name=node))

        def attempt() -> None:
            try:
                drain(call(self.api.create_namespaced_pod_binding, name, namespace, body, _preload_content=False,
                           _request_timeout=self.timeout))
            except Conflict as exc:
                # Bound already: an earlier attempt of ours (whose answer was lost), or someone else.
                raise AlreadyBound(self._read_pod(namespace, name)) from exc

        with_backoff(attempt, attempts=self.attempts)

    def remove_record(self, namespace: str, name: str, raw_record: str, uid: str = "") -> None:
        """Delete an unbound pod's record only if it is still exactly ``raw_record`` (JSON-patch test).

        qgpu's own binds never leave such records; they come from interrupted writers of older
        versions or other tools, and are cleaned up by the expiry loop.
        """
        pod = self._read_pod(namespace, name)
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        if annotations.get(ALLOCATION) != raw_record or (uid and meta.get("uid") != uid):
            return
        if (pod.get("spec") or {}).get("nodeName"):
            return  # bound after all: the record is live
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": f"/metadata/annotations/{_escape(ALLOCATION)}", "value": raw_record},
            {"op": "remove", "path": f"/metadata/annotations/{_escape(ALLOCATION)}"},
        ]
        for name_ in (BIND_TIME, ALLOCATION_SIGNATURE):
            if name_ in annotations:
                ops.append({"op": "remove", "path": f"/metadata/annotations/{_escape(name_)}"})
        with_backoff(lambda: drain(call(
            self.api.patch_namespaced_pod, name, namespace, ops, _content_type="application/json-patch+json",
            _preload_content=False, _request_timeout=self.timeout)), attempts=self.attempts)

    def delete_expired(self, expired: Expired) -> None:
        self.remove_record(expired.namespace, expired.name, expired.record_raw, expired.uid)

