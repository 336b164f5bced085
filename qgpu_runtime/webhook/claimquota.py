"""Namespace quota on the GPU core and memory that ResourceClaims of qgpu's DeviceClasses ask for.

Kubernetes' ResourceQuota counts DRA *devices* (``<class>.deviceclass.resource.k8s.io/devices``),
not the capacity a claim consumes: one claim for 10 % of a card and one for a whole card count the
same. qgpu fills that in at admission. The quota is declared where operators already look, in a
ResourceQuota of the namespace, under two resource names no upstream quota evaluator claims:

    spec:
      hard:
        gpu.qgpu.io/core: "4000"      # thousandths of a card: four whole cards' worth
        gpu.qgpu.io/memory: "65536"   # MiB

kube-apiserver accepts them (a quota resource name with a ``/`` only has to be a qualified name;
one without must be a standard name, so ``requests.core.gpu.qgpu.io`` is refused) and counts
nothing for them (no evaluator matches: they are not ``requests.``-prefixed extended resources,
hugepages or ``count/``), so they mean exactly what this module enforces. The units are those of
the claims' ``capacity.requests`` (contract/dra.py): whole numbers, core in thousandths of a
card, memory in MiB (charged as the allocator consumes them: rounded up to the slices' request
policy, ``contract.dra.consumed_core`` / ``consumed_memory``), written as quantities without binary suffix (the apiserver serves ``4000`` back
as ``4k``).

The webhook calls :func:`check_claim` on a ResourceClaim CREATE with the namespace's claims and
ResourceQuotas. Usage is what the claims *ask*: per request of a qgpu class, ``count`` times the
capacity it names, or the whole card where it names none (the device's defaults; the card's memory
is not known before allocation, so a request naming no memory is charged ``default_memory_mib``,
the largest card qgpu admits unless the operator says otherwise). A request with a prioritized list
(``firstAvailable``) is charged its largest qgpu alternative, ``allocationMode: All`` the most cards
a node may have (``CardLimits.max_cards_per_node``). Every quota of the namespace must
hold, as upstream. Pure: dicts in, a verdict out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Iterable, Mapping

from qgpu_runtime.contract.dra import CORE, DRIVER, MEMORY, capacity_number, consumed_core, consumed_memory, shown
from qgpu_runtime.contract.draclaim import DeviceAsk, DraClaimError, claim_requests, qgpu_request_count
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, DEFAULT_LIMITS

CORE_QUOTA: Final = f"{DRIVER}/{CORE}"
"""ResourceQuota resource name of the GPU core a namespace's claims may ask (thousandths of a card)."""
MEMORY_QUOTA: Final = f"{DRIVER}/{MEMORY}"
"""ResourceQuota resource name of the GPU memory a namespace's claims may ask (MiB)."""
UNITS: Final = {CORE_QUOTA: "thousandths of a card", MEMORY_QUOTA: "MiB"}


class ClaimQuotaError(ValueError):
    """The claim or a quota cannot be read; the message names the object, the field, the value and the rule."""


@dataclass(frozen=True)
class Usage:
    core_milli: int = 0
    memory_mib: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.core_milli + other.core_milli, self.memory_mib + other.memory_mib)

    def of(self, resource: str) -> int:
        return self.core_milli if resource == CORE_QUOTA else self.memory_mib


@dataclass(frozen=True)
class Refusal:
    """One quota the new claim would exceed."""

    namespace: str
    quota: str
    resource: str
    used: int
    requested: int
    hard: int

    def message(self, claim: str, kind: str = "ResourceClaim") -> str:
        return (f"{kind} {self.namespace}/{claim}: exceeded quota {self.quota!r} in namespace "
                f"{self.namespace!r}: {self.resource} used {self.used} + requested {self.requested} > hard "
                f"{self.hard} ({UNITS[self.resource]})")


def _name(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or meta.get("generateName") or "?")


def _charge(ask: DeviceAsk, default_memory_mib: int) -> Usage:
    """What one decoded device request of a qgpu class asks, all its devices together."""
    # allocationMode All (a T9k whole-node pod): every matching card of the node, known only after
    # allocation, so the charge is the most a node may have, as the memory default is.
    count = ask.charged_cards
    # what the allocator consumes, not the figure asked: the slices' requestPolicy rounds a request
    # up to its step and minimum (core 10, memory whole GiB from 1 GiB), so {core: 1, memory: 1}
    # takes 10 and 1024; charged as asked, a 1,000-core quota admitted a thousand of them (10,000 core)
    # (never less than asked: a request above a whole card, which no card can take, keeps its figure)
    core = CORE_MILLI_PER_CARD if ask.core is None else max(ask.core, consumed_core(ask.core))
    memory = default_memory_mib if ask.memory is None else max(ask.memory, consumed_memory(ask.memory))
    return Usage(core * count, memory * count)


def claim_usage(claim: Mapping[str, Any], default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib) -> Usage:
    """GPU core and memory ``claim`` asks of qgpu's classes; requests of other classes count nothing.
    A prioritized list (``firstAvailable``) is charged its largest qgpu alternative.

    Raises ClaimQuotaError, naming the field, for a qgpu request that does not decode
    (contract/draclaim.py)."""
    try:
        requests = claim_requests(claim)
    except DraClaimError as exc:
        raise ClaimQuotaError(str(exc)) from None
    total = Usage()
    for request in requests:
        charged = Usage()
        for ask in request.alternatives:
            u = _charge(ask, default_memory_mib)
            charged = Usage(max(charged.core_milli, u.core_milli), max(charged.memory_mib, u.memory_mib))
        total += charged
    return total


def _hard(quota: Mapping[str, Any]) -> dict[str, Any]:
    spec = quota.get("spec")
    hard = spec.get("hard") if isinstance(spec, dict) else None
    return hard if isinstance(hard, dict) else {}


def quota_limits(quotas: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, int]]:
    """(quota name, resource, hard) of every qgpu entry of the namespace's ResourceQuotas."""
    limits = []
    for quota in quotas:
        _, name = _name(quota)
        hard = _hard(quota)
        for resource in (CORE_QUOTA, MEMORY_QUOTA):
            if resource in hard:
                limits.append((name, resource, capacity_number(f"ResourceQuota {name}: spec.hard[{resource!r}]", hard[resource],
                                                              ClaimQuotaError)))
    return limits


def check_claim(claim: Mapping[str, Any], existing: Iterable[Mapping[str, Any]], quotas: Iterable[Mapping[str, Any]],
                default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib, reserved: Usage = Usage()) -> list[Refusal]:
    """The quotas a new claim would exceed (empty: admit it).

    ``existing`` are the namespace's claims; the new claim itself and claims of other namespaces
    among them are skipped. ``reserved`` is what claims admitted but not yet visible in
    ``existing`` ask (the webhook's reservation ledger, webhook/ledger.py); it counts as used.
    An existing claim that cannot be read is charged a whole card for each of its requests of a
    qgpu class, so a malformed claim cannot hide usage. Raises ClaimQuotaError when the new claim or a quota cannot be read.
    """
    quotas = list(quotas)
    if not any(r in _hard(q) for q in quotas for r in (CORE_QUOTA, MEMORY_QUOTA)):
        return []  # no qgpu quota here: the claim is not ours to judge
    namespace, name = _name(claim)
    asked = claim_usage(claim, default_memory_mib)
    if asked == Usage():
        return []  # asks nothing of qgpu: a broken qgpu quota must not block other drivers' claims
    used = reserved + claims_usage(existing, namespace, name, default_memory_mib)
    return quota_refusals(namespace, asked, used, quotas)


def claim_charges(claims: Iterable[Mapping[str, Any]], namespace: str,
                  default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib) -> dict[str, Usage]:
    """What each listed claim of ``namespace`` asks, by name (as :func:`claims_usage` charges it):
    a page of a LIST reduced to this before the next is read, so the claims' bodies are not held."""
    charges: dict[str, Usage] = {}
    for other in claims:
        other_ns, other_name = _name(other)
        if other_ns == namespace:
            charges[other_name] = charges.get(other_name, Usage()) + claims_usage([other], namespace, None, default_memory_mib)
    return charges


def claim_controllers(claims: Iterable[Mapping[str, Any]], namespace: str) -> dict[str, str]:
    """The UID of the controlling owner of each listed claim of ``namespace`` that has one, by name
    (the apiserver lets an object have one owner reference with ``controller: true``): what
    kube-scheduler writes on the claim it makes for a pod's extended resources."""
    out: dict[str, str] = {}
    for claim in claims:
        claim_ns, name = _name(claim)
        meta = claim.get("metadata") if isinstance(claim.get("metadata"), dict) else {}
        refs = meta.get("ownerReferences") if isinstance(meta.get("ownerReferences"), list) else []
        for ref in refs:
            if claim_ns == namespace and isinstance(ref, dict) and ref.get("controller") is True and ref.get("uid"):
                out[name] = str(ref["uid"])
                break
    return out


def claim_name(claim: Mapping[str, Any]) -> str:
    """The name a claim is skipped by among the namespace's claims (:func:`check_claim`)."""
    return _name(claim)[1]


def claims_usage(claims: Iterable[Mapping[str, Any]], namespace: str, skip: str | None = None,
                 default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib) -> Usage:
    """What the listed ``claims`` of ``namespace`` ask (others skipped, and the claim named ``skip``).
    A claim that cannot be read is charged a whole card for each of its requests of a qgpu class,
    so a malformed claim cannot hide usage."""
    used = Usage()
    for other in claims:
        other_ns, other_name = _name(other)
        if other_ns != namespace or other_name == skip:
            continue
        try:
            used += claim_usage(other, default_memory_mib)
        except ClaimQuotaError:
            n = qgpu_request_count(other)  # a whole card per qgpu request, its count unknown: one
            used += Usage(n * CORE_MILLI_PER_CARD, n * default_memory_mib)
    return used


def quota_refusals(namespace: str, asked: Usage, used: Usage, quotas: Iterable[Mapping[str, Any]]) -> list[Refusal]:
    """The qgpu quotas of the namespace that ``used`` plus ``asked`` would exceed, for the resources
    ``asked`` takes some of. Raises ClaimQuotaError when a quota cannot be read."""
    refusals = []
    for quota, resource, hard in quota_limits(quotas):
        if used.of(resource) + asked.of(resource) > hard and asked.of(resource) > 0:
            refusals.append(Refusal(namespace, quota, resource, used.of(resource), asked.of(resource), hard))
    return refusals


def is_claim_create(request: Mapping[str, Any]) -> bool:
    """Whether an AdmissionReview ``request`` is a CREATE of a resource.k8s.io ResourceClaim."""
    kind = request.get("kind") if isinstance(request.get("kind"), dict) else {}
    return request.get("operation") == "CREATE" and kind.get("group") == "resource.k8s.io" and kind.get("kind") == "ResourceClaim"


def new_claim(request: Mapping[str, Any]) -> dict[str, Any] | None:
    """The claim a CREATE review carries, its namespace and name filled in from the request (None
    when the object is not an object)."""
    obj = request.get("object")
    if not isinstance(obj, dict):
        return None
    meta = dict(obj.get("metadata") or {}) if isinstance(obj.get("metadata"), dict) else {}
    meta.setdefault("namespace", request.get("namespace") or "default")
    if not meta.get("name") and isinstance(request.get("name"), str):
        meta["name"] = request["name"]
    return {**obj, "metadata": meta}


def claim_admission(request: Mapping[str, Any], existing: Iterable[Mapping[str, Any]], quotas: Iterable[Mapping[str, Any]],
                    default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib, reserved: Usage = Usage()) -> tuple[bool, str]:
    """(allowed, message) for an AdmissionReview ``request``: a CREATE of a resource.k8s.io
    ResourceClaim is checked against the namespace's quotas, anything else is allowed.

    The caller (the webhook's route) lists ``existing`` claims and ``quotas`` of
    ``request["namespace"]`` (and ``reserved``, see :func:`check_claim`); a claim or quota that
    cannot be read is a denial naming it, since admitting it would let the quota be bypassed."""
    if not is_claim_create(request):
        return True, ""
    claim = new_claim(request)
    if claim is None:
        return False, f"qgpu: AdmissionReview.request.object={shown(request.get('object'))}: must be a ResourceClaim object"
    try:
        refusals = check_claim(claim, existing, quotas, default_memory_mib, reserved)
    except ClaimQuotaError as exc:
        return False, f"qgpu: {exc}"
    if refusals:
        _, name = _name(claim)
        return False, "qgpu: " + "; ".join(r.message(name) for r in refusals)
    return True, ""
