"""Serving the claim quota: the verdict of claimquota.py on what the apiserver holds right now.

On a ResourceClaim CREATE in a namespace with a qgpu quota, :class:`ClaimQuota` lists the
namespace's ResourceQuotas and ResourceClaims and judges the claim with
:func:`~qgpu_runtime.webhook.claimquota.claim_admission`, counting as used, besides the listed
claims, the reservations of claims admitted a moment ago that the list does not show yet
(webhook/ledger.py). An admission is final only once its own reservation is written to the
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
from typing import Any, Callable, Iterator, Mapping

from kubernetes import client

from qgpu_runtime.contract.leases import LedgerError, Reservation, encode_ledger, ledger_name, parse_ledger
from qgpu_runtime.contract.names import CLAIM_RESERVATIONS
from qgpu_runtime.contract.observed import FirstSeen
from qgpu_runtime.kube.client import raw_json
from qgpu_runtime.kube.errors import ApiError, Conflict, Unreachable, call
from qgpu_runtime.kube.leasedoc import LeaseDocuments
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.webhook.claimquota import (
    CORE_QUOTA,
    MEMORY_QUOTA,
    ClaimQuotaError,
    claim_admission,
    claim_usage,
    is_claim_create,
    new_claim,
)
from qgpu_runtime.webhook.ledger import MAX_ENTRIES, pending, reserved_usage, stamps

log = logging.getLogger(__name__)
LABELS = {"app.kubernetes.io/managed-by": "qgpu-webhook", "app.kubernetes.io/component": "claim-quota-ledger"}


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
                 default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib,
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
        self.clock = clock
        self.monotonic = monotonic
        self.locks = _NamespaceLocks()
        # when this replica first saw each ledger entry, by ``monotonic``: what expiry is measured by
        self.seen = FirstSeen()
        self.conflicts = 0  # lost ledger writes, each followed by a fresh check

    @property
    def ledger(self) -> LeaseDocuments:
        """The namespaces' ledger Leases, through ``leases`` (which tests replace by a fake)."""
        return LeaseDocuments(self.leases, self.ledger_namespace, CLAIM_RESERVATIONS, LABELS)

    def __call__(self, request: Mapping[str, Any]) -> Verdict:
        if not is_claim_create(request):
            return Verdict(True)
        claim = new_claim(request)
        if claim is None:
            return Verdict(*claim_admission(request, [], []))
        namespace = claim["metadata"]["namespace"]
        key = str(claim["metadata"].get("name") or f"uid:{request.get('uid')}")
        deadline = self.monotonic() + self.budget
        try:
            quotas = self._list("ResourceQuotas", self.core.list_namespaced_resource_quota, namespace, deadline)
            if not any(r in ((q.get("spec") or {}).get("hard") or {}) for q in quotas for r in (CORE_QUOTA, MEMORY_QUOTA)):
                return Verdict(True)  # no qgpu quota here: nothing to reserve against
            try:
                asked = claim_usage(claim, self.default_memory_mib)
            except ClaimQuotaError as exc:
                return Verdict(False, f"qgpu: {exc}")
            if asked.core_milli == 0 and asked.memory_mib == 0:
                return Verdict(True)
            with self.locks.hold(namespace, deadline - self.monotonic()) as acquired:
                if not acquired:
                    raise QuotaUnavailable(f"other claims of namespace {namespace!r} are being checked; "
                                           f"none finished within {self.budget:g}s")
                return self._admit(request, namespace, key, asked, quotas, deadline)
        except QuotaUnavailable as exc:
            message = (f"qgpu: ResourceClaim {namespace}/{key}: the GPU quota cannot be checked, so the claim is refused "
                       f"(fail closed; try again): {exc}")
            log.warning("%s", message)
            return Verdict(False, message, 500)

    def _admit(self, request: Mapping[str, Any], namespace: str, key: str, asked: Any, quotas: list[dict[str, Any]],
               deadline: float) -> Verdict:
        attempt = 0
        while True:
            ledger = self._read_ledger(namespace, deadline)
            claims = self._list("ResourceClaims", self.resource.list_namespaced_resource_claim, namespace, deadline)
            visible = {str((c.get("metadata") or {}).get("name")) for c in claims}
            ages = self.seen.ages(namespace, stamps(ledger.entries), self.monotonic())
            counting = pending(ledger.entries, ages, self.ttl, visible)
            counting.pop(key, None)  # a retried CREATE of the same claim is not charged twice
            allowed, message = claim_admission(request, claims, quotas, self.default_memory_mib, reserved_usage(counting))
            if not allowed:
                return Verdict(False, message)
            if request.get("dryRun") is True:
                return Verdict(True)  # nothing will be stored, so nothing is reserved (sideEffects: NoneOnDryRun)
            if len(counting) >= MAX_ENTRIES:
                raise QuotaUnavailable(f"{len(counting)} claims of the namespace are admitted and not yet stored")
            # ``expires`` by this replica's wall clock, for earlier releases' readers only
            counting[key] = Reservation(asked.core_milli, asked.memory_mib, self.clock() + self.ttl)
            try:
                self._write_ledger(namespace, ledger, counting, deadline)
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
        response = self._call(f"listing {kind} of namespace {namespace!r}", lambda t: call(
            list_call, namespace, _preload_content=False, _request_timeout=t), deadline)
        return [i for i in raw_json(response).get("items") or [] if isinstance(i, dict)]

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
