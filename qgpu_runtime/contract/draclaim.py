"""The ResourceClaim as qgpu writes and reads it: one strict decoder for every reader of a claim.

Writers: the webhook puts ``capacity.requests`` (:func:`capacity_requests`) and the opaque
``ShareConfig`` (:func:`share_config`) into the claim templates it makes; kube-scheduler writes the
allocation (``status.allocation``: results with ``consumedCapacity``, and its copy of the configs).
Readers, all through this module:

- the webhook's claim quota (webhook/claimquota.py) reads what a claim *asks*
  (:func:`claim_requests`); admission refuses a claim that does not decode;
- the extender's DRA view (extender/dra.py) reads what claims and templates ask
  (:func:`spec_requests`) and what allocated claims consume (:func:`claim_shares`); a stored claim
  that does not decode gives no preference (asks) or counts as nothing (usage), as before;
- the node's kubelet plugin reads the allocation on its node (:func:`claim_shares`) and each
  request's class (:func:`claim_share_settings`), and refuses to prepare a claim that does not decode.

Quantities follow one rule (:func:`contract.dra.capacity_number`): whole numbers in qgpu's units,
in any form kube-apiserver serves (``1000`` comes back ``1k``). Every refusal is a
:class:`DraClaimError` naming the object, the field, the value and the rule. Pure functions over
dicts (the API's JSON).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Iterable, Mapping

from qgpu_runtime.contract.dra import (
    CORE,
    CORE_STEP,
    DRIVER,
    MEMORY,
    QGPU_CLASSES,
    capacity_number,
    card_index,
    pool_name,
    shown,
)
from qgpu_runtime.contract.record import ContainerDialect
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, DEFAULT_LIMITS, Dialect

MAX_COUNT: Final = 32
"""A claim's allocation holds at most 32 devices (AllocationResultsMaxSize, pkg/apis/resource of
v1.37): a larger ``count`` can never be allocated, so it does not decode."""
EXACT_COUNT: Final = "ExactCount"
ALL: Final = "All"


class DraClaimError(ValueError):
    """A claim qgpu cannot read; the message names the claim, field, value and rule."""


def describe(obj: Mapping[str, Any], kind: str = "ResourceClaim") -> str:
    """``ResourceClaim ns/name``, how every message of this module starts."""
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return f"{kind} {meta.get('namespace') or '?'}/{meta.get('name') or meta.get('generateName') or '?'}"


def _capacity(where: str, value: Any) -> int:
    return capacity_number(where, value, DraClaimError)


# ---- what the webhook writes --------------------------------------------------------------------

def capacity_requests(core_milli: int, memory_mib: int) -> dict[str, Any]:
    """A share's ``capacity`` of a device request, in qgpu's units (plain integers as text)."""
    return {"requests": {CORE: str(int(core_milli)), MEMORY: str(int(memory_mib))}}


CONFIG_API_VERSION: Final = "gpu.qgpu.io/v1alpha1"
CONFIG_KIND: Final = "ShareConfig"
"""The opaque configuration of a claim's requests (``config[].opaque.parameters``): what the
scheduler need not know but the node must, i.e. qGPU's co-location class, whether the share's
core may be exceeded when the card is idle (``qgpu-core-greedy``), and for a peer's dialect that
sets its own variables (T9k's whole node, HAMi, KAI) how the container asked (``dialect``, the
allocation record's fields) and whether it asked memory only (``memoryOnly``: the node books core 0,
as the device-plugin path does, not the smallest core step the claim had to ask)."""

_DIALECT_KEYS = frozenset({"dialect", "memory_pct", "whole_node"})


def share_config(app_class: str, greedy: bool, dialect: ContainerDialect | None = None,
                 memory_only: bool = False) -> dict[str, Any]:
    """The opaque parameters of a share: ``app_class`` online, offline or normal."""
    if app_class not in ("online", "offline", "normal"):
        raise ValueError(f"appClass {app_class!r} is not allowed: must be online, offline or normal")
    doc: dict[str, Any] = {"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "appClass": app_class, "greedy": bool(greedy)}
    if dialect is not None:
        doc["dialect"] = dialect.to_doc()
    if memory_only:
        doc["memoryOnly"] = True
    return doc


def read_share_config(parameters: Any) -> tuple[str, bool]:
    """(appClass, greedy) of opaque parameters written by :func:`share_config`; DraClaimError otherwise."""
    settings = read_share_settings(parameters)
    return settings.app_class, settings.greedy


def _read_dialect(parameters: dict[str, Any]) -> ContainerDialect | None:
    """The optional ``dialect`` of a ShareConfig. Whoever may write the claim may write it: it
    names only the variables of that claim's own container, never a booking (docs/security.md)."""
    doc = parameters.get("dialect")
    if doc is None:
        return None
    rule = (f"dialect must be an object with 'dialect' one of {', '.join(d.value for d in Dialect)}, "
            "'memory_pct' an integer 1..100, 'whole_node' a boolean, and nothing else")
    if not isinstance(doc, dict) or set(doc) - _DIALECT_KEYS or doc.get("dialect") not in {d.value for d in Dialect}:
        raise DraClaimError(f"opaque parameters dialect={shown(doc)} are not allowed: {rule}")
    pct, whole = doc.get("memory_pct"), doc.get("whole_node", False)
    if (pct is not None and (isinstance(pct, bool) or not isinstance(pct, int) or not 1 <= pct <= 100)) or not isinstance(whole, bool):
        raise DraClaimError(f"opaque parameters dialect={shown(doc)} are not allowed: {rule}")
    return ContainerDialect(doc["dialect"], pct, whole)


_SHARE_CONFIG_KEYS = frozenset({"apiVersion", "kind", "appClass", "greedy", "memoryOnly", "dialect"})


def read_share_settings(parameters: Any) -> ShareSettings:
    """The :class:`ShareSettings` of opaque parameters written by :func:`share_config`; DraClaimError otherwise."""
    if not isinstance(parameters, dict) or parameters.get("apiVersion") != CONFIG_API_VERSION or parameters.get("kind") != CONFIG_KIND:
        raise DraClaimError(f"opaque parameters {parameters!r} are not allowed: expected apiVersion {CONFIG_API_VERSION}, kind {CONFIG_KIND}")
    unknown = sorted(str(k) for k in set(parameters) - _SHARE_CONFIG_KEYS)
    if unknown:
        raise DraClaimError(f"opaque parameters {shown(parameters)} are not allowed: {CONFIG_KIND} has no key "
                            f"{', '.join(repr(k[:64]) for k in unknown[:4])}; it takes {', '.join(sorted(_SHARE_CONFIG_KEYS))}")
    app_class, greedy = parameters.get("appClass", "normal"), parameters.get("greedy", False)
    if app_class not in ("online", "offline", "normal") or not isinstance(greedy, bool):
        raise DraClaimError(f"opaque parameters {parameters!r} are not allowed: appClass online|offline|normal, greedy a boolean")
    memory_only = parameters.get("memoryOnly", False)
    if not isinstance(memory_only, bool):
        raise DraClaimError(f"opaque parameters memoryOnly={shown(memory_only)} are not allowed: must be a boolean")
    return ShareSettings(app_class, greedy, _read_dialect(parameters), memory_only)


# ---- what a claim asks (spec.devices.requests) ----------------------------------------------------

@dataclass(frozen=True)
class DeviceAsk:
    """One device request (or ``firstAvailable`` subrequest) of qgpu's classes, decoded.

    ``count`` is None for ``allocationMode: All`` (every matching card of the node: known only at
    allocation); ``core`` (thousandths) and ``memory`` (MiB) are None where the claim names no
    capacity, so the device's defaults apply: the whole card."""

    name: str
    device_class: str
    count: int | None
    core: int | None
    memory: int | None

    @property
    def charged_cards(self) -> int:
        """The cards the namespace's quota is charged for: ``count``, or for ``allocationMode: All``
        the most cards one pod may take (``CardLimits.max_cards_per_node``), the node's card count
        being known only at allocation. The node prepares no more than this (node/dra/preparer.py)."""
        return DEFAULT_LIMITS.max_cards_per_node if self.count is None else self.count


@dataclass(frozen=True)
class ClaimRequest:
    """One request of a claim that asks qgpu: ``alternatives`` holds its ``exactly`` alone, or the
    qgpu subrequests of its ``firstAvailable`` list in the order the allocator tries them."""

    name: str
    alternatives: tuple[DeviceAsk, ...]
    prioritized: bool = False


def _device_ask(where: str, name: str, request: Mapping[str, Any]) -> DeviceAsk:
    mode = request.get("allocationMode") or EXACT_COUNT
    count: int | None = None
    if mode == EXACT_COUNT:
        count = request.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
            raise DraClaimError(f"{where}.count={shown(count)}: must be an integer 1..{MAX_COUNT}")
    elif mode != ALL:
        raise DraClaimError(f"{where}.allocationMode={shown(mode)}: must be {EXACT_COUNT} or {ALL}")
    capacity = request.get("capacity") or {}
    asked = capacity.get("requests") if isinstance(capacity, dict) else None
    if asked is None:
        asked = {}
    if not isinstance(capacity, dict) or not isinstance(asked, dict):
        raise DraClaimError(f"{where}.capacity={shown(capacity)}: must be an object with a 'requests' object")
    core = _capacity(f"{where}.capacity.requests.{CORE}", asked[CORE]) if CORE in asked else None
    memory = _capacity(f"{where}.capacity.requests.{MEMORY}", asked[MEMORY]) if MEMORY in asked else None
    return DeviceAsk(name, str(request.get("deviceClassName")), count, core, memory)


def spec_requests(spec: Any, where: str) -> list[ClaimRequest]:
    """The requests of a claim spec that ask qgpu's classes, decoded; others' are skipped.

    ``where`` names the spec in messages (``ResourceClaim ns/c: spec``). A spec without requests
    asks nothing. Both API forms are read: resource.k8s.io/v1 nests a request under ``exactly``,
    v1beta1 did not. Raises DraClaimError for a qgpu request that does not decode: a count outside
    1..:data:`MAX_COUNT`, an unknown ``allocationMode``, a capacity that is not a whole number.
    """
    devices = spec.get("devices") if isinstance(spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    if requests is None:
        return []
    if not isinstance(requests, list):
        raise DraClaimError(f"{where}.devices.requests={shown(requests)}: must be a list")
    out: list[ClaimRequest] = []
    for i, request in enumerate(requests):
        at = f"{where}.devices.requests[{i}]"
        if not isinstance(request, dict):
            raise DraClaimError(f"{at}={shown(request)}: must be an object")
        name = str(request.get("name") or "")
        if "firstAvailable" in request:
            subs = request["firstAvailable"]
            if not isinstance(subs, list):
                raise DraClaimError(f"{at}.firstAvailable={shown(subs)}: must be a list")
            alternatives = tuple(_device_ask(f"{at}.firstAvailable[{j}]", f"{name}/{sub.get('name') or ''}", sub)
                                 for j, sub in enumerate(subs)
                                 if isinstance(sub, dict) and sub.get("deviceClassName") in QGPU_CLASSES)
            if alternatives:
                out.append(ClaimRequest(name, alternatives, prioritized=True))
            continue
        exactly = request.get("exactly", request)
        if isinstance(exactly, dict) and exactly.get("deviceClassName") in QGPU_CLASSES:
            out.append(ClaimRequest(name, (_device_ask(at + (".exactly" if "exactly" in request else ""), name, exactly),)))
    return out


def claim_requests(claim: Mapping[str, Any]) -> list[ClaimRequest]:
    """:func:`spec_requests` of a ResourceClaim."""
    return spec_requests(claim.get("spec"), f"{describe(claim)}: spec")


def template_requests(template: Mapping[str, Any]) -> list[ClaimRequest]:
    """:func:`spec_requests` of a ResourceClaimTemplate (its claims' spec is ``spec.spec``)."""
    spec = template.get("spec")
    return spec_requests(spec.get("spec") if isinstance(spec, dict) else None, f"{describe(template, 'ResourceClaimTemplate')}: spec.spec")


def qgpu_request_count(claim: Mapping[str, Any]) -> int:
    """How many requests of a claim name one of qgpu's classes, read as leniently as possible: for
    a reader that must account for a stored claim that does not decode (its counts unknown: one
    each). Never raises."""
    spec = claim.get("spec") if isinstance(claim.get("spec"), dict) else {}
    devices = spec.get("devices") if isinstance(spec.get("devices"), dict) else {}
    requests = devices.get("requests") if isinstance(devices.get("requests"), list) else []
    n = 0
    for request in requests:
        if not isinstance(request, dict):
            continue
        exactly = request.get("exactly", request)
        classes = [exactly.get("deviceClassName")] if isinstance(exactly, dict) else []
        if isinstance(request.get("firstAvailable"), list):
            classes += [s.get("deviceClassName") for s in request["firstAvailable"] if isinstance(s, dict)]
        n += any(c in QGPU_CLASSES for c in classes)
    return n


# ---- what a claim was allocated (status.allocation) ----------------------------------------------

@dataclass(frozen=True)
class ClaimShare:
    """One device result of a claim allocated to qgpu: which card and how much of it."""

    request: str
    pool: str
    device: str
    card_index: int
    core_milli: int
    memory_mib: int
    share_id: str


def claim_shares(claim: dict[str, Any], node: str) -> list[ClaimShare]:
    """The qgpu results of ``claim``'s allocation on ``node``, validated; other drivers' are skipped.

    Raises DraClaimError for an unallocated claim, a result in another node's pool, a device name
    qgpu never published, or a consumed capacity that is missing, not a whole number or out of range.
    """
    where = describe(claim)
    alloc = (claim.get("status") or {}).get("allocation")
    if not alloc:
        raise DraClaimError(f"{where}: status.allocation is missing: the claim is not allocated yet")
    results = ((alloc.get("devices") or {}).get("results")) or []
    shares: list[ClaimShare] = []
    for i, r in enumerate(results):
        if r.get("driver") != DRIVER:
            continue
        at = f"{where}: status.allocation.devices.results[{i}]"
        pool, device = str(r.get("pool") or ""), str(r.get("device") or "")
        if pool != pool_name(node):
            raise DraClaimError(f"{at}.pool {pool!r} is not allowed: this node's pool is {pool_name(node)!r}")
        try:
            index = card_index(device)
        except ValueError as e:
            raise DraClaimError(f"{at}.device: {e}") from None
        consumed = r.get("consumedCapacity")
        if not isinstance(consumed, dict):
            raise DraClaimError(f"{at}.consumedCapacity is missing: qgpu shares need consumable capacity "
                                "(feature gate DRAConsumableCapacity on kube-apiserver, kube-scheduler and kubelet)")
        if CORE not in consumed or MEMORY not in consumed:
            raise DraClaimError(f"{at}.consumedCapacity {consumed!r} is not allowed: it must name {CORE!r} and {MEMORY!r}")
        core = _capacity(f"{at}.consumedCapacity.{CORE}", consumed[CORE])
        memory = _capacity(f"{at}.consumedCapacity.{MEMORY}", consumed[MEMORY])
        if not CORE_STEP <= core <= CORE_MILLI_PER_CARD:
            raise DraClaimError(f"{at}.consumedCapacity.{CORE} {core} is not allowed: must be {CORE_STEP}..{CORE_MILLI_PER_CARD}")
        if memory < 1:
            raise DraClaimError(f"{at}.consumedCapacity.{MEMORY} {memory} is not allowed: must be >= 1 MiB")
        shares.append(ClaimShare(request=str(r.get("request") or ""), pool=pool, device=device, card_index=index,
                                 core_milli=core, memory_mib=memory, share_id=str(r.get("shareID") or "")))
    return shares


def allocated_node(claim: Mapping[str, Any]) -> str | None:
    """The node kube-scheduler allocated the claim for, read from ``status.allocation.nodeSelector``
    (one term, ``matchFields`` ``metadata.name`` ``In`` one node: what it writes for node-local
    devices); None when the selector says anything else or is absent."""
    selector = (((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector")) or {}
    terms = selector.get("nodeSelectorTerms") if isinstance(selector, dict) else None
    if not isinstance(terms, list) or len(terms) != 1 or not isinstance(terms[0], dict):
        return None
    fields = terms[0].get("matchFields")
    if terms[0].get("matchExpressions") or not isinstance(fields, list) or len(fields) != 1 or not isinstance(fields[0], dict):
        return None
    field_ = fields[0]
    values = field_.get("values")
    if field_.get("key") != "metadata.name" or field_.get("operator") != "In" or not isinstance(values, list) or len(values) != 1:
        return None
    return str(values[0])


def allocated_pools(claim: Mapping[str, Any]) -> list[str]:
    """The pools (one per node) that hold qgpu results of the claim's allocation, sorted."""
    results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")) or []
    return sorted({str(r.get("pool") or "") for r in results if r.get("driver") == DRIVER})


def pool_shares(claim: Mapping[str, Any], pool: str) -> list[ClaimShare]:
    """:func:`claim_shares` of the qgpu results in ``pool`` alone (a pool is a node), so a reader
    of every node's allocations sees each pool's results decode or fail on their own."""
    alloc = dict((claim.get("status") or {}).get("allocation") or {})
    devices = dict(alloc.get("devices") or {})
    one_pool = {**devices, "results": [r for r in devices.get("results") or []
                                       if r.get("driver") == DRIVER and r.get("pool") == pool]}
    return claim_shares({**claim, "status": {"allocation": {**alloc, "devices": one_pool}}}, pool)


# ---- which class each request is (the opaque configs) ---------------------------------------------

@dataclass(frozen=True)
class ShareSettings:
    """What a claim's opaque config says of one request: its co-location class and greedy flag.

    Greedy carries nothing beyond the class on the node: an offline pod's ``qgpu-core-greedy`` is
    its ``core`` share, as in the device-plugin path (the record holds the core and the class)."""

    app_class: str = "normal"
    greedy: bool = False
    dialect: ContainerDialect | None = None  # how the container asked, for a peer's variables
    memory_only: bool = False  # booked with core 0, as online shares are


NORMAL_SHARE: Final = ShareSettings()


def _config_applies(names: list[str], request: str) -> bool:
    """A config entry names requests; none means all of them. A subrequest's result (``gpu/t4``,
    from ``firstAvailable``) is governed by a config naming its parent request (``gpu``)."""
    return not names or any(request == n or request.startswith(f"{n}/") for n in names)


def claim_share_settings(claim: dict[str, Any], requests: Iterable[str]) -> dict[str, ShareSettings]:
    """The ShareSettings of each of ``requests`` (result request names) from the claim's opaque
    configs for qgpu's driver, defaulting to normal.

    The allocation's copy (``status.allocation.devices.config``, written by kube-scheduler with the
    class's configs first) is read when present, else the claim's ``spec.devices.config``; later
    entries override earlier ones for the requests they name, as in DRA. Other drivers' entries
    are skipped. Raises DraClaimError naming the field for a malformed entry of qgpu's driver.
    """
    where = describe(claim)
    allocated = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("config")
    field, entries = "status.allocation.devices.config", allocated
    if not allocated:
        field, entries = "spec.devices.config", ((claim.get("spec") or {}).get("devices") or {}).get("config")
    wanted = list(dict.fromkeys(requests))
    out = {r: NORMAL_SHARE for r in wanted}
    if entries is None:
        return out
    if not isinstance(entries, list):
        raise DraClaimError(f"{where}: {field} {entries!r} is not allowed: must be a list")
    for i, entry in enumerate(entries):
        at = f"{where}: {field}[{i}]"
        opaque = entry.get("opaque") if isinstance(entry, dict) else None
        if not isinstance(opaque, dict) or opaque.get("driver") != DRIVER:
            continue
        names = entry.get("requests") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise DraClaimError(f"{at}.requests {names!r} is not allowed: must be a list of request names")
        try:
            settings = read_share_settings(opaque.get("parameters"))
        except DraClaimError as exc:
            raise DraClaimError(f"{at}.opaque.parameters: {exc}") from None
        for r in wanted:
            if _config_applies(names, r):
                out[r] = settings
    return out
