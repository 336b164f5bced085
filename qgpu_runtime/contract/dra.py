"""The DRA vocabulary: qgpu's driver, device and capacity names, the slice devices it publishes and
the decoder of what kube-scheduler allocated (resource.k8s.io/v1, consumable capacity).

Producers and consumers, all of them qgpu:
- the node manager publishes one ResourceSlice pool per node with one device per card
  (``slice_device``);
- the roles render the DeviceClasses whose CEL selectors name ``DRIVER`` and the attributes below;
- the webhook writes claims whose ``capacity.requests`` use ``CORE``/``MEMORY``;
- the kubelet plugin reads the claim's allocation (``claim_shares``) and books it in the node store.

Units are qgpu's own, so that a claim reads like the allocation record: ``core`` in thousandths of
a card, ``memory`` in MiB (plain integers, not byte quantities), ``pods`` one per allocation so a
card holds at most ``CardLimits.shared_pods_per_card`` claims. The ``requestPolicy`` of each
capacity encodes the rules of model/requests.py: core in steps of 10 (one percent), memory in whole
GiB with a 1 GiB minimum; a claim that names no capacity consumes the defaults, which are the whole
card. Pure functions over dicts (the API's JSON), like the other codecs of this room.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final, Iterable, Protocol

from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, DEFAULT_LIMITS, MIB_PER_GIB, CardLimits

API_VERSION: Final = "resource.k8s.io/v1"
DRIVER: Final = "gpu.qgpu.io"
"""The driver name: ResourceSlices, DeviceClass selectors, claim results and CDI vendor."""
SHARED_CLASS: Final = "shared.gpu.qgpu.io"
"""DeviceClass of a share of one card (claims ask ``capacity.requests``)."""
WHOLE_CLASS: Final = "whole.gpu.qgpu.io"
"""DeviceClass of whole cards (claims ask no capacity: the defaults are the whole card)."""

CORE: Final = "core"
MEMORY: Final = "memory"
PODS: Final = "pods"
CORE_STEP: Final = 10
"""One percent of a card, the finest step every dialect can express."""

# Device attributes (qualified by the driver name in CEL: device.attributes["gpu.qgpu.io"].model)
ATTR_INDEX: Final = "index"
ATTR_UUID: Final = "uuid"
ATTR_MODEL: Final = "model"
ATTR_MEMORY_MIB: Final = "memoryMiB"
ATTR_POLICY: Final = "isolationPolicy"

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


def device_class_selector(shared: bool) -> str:
    """The CEL selector of qgpu's DeviceClasses: this driver's cards, shareable ones for shares."""
    base = f'device.driver == "{DRIVER}"'
    return f"{base} && device.allowMultipleAllocations == true" if shared else base


def device_classes(whole_extended_resource: str | None = "nvidia.com/gpu") -> list[dict[str, Any]]:
    """The two DeviceClasses (API objects) the roles render and the tests apply.

    The whole-card class maps ``whole_extended_resource`` (KEP-5004), so an unchanged pod asking
    ``nvidia.com/gpu: N`` gets N whole cards through DRA on nodes without a device plugin for it.
    """
    whole_spec: dict[str, Any] = {"selectors": [{"cel": {"expression": device_class_selector(False)}}]}
    if whole_extended_resource:
        whole_spec["extendedResourceName"] = whole_extended_resource
    return [
        {"apiVersion": API_VERSION, "kind": "DeviceClass", "metadata": {"name": SHARED_CLASS},
         "spec": {"selectors": [{"cel": {"expression": device_class_selector(True)}}]}},
        {"apiVersion": API_VERSION, "kind": "DeviceClass", "metadata": {"name": WHOLE_CLASS}, "spec": whole_spec},
    ]


# ---- the node's ResourceSlice (node/draslices.py writes it; kube-scheduler reads it) -------------
UNHEALTHY_TAINT: Final = f"{DRIVER}/unhealthy"
"""Device taint (effect NoSchedule) on a card that raised a fatal error: kube-scheduler allocates it
to no new claim, claims already allocated keep it, as kubelet does with an unhealthy device-plugin
device. Its value is the reason, cut to a label value."""
SLICE_CONTENT: Final = f"{DRIVER}/content"
"""Annotation on the slice: a digest of the spec qgpu wrote, so an unchanged node writes nothing
(the apiserver rewrites quantities, e.g. ``1000`` reads back as ``1k``, so specs are not compared)."""


# --- what the webhook writes into claims and the kubelet plugin reads back ----------------------
CONFIG_API_VERSION: Final = "gpu.qgpu.io/v1alpha1"
CONFIG_KIND: Final = "ShareConfig"
"""The opaque configuration of a claim's requests (``config[].opaque.parameters``): what the
scheduler need not know but the node must, i.e. qGPU's co-location class and whether the share's
core may be exceeded when the card is idle (``qgpu-core-greedy``)."""


def share_config(app_class: str, greedy: bool) -> dict[str, Any]:
    """The opaque parameters of a share: ``app_class`` online, offline or normal."""
    if app_class not in ("online", "offline", "normal"):
        raise ValueError(f"appClass {app_class!r} is not allowed: must be online, offline or normal")
    return {"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "appClass": app_class, "greedy": bool(greedy)}


def read_share_config(parameters: Any) -> tuple[str, bool]:
    """(appClass, greedy) of opaque parameters written by :func:`share_config`; DraClaimError otherwise."""
    if not isinstance(parameters, dict) or parameters.get("apiVersion") != CONFIG_API_VERSION or parameters.get("kind") != CONFIG_KIND:
        raise DraClaimError(f"opaque parameters {parameters!r} are not allowed: expected apiVersion {CONFIG_API_VERSION}, kind {CONFIG_KIND}")
    app_class, greedy = parameters.get("appClass", "normal"), parameters.get("greedy", False)
    if app_class not in ("online", "offline", "normal") or not isinstance(greedy, bool):
        raise DraClaimError(f"opaque parameters {parameters!r} are not allowed: appClass online|offline|normal, greedy a boolean")
    return app_class, greedy


@dataclass(frozen=True)
class ShareSettings:
    """What a claim's opaque config says of one request: its co-location class and greedy flag.

    Greedy carries nothing beyond the class on the node: an offline pod's ``qgpu-core-greedy`` is
    its ``core`` share, as in the device-plugin path (the record holds the core and the class)."""

    app_class: str = "normal"
    greedy: bool = False


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
    meta = claim.get("metadata") or {}
    where = f"ResourceClaim {meta.get('namespace', '?')}/{meta.get('name', '?')}"
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
            app_class, greedy = read_share_config(opaque.get("parameters"))
        except DraClaimError as exc:
            raise DraClaimError(f"{at}.opaque.parameters: {exc}") from None
        for r in wanted:
            if _config_applies(names, r):
                out[r] = ShareSettings(app_class, greedy)
    return out


def _cel_string(text: str) -> str:
    # JSON's string escapes (\\, \", \uXXXX) are CEL's too.
    return json.dumps(str(text))


def model_selector(models: Iterable[str]) -> str:
    """CEL selecting cards whose model is one of ``models`` (exact names, as the extender compares)."""
    names = ", ".join(_cel_string(m) for m in sorted(set(models)))
    return f'device.attributes["{DRIVER}"].{ATTR_MODEL} in [{names}]'


def memory_selector(memory_mib: int) -> str:
    """CEL selecting cards of exactly ``memory_mib`` MiB (as published in ``memoryMiB``)."""
    return f'device.attributes["{DRIVER}"].{ATTR_MEMORY_MIB} == {int(memory_mib)}'
