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
2. with node commitments on (``always``, or ``auto`` while another binder is live), make the choice safe against other processes too: read
   the node's commitment Lease, choose around what others committed there, check the choice and
   write the Lease back conditionally on its resourceVersion; a 409 means another binder won the
   race, so the booking is undone and the decision made again on fresh state (bounded attempts);
3. POST the Binding carrying the record, guarded by the pod's UID;
4. if it fails, release the booking (and withdraw the commitment). A 409 means the pod is bound already: when it is bound to the
   requested node (an earlier attempt of ours got through) the bind is reported as done.
The pod's spec is the apiserver's pod that the filter of this pod resolved (saving a GET; the
request body's copy is never used, see :mod:`.trust`); otherwise it is read from the API.

:class:`Binder` runs these steps and releases what a failed step booked; choosing and committing
the cards (steps 1 and 2, and withdrawing the commitment after a failure) is extender/bindchoice.py,
the pod reads and writes (the Binding, the expired record's removal) are extender/podapi.py.

A member of a T9k group (extender/groups.py) takes steps 1 and 2 and then, while its group is not
complete, keeps the booking instead of POSTing: the bind answers an error naming the group and
what it waits for (kube-scheduler's FailedScheduling Event on the pod carries it) and
kube-scheduler retries the pod, whose filter then passes only the held node. The bind that
completes the group POSTs every held member's Binding with its held record, then its own.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from kubernetes import client

from qgpu_runtime.contract.record import ALLOCATION, AllocationRecord, RecordError, parse_record
from qgpu_runtime.contract.signature import RecordSigner, signed_annotations
from qgpu_runtime.extender.bindchoice import BindChoice
from qgpu_runtime.extender.bindresult import AlreadyBound, BindError, BindOutcome
from qgpu_runtime.extender.cache import AllocationCache, Expired
from qgpu_runtime.extender.commitments import LeaseCommitments
from qgpu_runtime.extender.groups import (
    GROUP_LABEL,
    MAX_GROUP_MEMBERS,
    GroupError,
    GroupKey,
    HeldMember,
    Listed,
    from_node,
    group_of,
    min_members,
)
from qgpu_runtime.extender.podapi import PodApi
from qgpu_runtime.extender.presence import DEFAULT_DURATION_S, BinderPresence
from qgpu_runtime.kube.client import REQUEST_TIMEOUT
from qgpu_runtime.kube.errors import ApiError
from qgpu_runtime.kube.errors import brief as short
from qgpu_runtime.kube.leasedoc import LeaseDocuments
from qgpu_runtime.kube.retry import is_transient
from qgpu_runtime.model.requests import CardLimits, RequestError

__all__ = ["BindError", "BindOutcome", "Binder"]

log = logging.getLogger(__name__)


def record_of(pod: dict[str, Any]) -> AllocationRecord | None:
    """The allocation record on a pod, None if it has none or it cannot be read."""
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(ALLOCATION)
    try:
        return parse_record(raw) if raw else None
    except RecordError:
        return None


class Binder:
    """Binds pods: the steps above in order, and the release of what a failed step booked."""

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
        self.cache = cache
        self.limits = limits
        self.pods = PodApi(api, timeout, attempts)
        self.choice = BindChoice(cache, commitments, clock_ns, commit_attempts, commitment_grace_ns, on_conflict,
                                 monotonic_ns)
        self.clock_ns = clock_ns
        self._in_flight: set[str] = set()  # pod keys whose bind runs now
        self._in_flight_guard = threading.Lock()
        self._group_lock = threading.Lock()  # one group decision (hold, or complete and bind) at a time

    def track_binders(self, leases: LeaseDocuments, identity: str, mode: str, duration_s: int = DEFAULT_DURATION_S,
                      recent_s: float = 60.0, monotonic: Callable[[], float] = time.monotonic) -> BinderPresence:
        """Publish this binder in the binders' Lease (``leases``: the commitment namespace's, with the
        binders' annotation) and, in ``mode`` auto, commit only while another binder is live
        (extender/presence.py). The caller runs the returned presence's renewal loop."""
        if self.commitments is None:
            raise ValueError("binder presence needs node commitments: a binder that never commits has nothing to announce")
        presence = BinderPresence(leases, identity, mode, self.choice.publish, duration_s, recent_s, monotonic)
        self.choice.presence = presence
        return presence

    @property
    def conflicts(self) -> int:
        """Lost Lease writes, each followed by a fresh decision."""
        return self.choice.conflicts

    def read_pod_if_exists(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod from the apiserver, None if it does not exist (the trust check's fallback)."""
        return self.pods.read_pod_if_exists(namespace, name)

    def _pod(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        seen = self.cache.seen_pod(uid) if uid else None
        if seen is not None:
            return seen
        try:
            return self.pods.read_pod(namespace, name)
        except ApiError as exc:
            raise BindError(f"pod {namespace}/{name}: cannot read it ({short(exc)})") from exc

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
            raise BindError(f"pod {namespace}/{name}: the apiserver cannot be reached ({short(exc)}); "
                            "not bound, retry when it answers") from exc

    def _bind(self, namespace: str, name: str, uid: str, node: str) -> BindOutcome:
        key = f"{namespace}/{name}"
        with self._in_flight_guard:
            if key in self._in_flight:
                # kube-scheduler gave up on a slow bind (its httpTimeout) and binds the pod again:
                # the second would unpin and release the first one's booking while it may land
                raise BindError(f"pod {key}: another bind of this pod is in flight; not bound now, the scheduler "
                                "will retry")
            self._in_flight.add(key)
        try:
            return self._bind_once(namespace, name, uid, node)
        finally:
            with self._in_flight_guard:
                self._in_flight.discard(key)

    def _bind_once(self, namespace: str, name: str, uid: str, node: str) -> BindOutcome:
        pod = self._pod(namespace, name, uid)
        meta = pod.get("metadata") or {}
        if uid and meta.get("uid") != uid:
            raise BindError(f"pod {namespace}/{name}: uid {meta.get('uid')} is not the scheduled uid {uid}; the pod was replaced")
        if (pod.get("spec") or {}).get("nodeName"):
            return self._bound_already(pod, node)
        if uid and self.cache.bound_node(f"{namespace}/{name}", uid):
            # the watch shows it bound (filter's copy of the pod is older): the apiserver's pod decides
            try:
                current = self.pods.read_pod(namespace, name)
            except ApiError as exc:
                raise BindError(f"pod {namespace}/{name}: cannot read it ({short(exc)})") from exc
            return self._bound_already(current, node)
        try:
            request = self.cache.requests.of(pod, self.limits)  # the apiserver's pod (_pod)
        except RequestError as exc:
            raise BindError(f"pod {namespace}/{name}: {exc}") from exc
        try:
            if not request.wants_gpu:
                self.pods.create_binding(namespace, name, meta.get("uid", ""), node, {})
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
        group = group_of(pod)
        if group is not None:
            return self._bind_member(pod, request, node, group)
        record, now, committed = self.choice.choose(pod, request, node)
        bound = None
        try:
            self.pods.create_binding(namespace, name, meta.get("uid", ""), node,
                                     signed_annotations(record, now, str(meta.get("uid") or ""), self.signer,
                                                        self.cache.verifier))
            bound = record
        except AlreadyBound as done:
            self.cache.unreserve(pod, record.to_json())
            if (done.pod.get("spec") or {}).get("nodeName") != node:
                self.choice.withdraw(node, str(meta.get("uid", "")), committed)
            elif committed:  # bound here by another binder: its record, not our choice, is what the node holds
                self.choice.correct(node, done.pod)
            else:
                bound = record_of(done.pod)
            raise
        except Exception as exc:
            # A failed POST may still have landed (its answer lost, then every retry failed before
            # reaching the apiserver): the pod as the apiserver has it now decides what is released.
            fate = self._binding_fate(namespace, name, str(meta.get("uid", "")))
            if fate is None:
                bound = record  # a presence publishes it: an entry of a bind that did not land is pruned
                self.cache.outcome_unknown(pod, record.to_json(), self.clock_ns())
                raise BindError(f"pod {namespace}/{name}: binding to {node} failed ({short(exc)}) and whether it "
                                f"landed cannot be read: its cards stay booked until the pod is seen bound "
                                f"or deleted, or --assume-timeout passes") from exc
            if (fate.get("spec") or {}).get("nodeName") == node:
                landed = ((fate.get("metadata") or {}).get("annotations") or {}).get(ALLOCATION)
                log.info("pod %s/%s: a Binding to %s landed though its answer was lost", namespace, name, node)
                if landed != record.to_json():
                    # an earlier attempt's record (or another binder's): that one holds the node's cards,
                    # and this attempt's pin would hide it from the cache
                    self.cache.unreserve(pod, record.to_json())
                    if committed:
                        self.choice.correct(node, fate)
                bound = record_of(fate)
                self.cache.apply_pod("MODIFIED", fate)  # what is bound is the truth now
                return BindOutcome(node, landed)
            self.cache.unreserve(pod, record.to_json())
            self.choice.withdraw(node, str(meta.get("uid", "")), committed)
            raise BindError(f"pod {namespace}/{name}: binding to {node} failed, cards released: {short(exc)}") from exc
        finally:
            self.choice.ended(node, pod, bound, now, committed)
        return BindOutcome(node, record.to_json())

    def _binding_fate(self, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
        """The pod now, to learn whether a failed Binding landed: the apiserver's pod when it is the
        same pod, an empty one when it is gone or was replaced (nothing of ours is bound), None when
        it cannot be read (the outcome is unknown)."""
        try:
            found = self.pods.read_pod_once(namespace, name)
        except Exception:  # noqa: BLE001 - unknown is an answer here; the caller keeps the cards booked
            return None
        if found is None or (uid and (found.get("metadata") or {}).get("uid") != uid):
            return {}
        return found

    def _bind_member(self, pod: dict[str, Any], request: Any, node: str, group: GroupKey) -> BindOutcome:
        """Hold this member's cards until its group is complete; the bind completing it binds all."""
        meta = pod["metadata"]
        key, uid = f"{meta.get('namespace') or 'default'}/{meta['name']}", str(meta.get("uid") or "")
        with self._group_lock:
            held = self.cache.group_held(key)
            if held is not None and (held.uid != uid or held.node != node):
                self._release(held)
                held = None
            if held is None:
                try:
                    min_members(pod)
                    self.cache.check_group(group, key, self.clock_ns())
                except GroupError as exc:
                    raise BindError(f"pod {key}: {exc}") from exc
                # A held member commits through the node's Lease whenever commitments are on, also
                # when this binder is alone: its cards stay booked past this bind, and a binder
                # arriving meanwhile must see them (presence.py waits only for binds in flight).
                record, now, _ = self.choice.choose(pod, request, node, must_commit=True)
                held = HeldMember(key, uid, node, record, now)
                self.cache.hold_for_group(group, held, self.clock_ns())
            progress = self.cache.group_progress(group, key)
            if progress.complete:  # by the watch; the apiserver may know members it has not delivered yet
                progress = self.cache.group_progress(group, key, self._list_group(key, group))
            if not progress.complete:
                raise BindError(f"pod {key}: {progress.waiting()}; its cards on {node} stay held for the group "
                                f"(all or none) for at most {self.cache.group_timeout_s:g} s after the group's first hold")
            members = self.cache.take_group(group)
            mine = next((m for m in members if m.key == key), held)
            log.info("group %s complete (%d members): binding the %d held", group, progress.size, len(members))
            for member in members:
                if member.key != key:
                    self._bind_held(group, member, None)
            return self._bind_held(group, mine, pod)

    def _list_group(self, key: str, group: GroupKey) -> list[Listed]:
        """The group's live pods as the apiserver has them now (at most MAX_GROUP_MEMBERS)."""
        try:
            # Mirror pods are no members: a node may create any number of them with the group's
            # label, and counted here they made the group "more than 64" for ever.
            pods, more = self.pods.list_live(group.namespace, f"{GROUP_LABEL}={group.name}", MAX_GROUP_MEMBERS,
                                             skip=from_node)
        except Exception as exc:
            raise BindError(f"pod {key}: cannot list the pods of group {group} ({short(exc)}); its cards stay held, "
                            "the next bind tries again") from exc
        if more:
            raise BindError(f"pod {key}: group {group} has more than {MAX_GROUP_MEMBERS} live members: at most "
                            f"{MAX_GROUP_MEMBERS} are held together; split the group")
        return [m for m in map(Listed.of, pods) if m is not None]

    def _bind_held(self, group: GroupKey, member: HeldMember, pod: dict[str, Any] | None) -> BindOutcome:
        """POST one held member's Binding with its held record. ``pod`` is given for the member whose
        bind this is (its failure is raised); another member's failure is logged, and unless the pod
        is bound already its hold is kept, so its own next bind (its group is complete by then) binds it."""
        namespace, name = member.key.split("/", 1)
        try:
            self.pods.create_binding(namespace, name, member.uid, member.node,
                                     signed_annotations(member.record, member.chosen_ns, member.uid, self.signer,
                                                        self.cache.verifier))
        except AlreadyBound as done:
            self.cache.unreserve(done.pod, member.record.to_json())
            if (done.pod.get("spec") or {}).get("nodeName") != member.node:
                self.choice.withdraw(member.node, member.uid)
            else:
                self.choice.correct(member.node, done.pod)
            if pod is not None:
                raise
            self.cache.apply_pod("MODIFIED", done.pod)  # what is bound is the truth now
            log.info("group %s: member %s was bound already", group, member.key)
            return BindOutcome(member.node, None)
        except Exception as exc:
            self.cache.hold_for_group(group, member, self.clock_ns())
            message = (f"pod {member.key}: binding to {member.node} failed: {short(exc)}; its cards stay held for "
                       f"group {group}, whose other members are bound, and its next bind binds it")
            if pod is not None:
                raise BindError(message) from exc
            log.warning("%s", message)
            return BindOutcome(member.node, None)
        return BindOutcome(member.node, member.record.to_json())

    def _release(self, member: HeldMember) -> None:
        self.cache.release_member(member)
        self.choice.withdraw(member.node, member.uid)

    def expire_groups(self, now_ns: int) -> None:
        """Release the held placements of groups past ``--group-timeout``; the expiry loop calls it."""
        with self._group_lock:  # never between a bind's look at its group and the Bindings it POSTs
            expired = self.cache.expire_groups(now_ns)
        for group, members in expired:
            log.warning("group %s: not complete %g s after its first hold; released the cards held for %s",
                        group, self.cache.group_timeout_s, ", ".join(f"{m.key} on {m.node}" for m in members))
            for member in members:
                self.choice.withdraw(member.node, member.uid)

    def remove_record(self, namespace: str, name: str, raw_record: str, uid: str = "") -> None:
        """Delete an unbound pod's record only if it is still exactly ``raw_record`` (podapi.py)."""
        self.pods.remove_record(namespace, name, raw_record, uid)

    def delete_expired(self, expired: Expired) -> None:
        self.remove_record(expired.namespace, expired.name, expired.record_raw, expired.uid)
