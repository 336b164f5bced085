"""What a pod's GPU requests weigh against ``gpu.qgpu.io/core`` and ``gpu.qgpu.io/memory``.

Upstream quota counts each extended resource by its own name, so a namespace capped on
``requests.tke.cloud.tencent.com/qgpu-core`` can still take cards as ``tencent.com/vcuda-core`` or
``nvidia.com/gpu``. The two qgpu quota names (webhook/claimquota.py) are one currency for every
dialect: a pod is charged what the request model reads from it (model/requests.py), in the units
of the claims, so a namespace's pods and ResourceClaims draw on the same quota.

Per container: a share is charged its core (thousandths of a card) and memory (MiB) times its
cards; whole cards (qGPU/vcuda multiples of 100, ``tensorstack.dev/nvidia-gpu``,
``nvidia.com/gpu``) a thousand and ``default_memory_mib`` each, since a card's memory is not known
before placement (as a claim naming no memory is charged); a T9k percent share that percent of
``default_memory_mib``; the whole node (``tensorstack.dev/nvidia-gpu-node``) the most cards a node
may have. Init containers may not ask for GPUs (the parser refuses them), so a pod's charge is the
sum over its containers.

In a namespace whose GPU pods become DRA claims (label ``qgpu.io/gpu-mode=dra``), the webhook
removes every dialect's resources from the pod except ``nvidia.com/gpu``, which kube-scheduler turns
into a claim it creates itself; that claim is charged as a claim, so the pod is not charged for it
unless it kept its resources for a device plugin (annotation ``qgpu.io/gpu-mode: device-plugin``).
Pure: dicts in, a :class:`Usage` out.
"""

from __future__ import annotations

from typing import Any, Final, Iterable, Mapping

from qgpu_runtime.contract.names import GPU_MODE, GPU_MODE_DEVICE_PLUGIN
from qgpu_runtime.model.requests import (
    CORE_MILLI_PER_CARD,
    DEFAULT_LIMITS,
    GPU_RESOURCES,
    QGPU_PREFIX,
    CardLimits,
    ContainerRequest,
    Dialect,
    RequestError,
    parse_pod,
)
from qgpu_runtime.webhook.claimquota import Usage

POD_KEY_PREFIX: Final = "pod:"
"""Ledger keys of pods; ``:`` is in no object name, so a pod's key never meets a claim's."""
TERMINAL_PHASES: Final = ("Succeeded", "Failed")
"""A pod in one of these phases holds no card: it counts nothing, as upstream quota does."""


def pod_key(name: str) -> str:
    return POD_KEY_PREFIX + name


def _container_charge(c: ContainerRequest, default_memory_mib: int, limits: CardLimits) -> Usage:
    if c.whole_node:
        return Usage(limits.max_cards_per_node * CORE_MILLI_PER_CARD, limits.max_cards_per_node * default_memory_mib)
    if c.exclusive:
        return Usage(c.cards * CORE_MILLI_PER_CARD, c.cards * default_memory_mib)
    memory = -(-default_memory_mib * c.memory_pct // 100) if c.memory_pct is not None else c.memory_mib
    return Usage(c.cards * c.core_milli, c.cards * memory)


def _asks_gpu(container: Mapping[str, Any]) -> bool:
    resources = container.get("resources") if isinstance(container.get("resources"), Mapping) else {}
    names: set[str] = set()
    for side in ("limits", "requests"):
        if isinstance(resources.get(side), Mapping):
            names |= set(resources[side])
    return any(k in GPU_RESOURCES or k.startswith(QGPU_PREFIX) for k in names)


def pod_usage(pod: Mapping[str, Any], *, dra_namespace: bool = False, default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib,
              limits: CardLimits = DEFAULT_LIMITS) -> Usage:
    """What ``pod`` is charged (nothing for a finished pod). A pod the parser refuses (admitted
    under other limits, or before the webhook ran) is charged a whole card per container naming a
    GPU resource, so a malformed pod cannot hide usage."""
    status = pod.get("status") if isinstance(pod.get("status"), Mapping) else {}
    if status.get("phase") in TERMINAL_PHASES:
        return Usage()
    meta = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
    annotations = meta.get("annotations") if isinstance(meta.get("annotations"), Mapping) else {}
    claims_nvidia = dra_namespace and annotations.get(GPU_MODE) != GPU_MODE_DEVICE_PLUGIN
    try:
        request = parse_pod(pod, limits)
    except RequestError:
        spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
        n = sum(1 for c in spec.get("containers") or [] if isinstance(c, Mapping) and _asks_gpu(c))
        return Usage(n * CORE_MILLI_PER_CARD, n * default_memory_mib)
    total = Usage()
    for container in request.containers:
        if claims_nvidia and container.dialect is Dialect.NVIDIA:
            continue  # kube-scheduler's extended-resource claim carries it, and is charged as a claim
        total += _container_charge(container, default_memory_mib, limits)
    return total


def pods_usage(pods: Iterable[Mapping[str, Any]], namespace: str, *, skip: str | None = None, dra_namespace: bool = False,
               default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib, limits: CardLimits = DEFAULT_LIMITS) -> Usage:
    """The charge of the listed ``pods`` of ``namespace`` (others skipped, and the pod named ``skip``:
    the one being admitted)."""
    total = Usage()
    for pod in pods:
        meta = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
        if meta.get("namespace", namespace) != namespace or (skip is not None and meta.get("name") == skip):
            continue
        total += pod_usage(pod, dra_namespace=dra_namespace, default_memory_mib=default_memory_mib, limits=limits)
    return total
