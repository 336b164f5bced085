"""What HAMi (v2.10.0) reads from the cluster, written by qgpu's benchmark for fake nodes and pods.

HAMi's scheduler extender does not look at qgpu's ``qgpu.io/gpus`` annotation: its device plugin
registers each node's cards in node annotations, and pods ask in HAMi's resource names. The
benchmark has no kubelet and no device plugin, so it writes those annotations itself, for the same
cards the node carries in qgpu's annotation, and it translates each qgpu request into the HAMi
request that asks for the same share. The formats below were read from HAMi's sources
(``pkg/device/devices.go``: ``DeviceInfo``, ``MarshalNodeDevices``/``UnMarshalNodeDevices``,
``CheckHealth``; ``pkg/device/nvidia/device.go``: the annotation names, ``GenerateResourceRequests``,
``Fit``; ``pkg/device-plugin/.../register.go``: what the device plugin registers per card).

Pure functions over API dicts; nothing here talks to a cluster.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, DEFAULT_LIMITS, CardLimits, ContainerRequest, PodRequest
from qgpu_runtime.placement.state import CardSpec

# Node annotations (pkg/device/nvidia/device.go).
REGISTER_ANNOTATION = "hami.io/node-nvidia-register"
HANDSHAKE_ANNOTATION = "hami.io/node-handshake"
# Pod annotations HAMi's filter writes (pkg/util/types.go, pkg/device/nvidia/device.go).
ASSIGNED_NODE_ANNOTATION = "hami.io/vgpu-node"
ALLOCATED_ANNOTATION = "hami.io/vgpu-devices-allocated"
# Resource names of HAMi's default device configuration (pkg/scheduler/config/config.go).
GPU = "nvidia.com/gpu"
GPU_MEMORY = "nvidia.com/gpumem"
GPU_MEMORY_PERCENTAGE = "nvidia.com/gpumem-percentage"
GPU_CORES = "nvidia.com/gpucores"
HAMI_RESOURCES = (GPU, GPU_MEMORY, GPU_MEMORY_PERCENTAGE, GPU_CORES)
# The mode HAMi's device plugin registers for a card it shares with its CUDA interposer.
HAMI_CORE_MODE = "hami-core"
# HAMi's handshake timestamps use Go's time.DateTime layout in the scheduler's local time zone.
HANDSHAKE_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


class HamiTranslationError(ValueError):
    """A qgpu request has no HAMi equivalent; the message names the container, field, value and rule."""


@dataclass(frozen=True)
class HamiCard:
    """One card as HAMi's device plugin registers it (``device.DeviceInfo``)."""

    uuid: str
    index: int
    split_count: int
    memory_mib: int
    cores: int
    model: str
    numa: int = 0
    healthy: bool = True
    mode: str = HAMI_CORE_MODE


def device_type(model: str) -> str:
    """The card type HAMi registers: the NVML model name, prefixed ``NVIDIA-`` unless it starts with
    ``NVIDIA`` already (register.go does this so ``nvidia.com/use-gputype`` can match on it)."""
    return model if model.startswith("NVIDIA") else f"NVIDIA-{model}"


def hami_cards(cards: Sequence[CardSpec], limits: CardLimits = DEFAULT_LIMITS) -> list[HamiCard]:
    """The registration of qgpu's cards. The split count (how many containers may share one card)
    is set to qgpu's own per-card limit for that memory size, so both schedulers may put the same
    number of pods on a card; HAMi's default (``deviceSplitCount: 10``) would let it place more small
    pods than qgpu is allowed to, which is a configuration difference, not a packing one."""
    return [HamiCard(uuid=c.uuid, index=c.index, split_count=limits.shared_pods_per_card(c.memory_mib),
                     memory_mib=c.memory_mib, cores=100, model=device_type(c.model)) for c in cards]


def register_annotation(cards: Sequence[HamiCard]) -> str:
    """``hami.io/node-nvidia-register`` as HAMi's device plugin writes it: the JSON list of
    ``device.MarshalNodeDevices``. Go's ``omitempty`` drops zero values (index 0, numa 0, health
    false), and Go's encoder writes no spaces; both are mirrored so the bytes match."""
    out = []
    for card in cards:
        if card.split_count < 1 or card.memory_mib < 1 or card.cores < 1:
            raise HamiTranslationError(
                f"card {card.uuid}: split_count={card.split_count}, memory_mib={card.memory_mib}, cores={card.cores}: "
                "each must be >= 1 (HAMi skips a card with no capacity)")
        doc: dict[str, Any] = {"id": card.uuid}
        if card.index:
            doc["index"] = card.index
        doc["count"] = card.split_count
        doc["devmem"] = card.memory_mib
        doc["devcore"] = card.cores
        doc["type"] = card.model
        if card.numa:
            doc["numa"] = card.numa
        doc["mode"] = card.mode
        if card.healthy:
            doc["health"] = True
        out.append(doc)
    return json.dumps(out, separators=(",", ":"))


def handshake_annotation(now: datetime.datetime) -> str:
    """``hami.io/node-handshake`` as HAMi's scheduler leaves it on a live node: ``Requesting_`` and
    the time it last asked, in Go's ``time.DateTime`` layout and the scheduler's local zone. Within
    60 s of that time the node counts as healthy without any write; after it, a node still counts as
    healthy while it advertises ``nvidia.com/gpu`` in allocatable (``device.CheckHealth``)."""
    return "Requesting_" + now.strftime(HANDSHAKE_TIME_FORMAT)


def node_annotations(cards: Sequence[CardSpec], now: datetime.datetime, limits: CardLimits = DEFAULT_LIMITS) -> dict[str, str]:
    """Both node annotations HAMi reads, for qgpu's cards."""
    return {REGISTER_ANNOTATION: register_annotation(hami_cards(cards, limits)), HANDSHAKE_ANNOTATION: handshake_annotation(now)}


def node_allocatable(cards: Sequence[CardSpec], limits: CardLimits = DEFAULT_LIMITS) -> dict[str, str]:
    """What the kubelet reports for HAMi's device plugin: one ``nvidia.com/gpu`` per shareable slot
    (cards × split count). HAMi also reads it in its health check."""
    return {GPU: str(sum(card.split_count for card in hami_cards(cards, limits)))}


def container_resources(request: ContainerRequest) -> dict[str, str]:
    """HAMi's limits for the share one qgpu container request asks for.

    - shared (core below a card): one card, ``gpumem`` MiB and ``gpucores`` percent;
    - online (memory only, no core share): one card, ``gpumem`` MiB, no core reservation;
    - whole cards (exclusive): N cards at ``gpucores: 100`` (HAMi's "this card alone" value) and no
      ``gpumem``, which HAMi reads as 100 % of each card's memory;
    - a percent-of-memory request (T9k dialect): ``gpumem-percentage``.
    The whole-node form (T9k ``nvidia-gpu-node``) has no HAMi equivalent and is refused.
    """
    if request.whole_node:
        raise HamiTranslationError(
            f"container {request.name!r}: whole_node=True: HAMi has no whole-node request; ask for the cards by count")
    if request.cards < 1:
        raise HamiTranslationError(f"container {request.name!r}: cards={request.cards}: must be >= 1")
    if request.exclusive or request.core_milli >= CORE_MILLI_PER_CARD:
        return {GPU: str(request.cards), GPU_CORES: "100"}
    if request.core_milli % 10:
        raise HamiTranslationError(
            f"container {request.name!r}: core_milli={request.core_milli}: HAMi's gpucores are whole percent (multiples of 10 milli)")
    out = {GPU: str(request.cards)}
    if request.memory_pct is not None:
        out[GPU_MEMORY_PERCENTAGE] = str(request.memory_pct)
    elif request.memory_mib:
        out[GPU_MEMORY] = str(request.memory_mib)
    else:
        raise HamiTranslationError(
            f"container {request.name!r}: memory_mib=0: a shared card needs a memory amount, or HAMi reserves the whole card's memory")
    if request.core_milli:
        out[GPU_CORES] = str(request.core_milli // 10)
    return out


def translate_pod(pod: Mapping[str, Any], request: PodRequest) -> dict[str, Any]:
    """``pod`` with each GPU container's qgpu resources replaced by HAMi's for the same share
    (``request`` is ``parse_pod(pod)``). Other containers and fields are kept as they are."""
    by_name = {c.name: c for c in request.containers}
    doc = json.loads(json.dumps(dict(pod)))
    for container in doc.get("spec", {}).get("containers", []):
        wanted = by_name.get(str(container.get("name") or ""))
        if wanted is None:
            continue
        hami = container_resources(wanted)
        resources = container.setdefault("resources", {})
        for section in ("limits", "requests"):
            kept = {k: v for k, v in (resources.get(section) or {}).items() if not _is_gpu_resource(k)}
            if section == "limits":
                kept.update(hami)
            if kept:
                resources[section] = kept
            else:
                resources.pop(section, None)
    return doc


def _is_gpu_resource(name: str) -> bool:
    from qgpu_runtime.model.requests import GPU_RESOURCES, QGPU_PREFIX

    return name in GPU_RESOURCES or name.startswith(QGPU_PREFIX) or name in HAMI_RESOURCES


def allocated_cards(annotations: Mapping[str, str]) -> list[tuple[str, int, int]]:
    """(card uuid, memory MiB, cores %) of each card HAMi assigned a pod, from the
    ``hami.io/vgpu-devices-allocated`` annotation its filter writes (``EncodePodDevices``: containers
    separated by ``;``, cards by ``:``, fields ``uuid,type,memory,cores``)."""
    raw = annotations.get(ALLOCATED_ANNOTATION, "")
    out = []
    for container in raw.split(";"):
        for card in container.split(":"):
            if not card:
                continue
            fields = card.split(",")
            if len(fields) < 4:
                raise HamiTranslationError(f"annotation {ALLOCATED_ANNOTATION}={raw!r}: card entry {card!r} has fewer than 4 fields")
            out.append((fields[0], int(fields[2]), int(fields[3])))
    return out
