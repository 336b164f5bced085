"""Serving the GPU quota: the verdict of claimquota.py and podquota.py on what the apiserver holds now.

On a ResourceClaim or Pod CREATE in a namespace with a qgpu quota (``gpu.qgpu.io/core``,
``gpu.qgpu.io/memory``), :class:`ClaimQuota` lists the namespace's ResourceQuotas, ResourceClaims
and Pods (a page at a time, each reduced to its charges) and judges the new object, counting as
used the listed claims, every dialect's share of the listed pods, and the reservations of claims
and pods admitted a moment ago that the lists do not show yet (webhook/ledger.py): one quota for every dialect, on device-plugin and DRA pools.
An admission is final only once its own reservation is written to the
namespace's ledger Lease on the resourceVersion it was read at, so two admissions racing each other
are serialised by the apiserver, in one webhook process or across replicas: the loser's write is a
409, and it reads, lists and judges again. Within one process the admissions of a namespace also
take a lock, so its replicas do not fight each other for the Lease.

Every apiserver call has a timeout and the whole check a budget below the webhook's
``timeoutSeconds``; a failure is a refusal with code 500 naming the call and the apiserver's words
(fail closed: admitting a claim whose quota cannot be checked would make the quota a suggestion).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Final, Iterator, Mapping

from kubernetes import client

from qgpu_runtime.contract.leases import LedgerError, Reservation, encode_ledger, ledger_name, parse_ledger
from qgpu_runtime.contract.names import CLAIM_RESERVATIONS, GPU_MODE, GPU_MODE_DRA
from qgpu_runtime.contract.observed import FirstSeen
from qgpu_runtime.kube.client import raw_json
from qgpu_runtime.kube.errors import ApiError, Conflict, NotFound, Unreachable, call
from qgpu_runtime.kube.leasedoc import LeaseDocuments
from qgpu_runtime.kube.paging import PageTooLarge, pages
from qgpu_runtime.model.requests import DEFAULT_LIMITS, CardLimits
from qgpu_runtime.webhook.claimquota import (
    CORE_QUOTA,
    MEMORY_QUOTA,
    ClaimQuotaError,
    Usage,
    claim_admission,
    claim_charges,
    claim_controllers,
    claim_name,
    claim_usage,
    is_claim_create,
    new_claim,
    quota_refusals,
)
from qgpu_runtime.webhook.dra import CardSizesUnavailable
from qgpu_runtime.webhook.ledger import MAX_ENTRIES, pending, reserved_usage, stamps
from qgpu_runtime.webhook.podquota import POD_KEY_PREFIX, ClaimSeen, pod_key, pod_usage, pods_usage

log = logging.getLogger(__name__)
LABELS = {"app.kubernetes.io/managed-by": "qgpu-webhook", "app.kubernetes.io/component": "claim-quota-ledger"}


Judge = Callable[[Mapping[str, Usage], Usage, list[dict[str, Any]], Usage, int], tuple[bool, str]]
"""(what each listed claim asks, by name; what the listed pods and pending reservations use;
quotas; what the object asks) -> (allowed, message)."""

LIST_PAGES_AT_ONCE: Final = 4
"""Pages read and decoded at once across namespaces: a decoded page weighs several times its
body, and the webhook's memory limit is for every review it serves."""


_reading = threading.BoundedSemaphore(LIST_PAGES_AT_ONCE)


class QuotaUnavailable(Exception):
    """The quota cannot be checked now (the apiserver failed or the budget ran out): a 500 refusal."""


class LedgerConflict(Exception):
    """The ledger changed since it was read: read, list and judge again."""


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    message: str = ""
    code: int = 422  # with allowed=False: 422 the claim breaks the quota or a rule, 500 it cannot be checked


@dataclass(frozen=True)
class Ledger:
    entries: dict[str, Reservation]
    resource_version: str | None  # None: no Lease yet


class _NamespaceLocks:
    """One lock per namespace, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def hold(self, namespace: str, timeout_s: float) -> Iterator[bool]:
        with self._guard:
            lock, users = self._locks.get(namespace, (threading.Lock(), 0))
            self._locks[namespace] = (lock, users + 1)
        acquired = lock.acquire(timeout=max(0.0, timeout_s))
        try:
            yield acquired
        finally:
            if acquired:
                lock.release()
            with self._guard:
                lock, users = self._locks[namespace]
                if users == 1:
                    del self._locks[namespace]
                else:
                    self._locks[namespace] = (lock, users - 1)


class ClaimQuota:
    """``__call__(request) -> Verdict`` for the AdmissionReview request of ``/validate-claim``.

    ``ledger_namespace`` holds the ledger Leases (the webhook's own namespace, so its RBAC on
    Leases stays there). ``reservation_ttl_s`` bounds how long an admitted claim that never
    appears keeps counting; it must exceed the time between admission and storage (the rest of the
    admission chain, at most the webhooks' timeouts). ``budget_s`` bounds the whole check and must
    stay below the webhook configuration's ``timeoutSeconds``.
    """

    def __init__(self, api_client: client.ApiClient, ledger_namespace: str, *, reservation_ttl_s: float = 30.0,
                 budget_s: float = 8.0, call_timeout: tuple[float, float] = (2.0, 4.0),
                 default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib, limits: CardLimits = DEFAULT_LIMITS,
                 dra: bool = False, card_sizes: Callable[[], tuple[int, ...]] | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        if reservation_ttl_s <= 0 or budget_s <= 0:
            raise ValueError(f"reservation_ttl_s={reservation_ttl_s}, budget_s={budget_s}: both must be > 0")
        self.core = client.CoreV1Api(api_client)
        self.resource = client.ResourceV1Api(api_client)
        self.leases = client.CoordinationV1Api(api_client)
        self.ledger_namespace = ledger_namespace
        self.ttl = reservation_ttl_s
        self.budget = budget_s
        self.call_timeout = call_timeout
        self.default_memory_mib = default_memory_mib
        # The card sizes of the DRA pools (--dra-card-memory-mib, else what their slices publish):
        # a request naming no memory is given a whole card, charged as the largest of them.
        self.card_sizes = card_sizes
        self._last_sizes: tuple[int, ...] | None = None
        self.limits = limits
        self.dra = dra
        self.clock = clock
        self.monotonic = monotonic
        self.locks = _NamespaceLocks()
        # when this replica first saw each ledger entry, by ``monotonic``: what expiry is measured by
        self.seen = FirstSeen()
        # by namespace: the ledger entries this replica saw stored, each with the stamp of the
        # reservation it saw stored (a claim deleted and created again is a new reservation)
        self.stored: dict[str, dict[str, tuple[int, int, float]]] = {}
        self.conflicts = 0  # lost ledger writes, each followed by a fresh check

    @property
    def ledger(self) -> LeaseDocuments:
        """The namespaces' ledger Leases, through ``leases`` (which tests replace by a fake)."""
        return LeaseDocuments(self.leases, self.ledger_namespace, CLAIM_RESERVATIONS, LABELS)

    def __call__(self, request: Mapping[str, Any]) -> Verdict:
        """The verdict on a ResourceClaim CREATE (anything else is allowed)."""
        if not is_claim_create(request):
            return Verdict(True)
        claim = new_claim(request)
        if claim is None:
            return Verdict(*claim_admission(request, [], []))
        namespace = claim["metadata"]["namespace"]
        key = str(claim["metadata"].get("name") or f"uid:{request.get('uid')}")

        def asked_of(_dra_namespace: bool, memory: int) -> Usage:
            return claim_usage(claim, memory)

        own = claim_name(claim)

        def judge(charges: Mapping[str, Usage], others: Usage, quotas: list[dict[str, Any]], _asked: Usage,
                  memory: int) -> tuple[bool, str]:
            used = sum((u for name, u in charges.items() if name != own), others)
            return claim_admission(request, [], quotas, memory, used)

        return self._guard("ResourceClaim", namespace, key, request, asked_of, judge)

    def check_pod(self, request: Mapping[str, Any]) -> Verdict:
        """The verdict on a Pod CREATE (anything else is allowed): every dialect's share against
        the namespace's ``gpu.qgpu.io/core`` and ``gpu.qgpu.io/memory`` (webhook/podquota.py),
        with the namespace's claims and other pods. Pod names are known here: a validating
        webhook sees the name the apiserver generated."""
        kind = request.get("kind") if isinstance(request.get("kind"), dict) else {}
        pod = request.get("object")
        if request.get("operation") != "CREATE" or kind.get("kind") != "Pod" or kind.get("group", "") != "" or not isinstance(pod, dict):
            return Verdict(True)
        meta = pod.get("metadata") if isinstance(pod.get("metadata"), dict) else {}
        namespace = str(meta.get("namespace") or request.get("namespace") or "default")
        name = str(meta.get("name") or request.get("name") or f"uid:{request.get('uid')}")
        key = pod_key(name)

        def asked_of(dra_namespace: bool, memory: int) -> Usage:
            return pod_usage(pod, dra_namespace=dra_namespace, default_memory_mib=memory, limits=self.limits)

        def judge(charges: Mapping[str, Usage], others: Usage, quotas: list[dict[str, Any]], asked: Usage,
                  _memory: int) -> tuple[bool, str]:
            try:
                refusals = quota_refusals(namespace, asked, sum(charges.values(), others), quotas)
            except ClaimQuotaError as exc:
                return False, f"qgpu: {exc}"
            return (False, "qgpu: " + "; ".join(r.message(name, "Pod") for r in refusals)) if refusals else (True, "")

        return self._guard("Pod", namespace, key, request, asked_of, judge)

    def _guard(self, kind: str, namespace: str, key: str, request: Mapping[str, Any], asked_of: Callable[[bool, int], Usage],
               judge: Judge) -> Verdict:
        deadline = self.monotonic() + self.budget
        try:
            quotas = self._list("ResourceQuotas", self.core.list_namespaced_resource_quota, namespace, deadline)
            if not any(r in ((q.get("spec") or {}).get("hard") or {}) for q in quotas for r in (CORE_QUOTA, MEMORY_QUOTA)):
                return Verdict(True)  # no qgpu quota here: nothing to reserve against
            dra_namespace = self._is_dra_namespace(namespace, deadline)
            memory = self.unsized_memory()  # one figure for the whole check: the new object's and the others'
            try:
                asked = asked_of(dra_namespace, memory)
            except ClaimQuotaError as exc:
                return Verdict(False, f"qgpu: {exc}")
            if asked.core_milli == 0 and asked.memory_mib == 0:
                return Verdict(True)
            with self.locks.hold(namespace, deadline - self.monotonic()) as acquired:
                if not acquired:
                    raise QuotaUnavailable(f"other claims and pods of namespace {namespace!r} are being checked; "
                                           f"none finished within {self.budget:g}s")
                return self._admit(request, namespace, key, asked, quotas, dra_namespace, judge, deadline, memory)
        except QuotaUnavailable as exc:
            message = (f"qgpu: {kind} {namespace}/{key.removeprefix(POD_KEY_PREFIX)}: the GPU quota cannot be checked, so the "
                       f"{'claim' if kind == 'ResourceClaim' else 'pod'} is refused (fail closed; try again): {exc}")
            log.warning("%s", message)
            return Verdict(False, message, 500)

    def unsized_memory(self) -> int:
        """What one card of a request naming no memory is charged (MiB): ``default_memory_mib``, or
        the largest card the DRA pools have when that is larger (an H200's 140 GiB: charged 80, two
        whole cards took 280 GiB of a 160 GiB quota). The sizes are the operator's
        (--dra-card-memory-mib) or, without it, the pools' slices' (each node writes its own, so a
        compromised node can raise this charge: refused admissions, never a quota passed)."""
        if self.card_sizes is None:
            return self.default_memory_mib
        try:
            sizes = self.card_sizes()
        except CardSizesUnavailable as exc:
            if self._last_sizes is None:
                raise QuotaUnavailable(f"the card sizes a request naming no memory is charged by: {exc}") from None
            sizes = self._last_sizes  # the apiserver blinked: the sizes it gave last (cards change rarely)
        self._last_sizes = tuple(sizes)
        return max((self.default_memory_mib, *sizes))

    def _stored(self, namespace: str, entries: Mapping[str, Reservation], visible: set[str]) -> set[str]:
        """The ledger entries whose object this replica has seen listed: stored, so its reservation
        no longer counts even once the object is gone (deleted, or a pod that finished and was
        removed) before a write pruned the entry. Called under the namespace's lock; what it keeps
        is bounded by the ledger's entries.

        Remembered by name *and* stamp: an entry written again under a name seen stored before (a
        claim deleted and created again) is a new reservation and counts until its object is
        listed. Remembered by name alone, it was taken for stored at once, and a concurrent claim
        was admitted past the quota beside it."""
        current = stamps(entries)
        known = {name: stamp for name, stamp in self.stored.get(namespace, {}).items() if current.get(name) == stamp}
        known.update((name, current[name]) for name in visible if name in current)
        if known:
            self.stored[namespace] = known
        else:
            self.stored.pop(namespace, None)
        return set(known)

    def _is_dra_namespace(self, namespace: str, deadline: float) -> bool:
        """Whether the namespace's GPU pods become DRA claims (its label, which only cluster admins
        write); only a webhook serving DRA pools asks."""
        if not self.dra:
            return False
        found = self._call(f"reading Namespace {namespace!r}", lambda t: call(
            self.core.read_namespace, namespace, _preload_content=False, _request_timeout=t), deadline)
        labels = (raw_json(found).get("metadata") or {}).get("labels") or {}
        return isinstance(labels, dict) and labels.get(GPU_MODE) == GPU_MODE_DRA

    def _admit(self, request: Mapping[str, Any], namespace: str, key: str, asked: Usage, quotas: list[dict[str, Any]],
               dra_namespace: bool, judge: Judge, deadline: float, memory: int) -> Verdict:
        attempt = 0
        while True:
            ledger = self._read_ledger(namespace, deadline)
            charges: dict[str, Usage] = {}
            controllers: dict[str, str] = {}
            visible: set[str] = set()
            for page in self._pages("ResourceClaims", self.resource.list_namespaced_resource_claim, namespace, deadline,
                                    api_may_be_absent=True):
                visible |= {str((c.get("metadata") or {}).get("name")) for c in page}
                for name, used in claim_charges(page, namespace, memory).items():
                    charges[name] = charges.get(name, Usage()) + used
                controllers.update(claim_controllers(page, namespace))
                del page  # not held while the next page is read
            seen = {name: ClaimSeen(used, controllers.get(name)) for name, used in charges.items()}
            # every pod, finished ones too: a pod stored is no longer a pending reservation, whatever its phase
            skip = key.removeprefix(POD_KEY_PREFIX) if key.startswith(POD_KEY_PREFIX) else None
            pods_used = Usage()
            for page in self._pages("Pods", self.core.list_namespaced_pod, namespace, deadline):
                visible |= {pod_key(str((p.get("metadata") or {}).get("name"))) for p in page}
                pods_used += pods_usage(page, namespace, skip=skip, dra_namespace=dra_namespace,
                                        default_memory_mib=memory, limits=self.limits, claims=seen)
                del page
            ages = self.seen.ages(namespace, stamps(ledger.entries), self.monotonic())
            counting = pending(ledger.entries, ages, self.ttl, visible | self._stored(namespace, ledger.entries, visible))
            counting.pop(key, None)  # a retried CREATE of the same object is not charged twice
            allowed, message = judge(charges, pods_used + reserved_usage(counting), quotas, asked, memory)
            if not allowed:
                return Verdict(False, message)
            if request.get("dryRun") is True:
                return Verdict(True)  # nothing will be stored, so nothing is reserved (sideEffects: NoneOnDryRun)
            if len(counting) >= MAX_ENTRIES:
                raise QuotaUnavailable(f"{len(counting)} claims and pods of the namespace are admitted and not yet stored")
            # ``expires`` by this replica's wall clock, for earlier releases' readers only
            counting[key] = Reservation(asked.core_milli, asked.memory_mib, self.clock() + self.ttl)
            try:
                self._write_ledger(namespace, ledger, counting, deadline)
                # what this replica saw stored under that name is gone: the entry is a new reservation
                self.stored.get(namespace, {}).pop(key, None)
                return Verdict(True)
            except LedgerConflict:
                self.conflicts += 1
                attempt += 1
                delay = min(0.2, 0.005 * (2 ** min(attempt, 6))) * random.random()
                if self.monotonic() + delay >= deadline:
                    raise QuotaUnavailable(f"Lease {self.ledger_namespace}/{ledger_name(namespace)}: {attempt} writes lost to "
                                           f"concurrent admissions within {self.budget:g}s") from None
                time.sleep(delay)

    def _timeout(self, deadline: float, what: str) -> tuple[float, float]:
        left = deadline - self.monotonic()
        if left <= 0.05:
            raise QuotaUnavailable(f"{what}: no time left of the {self.budget:g}s budget")
        return min(self.call_timeout[0], left), min(self.call_timeout[1], left)

    def _call(self, what: str, attempt: Callable[[tuple[float, float]], Any], deadline: float, *, write: bool = False) -> Any:
        """``attempt(timeout)``; an API failure becomes :class:`QuotaUnavailable` naming ``what``
        and the reason, except a write's 409, a :class:`LedgerConflict`."""
        timeout = self._timeout(deadline, what)
        try:
            return attempt(timeout)
        except Unreachable as exc:
            raise QuotaUnavailable(f"{what}: the apiserver could not be reached: {exc}") from None
        except ApiError as exc:
            if write and isinstance(exc, Conflict):
                raise LedgerConflict(what) from None
            raise QuotaUnavailable(f"{what}: the apiserver answered {exc}") from None

    def _list(self, kind: str, list_call: Callable[..., Any], namespace: str, deadline: float) -> list[dict[str, Any]]:
        """The namespace's objects of ``kind`` in one answer: only for kinds a tenant with ``edit``
        cannot create (ResourceQuotas); what tenants write is read with :meth:`_pages`."""
        found = self._call(f"listing {kind} of namespace {namespace!r}", lambda t: raw_json(
            call(list_call, namespace, _preload_content=False, _request_timeout=t)), deadline)
        return [i for i in found.get("items") or [] if isinstance(i, dict)]

    def _pages(self, kind: str, list_call: Callable[..., Any], namespace: str, deadline: float, *,
               api_may_be_absent: bool = False) -> Iterator[list[dict[str, Any]]]:
        """The namespace's objects of ``kind``, a page at a time (one consistent snapshot: the
        continue token pins the first page's resourceVersion). The caller reduces each page before
        asking for the next; at most :data:`LIST_PAGES_AT_ONCE` pages are held across namespaces.
        ``api_may_be_absent``: a 404 means the apiserver does not serve the kind (resource.k8s.io/v1
        before Kubernetes 1.34), so none exist."""
        what = f"listing {kind} of namespace {namespace!r}"

        def fetch(limit: int, token: str | None) -> Any:
            def attempt(timeout: tuple[float, float]) -> Any:
                try:
                    return call(list_call, namespace, limit=limit, _continue=token, _preload_content=False,
                                _request_timeout=timeout)
                except NotFound:
                    if api_may_be_absent:
                        return None
                    raise
            return self._call(what, attempt, deadline)

        @contextmanager
        def one_page_at_a_time() -> Iterator[None]:
            if not _reading.acquire(timeout=max(0.0, deadline - self.monotonic())):
                raise QuotaUnavailable(f"{what}: other namespaces' lists took the {self.budget:g}s budget")
            try:
                yield
            finally:
                _reading.release()

        try:
            yield from pages(fetch, guard=one_page_at_a_time)
        except PageTooLarge as exc:
            raise QuotaUnavailable(f"{what}: {exc}") from None
        except ValueError as exc:
            raise QuotaUnavailable(f"{what}: the apiserver's answer is not JSON: {exc}") from None

    def _read_ledger(self, namespace: str, deadline: float) -> Ledger:
        name = ledger_name(namespace)
        lease = self._call(f"reading Lease {self.ledger_namespace}/{name}", lambda t: self.ledger.read(name, timeout=t), deadline)
        if lease is None:
            return Ledger({}, None)
        try:
            entries = parse_ledger(lease.text)
        except LedgerError as exc:
            raise QuotaUnavailable(f"Lease {self.ledger_namespace}/{name}: annotation {CLAIM_RESERVATIONS}: {exc} "
                                   f"(delete the Lease: the webhook recreates it)") from None
        return Ledger(entries, lease.version)

    def _write_ledger(self, namespace: str, ledger: Ledger, entries: Mapping[str, Reservation], deadline: float) -> None:
        name = ledger_name(namespace)
        where = f"writing Lease {self.ledger_namespace}/{name}"
        # Unreachable: the write may have landed; the reservation then counts for its TTL, which errs
        # on the safe side; the claim is refused and its creator retries.
        self._call(where, lambda t: self.ledger.write(name, encode_ledger(entries), ledger.resource_version, timeout=t),
                   deadline, write=True)
