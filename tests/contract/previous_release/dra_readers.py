"""FROZEN COPY, for version-skew tests only: the DRA readers and the slice writer of the release
before issue 24 (commit 0ec0e40): contract/dra.py (``slice_device``, ``claim_shares``: the node's
kubelet plugin), extender/dra.py (``slice_cards``, ``claim_asks``, ``claim_usage``: the extender's
DRA view) and webhook/claimquota.py (``claim_usage``, renamed ``quota_usage``: the claim quota),
verbatim apart from this docstring, the imports and the renames marked below.
Never import this from qgpu_runtime; never "fix" it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final, Mapping, Protocol

from qgpu_runtime.contract.inventory import MAX_ID_CHARS, MAX_INDEX, MAX_MEMORY_MIB
from qgpu_runtime.model.quantity import QUANTITY_LIMIT, QuantityError, parse_quantity
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, DEFAULT_LIMITS, MIB_PER_GIB, CardLimits
from qgpu_runtime.placement.state import CardSpec

DRIVER: Final = "gpu.qgpu.io"
SHARED_CLASS: Final = "shared.gpu.qgpu.io"
WHOLE_CLASS: Final = "whole.gpu.qgpu.io"
CORE: Final = "core"
MEMORY: Final = "memory"
PODS: Final = "pods"
CORE_STEP: Final = 10
ATTR_INDEX: Final = "index"
ATTR_UUID: Final = "uuid"
ATTR_MODEL: Final = "model"
ATTR_MEMORY_MIB: Final = "memoryMiB"
ATTR_POLICY: Final = "isolationPolicy"

# ---- contract/dra.py ----------------------------------------------------------------------------
_DEVICE = re.compile(r"^gpu-(0|[1-9][0-9]{0,3})$")


class DraClaimError(ValueError):
    """A claim's allocation cannot be served; the message names the claim, field, value and rule."""


class _Card(Protocol):
    index: int
    uuid: str
    model: str
    memory_mib: int


def device_name(index: int) -> str:
    """The slice device of card ``index`` (a DNS label, as the API requires)."""
    return f"gpu-{int(index)}"


def card_index(device: str) -> int:
    """The card index a device name stands for; ValueError for a name qgpu never publishes."""
    m = _DEVICE.match(device or "")
    if not m:
        raise ValueError(f"device {device!r} is not a qgpu device: names are gpu-<card index>")
    return int(m.group(1))


def pool_name(node: str) -> str:
    """One pool per node, named after it (pools are compared by name, first-fit, in that order)."""
    return node


def slice_name(node: str) -> str:
    return f"{node}-{DRIVER}"

def slice_device(card: _Card, policy: str, limits: CardLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The ResourceSlice device of one card: shareable, with qgpu's rules as request policies."""
    memory = int(card.memory_mib)
    whole_gib = memory - memory % MIB_PER_GIB
    mem_max = max(whole_gib, limits.min_shared_memory_mib)
    pods = limits.shared_pods_per_card(memory)
    return {
        "name": device_name(card.index),
        "allowMultipleAllocations": True,
        "attributes": {
            ATTR_INDEX: {"int": int(card.index)},
            ATTR_UUID: {"string": str(card.uuid)},
            ATTR_MODEL: {"string": str(card.model)},
            ATTR_MEMORY_MIB: {"int": memory},
            ATTR_POLICY: {"string": str(policy)},
        },
        "capacity": {
            CORE: {"value": str(CORE_MILLI_PER_CARD), "requestPolicy": {
                "default": str(CORE_MILLI_PER_CARD),
                "validRange": {"min": str(CORE_STEP), "max": str(CORE_MILLI_PER_CARD), "step": str(CORE_STEP)}}},
            MEMORY: {"value": str(mem_max), "requestPolicy": {
                "default": str(mem_max),
                "validRange": {"min": str(limits.min_shared_memory_mib), "max": str(mem_max), "step": str(MIB_PER_GIB)}}},
            PODS: {"value": str(pods), "requestPolicy": {"default": "1", "validValues": ["1"]}},
        },
    }


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


_DECIMAL_SUFFIX: Final = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9}
_INT_QUANTITY: Final = re.compile(r"([0-9]{1,9})(k|M|G)?")


def capacity_integer(value: Any) -> int | None:
    """A capacity as qgpu writes it (a plain integer) or as the apiserver gives it back: it stores
    ``1000`` as ``1k`` (apimachinery's Quantity drops trailing zeros into a decimal suffix), so a
    whole card's ``core`` comes back from the API as ``1k``. None for anything else."""
    m = _INT_QUANTITY.fullmatch(str(value))
    return int(m.group(1)) * _DECIMAL_SUFFIX[m.group(2) or ""] if m else None


def consumed_core(requested: int) -> int:
    """The ``core`` the allocator consumes for a request of ``requested``, by the slice's
    requestPolicy (:func:`slice_device`): rounded up to a step, within one step and a whole card."""
    return min(CORE_MILLI_PER_CARD, max(CORE_STEP, -(-requested // CORE_STEP) * CORE_STEP))


def consumed_memory(requested_mib: int, limits: CardLimits = DEFAULT_LIMITS) -> int:
    """The ``memory`` the allocator consumes for a request of ``requested_mib``, by the slice's
    requestPolicy (:func:`slice_device`): the shared minimum plus whole GiB steps, rounded up."""
    low = limits.min_shared_memory_mib
    return max(low, low + -(-(requested_mib - low) // MIB_PER_GIB) * MIB_PER_GIB)


def _int_quantity(where: str, field: str, value: Any) -> int:
    number = capacity_integer(value)
    if number is None:
        raise DraClaimError(f"{where}: {field} {value!r} is not allowed: qgpu capacities are plain integers "
                            "(core in thousandths of a card, memory in MiB)")
    return number


def claim_shares(claim: dict[str, Any], node: str) -> list[ClaimShare]:
    """The qgpu results of ``claim``'s allocation on ``node``, validated; other drivers' are skipped.

    Raises DraClaimError for an unallocated claim, a result in another node's pool, a device name
    qgpu never published, or a consumed capacity that is missing, not an integer or out of range.
    """
    meta = claim.get("metadata") or {}
    where = f"ResourceClaim {meta.get('namespace', '?')}/{meta.get('name', '?')}"
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
        core = _int_quantity(at, f"consumedCapacity.{CORE}", consumed[CORE])
        memory = _int_quantity(at, f"consumedCapacity.{MEMORY}", consumed[MEMORY])
        if not CORE_STEP <= core <= CORE_MILLI_PER_CARD:
            raise DraClaimError(f"{at}.consumedCapacity.{CORE} {core} is not allowed: must be {CORE_STEP}..{CORE_MILLI_PER_CARD}")
        if memory < 1:
            raise DraClaimError(f"{at}.consumedCapacity.{MEMORY} {memory} is not allowed: must be >= 1 MiB")
        shares.append(ClaimShare(request=str(r.get("request") or ""), pool=pool, device=device, card_index=index,
                                 core_milli=core, memory_mib=memory, share_id=str(r.get("shareID") or "")))
    return shares


# ---- extender/dra.py --------------------------------------------------------------------------
QGPU_CLASSES = frozenset({SHARED_CLASS, WHOLE_CLASS})
MAX_ASKS = 64
"""Devices one pod may ask through qgpu's classes before the view stops scoring it (a bound on the
per-call work, far above any card count a node has)."""


@dataclass(frozen=True)
class Ask:
    """One device a claim asks: ``core`` thousandths and ``memory`` MiB, None for the device's
    default (the whole card's), as the allocator applies the slice's ``requestPolicy``."""

    core: int | None
    memory: int | None


@dataclass(frozen=True)
class Usage:
    """What one allocated claim consumes on one device."""

    node: str
    device: str
    core: int
    memory: int


class DemandError(ValueError):
    """A claim's request qgpu cannot read; the pod is scored 0 everywhere (no preference)."""


def _integer(field: str, value: Any, unit: str) -> int:
    number = capacity_integer(value)
    if number is None:
        raise DemandError(f"capacity {field} {value!r}: must be an integer ({unit})")
    return number


def _core(value: Any) -> int:
    return consumed_core(_integer(CORE, value, "thousandths of a card"))


def _memory(value: Any, limits: CardLimits) -> int:
    return consumed_memory(_integer(MEMORY, value, "MiB"), limits)


def claim_asks(spec: Mapping[str, Any], limits: CardLimits = DEFAULT_LIMITS) -> list[Ask]:
    """The devices a ResourceClaim spec asks of qgpu's classes (others' requests are skipped).

    ``exactly`` requests and the first qgpu subrequest of a ``firstAvailable`` list (the allocator
    tries that first). A request without capacity asks the defaults: the whole card.
    """
    asks: list[Ask] = []
    for request in ((spec.get("devices") or {}).get("requests") or []):
        exact = request.get("exactly")
        if exact is None:
            exact = next((s for s in request.get("firstAvailable") or [] if s.get("deviceClassName") in QGPU_CLASSES), None)
        if not exact or exact.get("deviceClassName") not in QGPU_CLASSES:
            continue
        if (exact.get("allocationMode") or "ExactCount") != "ExactCount":
            raise DemandError(f"request {request.get('name')!r}: allocationMode {exact.get('allocationMode')!r} is not scored")
        count = int(exact.get("count") or 1)
        wanted = (exact.get("capacity") or {}).get("requests") or {}
        core = _core(wanted[CORE]) if CORE in wanted else None
        memory = _memory(wanted[MEMORY], limits) if MEMORY in wanted else None
        asks.extend([Ask(core, memory)] * count)
        if len(asks) > MAX_ASKS:
            raise DemandError(f"more than {MAX_ASKS} devices asked")
    return asks


def slice_cards(slice_: Mapping[str, Any]) -> tuple[str, list[tuple[str, CardSpec]]] | None:
    """(node, [(device name, card)]) of one of qgpu's ResourceSlices; None for another driver's.
    A card's ``memory_mib`` is the slice's ``memory`` capacity (what claims can consume)."""
    spec = slice_.get("spec") or {}
    if spec.get("driver") != DRIVER or not spec.get("nodeName"):
        return None
    out = []
    for device in spec.get("devices") or []:
        attrs = device.get("attributes") or {}
        capacity = device.get("capacity") or {}
        try:
            index = int((attrs.get("index") or {}).get("int"))
            memory = int(str((capacity.get(MEMORY) or {}).get("value")))
        except (TypeError, ValueError):
            continue
        if not (0 <= index <= MAX_INDEX and 0 < memory <= MAX_MEMORY_MIB):
            continue  # out of the inventory's bounds: not a card (contract/inventory.py)
        out.append((str(device.get("name")), CardSpec(index, str((attrs.get("uuid") or {}).get("string") or "")[:MAX_ID_CHARS],
                                                       str((attrs.get("model") or {}).get("string") or "")[:MAX_ID_CHARS],
                                                       memory)))
    return str(spec["nodeName"]), out


def claim_usage(claim: Mapping[str, Any]) -> list[Usage]:
    """What an allocated claim consumes on qgpu's devices ([] when unallocated or not qgpu's);
    results that do not decode (contract.dra.claim_shares refuses them) count as nothing."""
    alloc = dict((claim.get("status") or {}).get("allocation") or {})
    devices = dict(alloc.get("devices") or {})
    results = devices.get("results") or []
    out: list[Usage] = []
    for pool in sorted({str(r.get("pool") or "") for r in results if r.get("driver") == DRIVER}):  # a pool is a node
        one_pool = {**devices, "results": [r for r in results if r.get("driver") == DRIVER and r.get("pool") == pool]}
        try:
            shares = claim_shares({**claim, "status": {"allocation": {**alloc, "devices": one_pool}}}, pool)
        except DraClaimError:
            continue
        out.extend(Usage(pool, s.device, s.core_milli, s.memory_mib) for s in shares)
    return out


# ---- webhook/claimquota.py (Usage renamed QuotaUsage, claim_usage renamed quota_usage) ---------
# A claim's allocation holds at most 32 devices (AllocationResultsMaxSize, pkg/apis/resource of
# v1.37): a larger count can never be allocated, so it is refused rather than charged.
CORE_QUOTA: Final = f"{DRIVER}/{CORE}"
_MAX_COUNT = 32
_SHOWN = 40


class ClaimQuotaError(ValueError):
    """The claim or a quota cannot be read; the message names the object, the field, the value and the rule."""


@dataclass(frozen=True)
class QuotaUsage:
    core_milli: int = 0
    memory_mib: int = 0

    def __add__(self, other: QuotaUsage) -> QuotaUsage:
        return QuotaUsage(self.core_milli + other.core_milli, self.memory_mib + other.memory_mib)

    def of(self, resource: str) -> int:
        return self.core_milli if resource == CORE_QUOTA else self.memory_mib


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def _whole_number(where: str, value: Any) -> int:
    """A non-negative whole number in qgpu's units, written as kube-apiserver serves quantities.

    The apiserver canonicalises what it stores: ``"1000"`` comes back as ``"1k"``, so decimal
    suffixes and exponents must be read (``model/quantity.py``, bounded work, at most 2^63-1).
    Binary suffixes are refused: ``64Gi`` of a quantity counted in MiB is a mistake, not a limit."""
    rule = ("must be a non-negative whole number in qgpu's units (core in thousandths of a card, memory in MiB): "
            "4000 or 4k, no fraction, sign or binary suffix (Ki, Mi, Gi)")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ClaimQuotaError(f"{where}={_shown(value)}: {rule}")
    if isinstance(value, str) and value.endswith("i"):
        raise ClaimQuotaError(f"{where}={_shown(value)}: {rule}")
    try:
        number = parse_quantity(str(value)) if isinstance(value, str) else None
    except QuantityError as exc:
        raise ClaimQuotaError(f"{where}={_shown(value)}: {rule} ({exc.rule})") from None
    if number is None:  # a JSON integer
        if not 0 <= value <= QUANTITY_LIMIT:
            raise ClaimQuotaError(f"{where}={_shown(value)}: {rule}")
        return value
    if number < 0 or number != number.to_integral_value():
        raise ClaimQuotaError(f"{where}={_shown(value)}: {rule}")
    return int(number)


def _name(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or meta.get("generateName") or "?")


def _request_usage(where: str, request: Mapping[str, Any], default_memory_mib: int) -> QuotaUsage:
    """What one device request of a qgpu class asks, all its devices together."""
    mode = request.get("allocationMode") or "ExactCount"
    if mode == "All":
        # Every matching card of the node (a T9k whole-node pod): how many is known only after
        # allocation, so the charge is the most a node may have, as the memory default is.
        count = DEFAULT_LIMITS.max_cards_per_node
    elif mode == "ExactCount":
        count = request.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= _MAX_COUNT:
            raise ClaimQuotaError(f"{where}.count={_shown(count)}: must be an integer 1..{_MAX_COUNT}")
    else:
        raise ClaimQuotaError(f"{where}.allocationMode={_shown(mode)}: must be ExactCount or All")
    capacity = request.get("capacity") or {}
    asked = capacity.get("requests") if isinstance(capacity, dict) else None
    if asked is None:
        asked = {}
    if not isinstance(capacity, dict) or not isinstance(asked, dict):
        raise ClaimQuotaError(f"{where}.capacity={_shown(capacity)}: must be an object with a 'requests' object")
    core = _whole_number(f"{where}.capacity.requests.{CORE}", asked[CORE]) if CORE in asked else CORE_MILLI_PER_CARD
    memory = _whole_number(f"{where}.capacity.requests.{MEMORY}", asked[MEMORY]) if MEMORY in asked else default_memory_mib
    return QuotaUsage(core * count, memory * count)


def quota_usage(claim: Mapping[str, Any], default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib) -> QuotaUsage:
    """GPU core and memory ``claim`` asks of qgpu's classes; requests of other classes count nothing.

    Raises ClaimQuotaError, naming the field, for a qgpu request that cannot be charged."""
    namespace, name = _name(claim)
    spec = claim.get("spec")
    devices = spec.get("devices") if isinstance(spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    if requests is None:
        return QuotaUsage()
    if not isinstance(requests, list):
        raise ClaimQuotaError(f"ResourceClaim {namespace}/{name}: spec.devices.requests={_shown(requests)}: must be a list")
    total = QuotaUsage()
    for i, request in enumerate(requests):
        where = f"ResourceClaim {namespace}/{name}: spec.devices.requests[{i}]"
        if not isinstance(request, dict):
            raise ClaimQuotaError(f"{where}={_shown(request)}: must be an object")
        if "firstAvailable" in request:
            alternatives = request["firstAvailable"]
            if not isinstance(alternatives, list):
                raise ClaimQuotaError(f"{where}.firstAvailable={_shown(alternatives)}: must be a list")
            charged = QuotaUsage()
            for j, sub in enumerate(alternatives):
                if isinstance(sub, dict) and sub.get("deviceClassName") in QGPU_CLASSES:
                    u = _request_usage(f"{where}.firstAvailable[{j}]", sub, default_memory_mib)
                    charged = QuotaUsage(max(charged.core_milli, u.core_milli), max(charged.memory_mib, u.memory_mib))
            total += charged
            continue
        exactly = request.get("exactly", request)  # resource.k8s.io/v1 nests it; v1beta1 did not
        if isinstance(exactly, dict) and exactly.get("deviceClassName") in QGPU_CLASSES:
            total += _request_usage(where + (".exactly" if "exactly" in request else ""), exactly, default_memory_mib)
    return total


