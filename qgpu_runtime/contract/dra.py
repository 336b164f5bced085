"""The DRA vocabulary and the ResourceSlice, both directions: qgpu's driver, class, device and
capacity names, the one rule its capacities are read by, the slice devices the node publishes and
their decoder (resource.k8s.io/v1, consumable capacity).

Producers and consumers, all of them qgpu:
- the node manager publishes one ResourceSlice pool per node with one device per card
  (``slice_device``, node/draslices.py); the extender's DRA view reads them back (``read_slice``);
- the roles render the DeviceClasses whose CEL selectors name ``DRIVER`` and the attributes below;
- the webhook writes claims whose ``capacity.requests`` use ``CORE``/``MEMORY``; every reader of a
  claim decodes it with contract/draclaim.py.

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

from qgpu_runtime.contract.inventory import MAX_ID_CHARS, MAX_INDEX, MAX_MEMORY_MIB
from qgpu_runtime.model.quantity import QUANTITY_LIMIT, QuantityError, parse_quantity
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, DEFAULT_LIMITS, MIB_PER_GIB, CardLimits

API_VERSION: Final = "resource.k8s.io/v1"
DRIVER: Final = "gpu.qgpu.io"
"""The driver name: ResourceSlices, DeviceClass selectors, claim results and CDI vendor."""
SHARED_CLASS: Final = "shared.gpu.qgpu.io"
"""DeviceClass of a share of one card (claims ask ``capacity.requests``)."""
WHOLE_CLASS: Final = "whole.gpu.qgpu.io"
"""DeviceClass of whole cards (claims ask no capacity: the defaults are the whole card)."""
QGPU_CLASSES: Final = frozenset({SHARED_CLASS, WHOLE_CLASS})

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
_SHOWN = 40
CAPACITY_RULE: Final = ("must be a non-negative whole number in qgpu's units (core in thousandths of a card, memory in MiB): "
                        "4000 or 4k, no fraction, sign or binary suffix (Ki, Mi, Gi)")


def shown(value: Any) -> str:
    """``value`` for a message, cut to a readable length (a megabyte of digits must not come back)."""
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def capacity_number(where: str, value: Any, error: type[ValueError] = ValueError) -> int:
    """A capacity in qgpu's units, as a claim, a slice or kube-scheduler's allocation carries it:
    the one rule every reader of a DRA object applies (raises ``error`` naming ``where``, the value
    and :data:`CAPACITY_RULE`).

    kube-apiserver serves quantities in canonical form (``"1000"`` comes back ``"1k"``), so decimal
    suffixes and exponents are read, with model/quantity.py's bounded parser (at most 2^63-1); a
    JSON integer counts like its text. Binary suffixes are refused: ``64Gi`` of a quantity counted
    in MiB is a mistake, not an amount."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise error(f"{where}={shown(value)}: {CAPACITY_RULE}")
    if isinstance(value, str) and value.endswith("i"):
        raise error(f"{where}={shown(value)}: {CAPACITY_RULE}")
    try:
        number = parse_quantity(str(value)) if isinstance(value, str) else None
    except QuantityError as exc:
        raise error(f"{where}={shown(value)}: {CAPACITY_RULE} ({exc.rule})") from None
    if number is None:  # a JSON integer
        if not 0 <= value <= QUANTITY_LIMIT:
            raise error(f"{where}={shown(value)}: {CAPACITY_RULE}")
        return value
    if number < 0 or number != number.to_integral_value():
        raise error(f"{where}={shown(value)}: {CAPACITY_RULE}")
    return int(number)


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


def consumed_core(requested: int) -> int:
    """The ``core`` the allocator consumes for a request of ``requested``, by the slice's
    requestPolicy (:func:`slice_device`): rounded up to a step, within one step and a whole card."""
    return min(CORE_MILLI_PER_CARD, max(CORE_STEP, -(-requested // CORE_STEP) * CORE_STEP))


def consumed_memory(requested_mib: int, limits: CardLimits = DEFAULT_LIMITS) -> int:
    """The ``memory`` the allocator consumes for a request of ``requested_mib``, by the slice's
    requestPolicy (:func:`slice_device`): the shared minimum plus whole GiB steps, rounded up."""
    low = limits.min_shared_memory_mib
    return max(low, low + -(-(requested_mib - low) // MIB_PER_GIB) * MIB_PER_GIB)


# ---- the node's ResourceSlice (node/draslices.py writes it; kube-scheduler and the extender read it) ---
UNHEALTHY_TAINT: Final = f"{DRIVER}/unhealthy"
"""Device taint (effect NoSchedule) on a card that raised a fatal error: kube-scheduler allocates it
to no new claim, claims already allocated keep it, as kubelet does with an unhealthy device-plugin
device. Its value is the reason, cut to a label value."""
UNHEALTHY_EFFECTS: Final = ("NoSchedule", "NoExecute")  # of that taint; NoExecute: kube-controller-manager evicts
SLICE_CONTENT: Final = f"{DRIVER}/content"
"""Annotation on the slice: a digest of the spec qgpu wrote, so an unchanged node writes nothing
(the apiserver rewrites quantities, e.g. ``1000`` reads back as ``1k``, so specs are not compared)."""


@dataclass(frozen=True)
class SliceCard:
    """One device of a qgpu ResourceSlice, read back: the card it stands for. ``memory_mib`` is the
    device's ``memory`` capacity (what claims can consume: whole GiB), not the card's ``memoryMiB``."""

    device: str
    index: int
    uuid: str
    model: str
    memory_mib: int
    policy: str


@dataclass(frozen=True)
class SliceCards:
    """A qgpu ResourceSlice, read back: its node, its cards in the order the slice lists them (the
    allocator's first-fit order), and why each device that is not a card was left out."""

    node: str
    cards: tuple[SliceCard, ...]
    dropped: tuple[str, ...] = ()


def _attribute(attrs: Any, name: str, kind: str) -> Any:
    value = attrs.get(name) if isinstance(attrs, dict) else None
    return value.get(kind) if isinstance(value, dict) else None


def _slice_card(device: Any) -> SliceCard:
    """One device as a card; ValueError naming the field for one that is not a card qgpu published
    within the inventory's bounds (contract/inventory.py)."""
    if not isinstance(device, dict):
        raise ValueError(f"device {shown(device)}: must be an object")
    name = str(device.get("name"))
    attrs = device.get("attributes")
    index = _attribute(attrs, ATTR_INDEX, "int")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MAX_INDEX:
        raise ValueError(f"device {name!r}: attributes.{ATTR_INDEX}.int={shown(index)}: must be an integer 0..{MAX_INDEX}")
    capacity = device.get("capacity") if isinstance(device.get("capacity"), dict) else {}
    memory_value = capacity.get(MEMORY).get("value") if isinstance(capacity.get(MEMORY), dict) else None
    memory = capacity_number(f"device {name!r}: capacity.{MEMORY}.value", memory_value)
    if not 0 < memory <= MAX_MEMORY_MIB:
        raise ValueError(f"device {name!r}: capacity.{MEMORY}.value={shown(memory_value)}: must be 1..{MAX_MEMORY_MIB} MiB")
    return SliceCard(name, index, str(_attribute(attrs, ATTR_UUID, "string") or "")[:MAX_ID_CHARS],
                     str(_attribute(attrs, ATTR_MODEL, "string") or "")[:MAX_ID_CHARS],
                     memory, str(_attribute(attrs, ATTR_POLICY, "string") or "")[:MAX_ID_CHARS])


def read_slice(slice_: Any) -> SliceCards | None:
    """The cards of one of qgpu's ResourceSlices (:func:`slice_device` wrote its devices); None for
    another driver's slice, one without a node, or one whose pool is not its node's
    (:func:`pool_name`): claims allocated from a slice are placed by their results' pool, so a
    node publishing another node's pool name would have its allocations booked on that node.

    A slice is written by its node, so it is read as a node's inventory is: a device whose index or
    memory is missing or out of bounds is left out (``dropped`` says why), never the whole slice.
    Whether repeated indices or too many devices leave the node out is the reader's call."""
    spec = slice_.get("spec") if isinstance(slice_, dict) else None
    if not isinstance(spec, dict) or spec.get("driver") != DRIVER or not spec.get("nodeName"):
        return None
    pool = spec.get("pool")
    if not isinstance(pool, dict) or pool.get("name") != pool_name(str(spec["nodeName"])):
        return None
    cards: list[SliceCard] = []
    dropped: list[str] = []
    devices = spec.get("devices")
    for device in devices if isinstance(devices, list) else []:
        try:
            cards.append(_slice_card(device))
        except ValueError as exc:
            dropped.append(str(exc))
    return SliceCards(str(spec["nodeName"]), tuple(cards), tuple(dropped))


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


def _cel_string(text: str) -> str:
    # JSON's string escapes (\\, \", \uXXXX) are CEL's too.
    return json.dumps(str(text))


def model_selector(models: Iterable[str]) -> str:
    """CEL selecting cards whose model is one of ``models`` (exact names, as the extender compares)."""
    names = ", ".join(_cel_string(m) for m in sorted(set(models)))
    return f'device.attributes["{DRIVER}"].{ATTR_MODEL} in [{names}]'


def model_pattern_selector(use: Iterable[str], nouse: Iterable[str]) -> str:
    """CEL selecting cards whose model contains one of ``use`` (upper-case; any, when none) and
    none of ``nouse``, ignoring case: HAMi's use-gputype / nouse-gputype, as the extender compares."""
    model = f'device.attributes["{DRIVER}"].{ATTR_MODEL}.upperAscii()'
    parts = [f"({' || '.join(f'{model}.contains({_cel_string(p)})' for p in use)})"] if use else []
    parts.extend(f"!{model}.contains({_cel_string(p)})" for p in nouse)
    return " && ".join(parts)


def memory_selector(memory_mib: int) -> str:
    """CEL selecting cards of exactly ``memory_mib`` MiB (as published in ``memoryMiB``)."""
    return f'device.attributes["{DRIVER}"].{ATTR_MEMORY_MIB} == {int(memory_mib)}'
