"""What a pod's GPU requests weigh against ``gpu.qgpu.io/core`` and ``gpu.qgpu.io/memory``.

Upstream quota counts each extended resource by its own name, so a namespace capped on
``requests.tke.cloud.tencent.com/qgpu-core`` can still take cards as ``tencent.com/vcuda-core`` or
``nvidia.com/gpu``. The two qgpu quota names (webhook/claimquota.py) are one currency for every
dialect: a pod is charged what the request model reads from it (model/requests.py), in the units
of the claims, so a namespace's pods and ResourceClaims draw on the same quota.

Per container: a share is charged its core (thousandths of a card) and memory (MiB) times its
cards, each at least the least share a card gives (``CORE_STEP`` core and ``min_shared_memory_mib``
MiB, what a claim's share consumes at least): every share holds one of its card's pod slots, so a
memory-only or 1 MiB share is neither free nor invisible to a core-only quota; whole cards
(qGPU/vcuda multiples of 100, ``tensorstack.dev/nvidia-gpu``, ``nvidia.com/gpu``) a thousand and
``default_memory_mib`` each, since a card's memory is not known before placement (as a claim
naming no memory is charged); a T9k percent share that percent of ``default_memory_mib``; the
whole node (``tensorstack.dev/nvidia-gpu-node``) the most cards a node may have. Init containers
may not ask for GPUs (the parser refuses them), so a pod's charge is the sum over its containers.

In a namespace whose GPU pods become DRA claims (label ``qgpu.io/gpu-mode=dra``), the webhook
removes every dialect's resources from the pod except ``nvidia.com/gpu``, which kube-scheduler turns
into a claim it creates itself; that claim is charged as a claim, so the pod is not charged for it
unless it kept its resources for a device plugin (annotation ``qgpu.io/gpu-mode: device-plugin``).
KAI's share is read from annotations, which stay: a KAI container that /mutate-dra gave a claim
and left no GPU resource is charged nothing as a pod either (its claim is charged).
kube-scheduler makes that claim only on a node not advertising ``nvidia.com/gpu``, so /mutate-dra
pins such a pod to DRA pools (webhook/dra.py).

Each admission charges the namespace's existing pods from what they carry now, and a pod's owner may
update its annotations. So the annotations a charge is read from (:data:`CHARGE_ANNOTATIONS`) are
fixed after CREATE by the qgpu_scheduler role's admission policy ``qgpu-pod-request-annotations``;
and a pod the parser refuses (admitted under other limits, before the webhook ran, or broken where
that policy is absent) is charged at least what any reading of its containers could be: a tenant
who breaks its own pod only over-charges itself.

A static pod's mirror (annotation ``kubernetes.io/config.mirror``) is charged nothing. Only a node
creates one (NodeRestriction), bound to itself, in any namespace: charged, a compromised node filled a
victim namespace's quota with them and its GPU pods were refused. Uncharged, it takes nothing from
anyone: it runs only on the node that made it, on cards that node's root holds anyway, and books
none (no record the extender signed: it is never scheduled). Anyone else's pod carrying the
annotation was created bound too (the apiserver requires ``spec.nodeName`` with it and refuses
adding it later), and no kubelet runs it; an owner reference to a Node proves nothing and counts
for nothing here.
Pure: dicts in, a :class:`Usage` out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final, Iterable, Mapping

from qgpu_runtime.contract.dra import CORE_STEP
from qgpu_runtime.contract.names import GPU_MODE, GPU_MODE_DEVICE_PLUGIN, POOL_MODE_DRA, POOL_MODE_LABEL, mirror_pod
from qgpu_runtime.model.quantity import QuantityError, parse_quantity
from qgpu_runtime.model.requests import (
    CORE_MILLI_PER_CARD,
    DEFAULT_LIMITS,
    EGPU_CORE,
    GPU_RESOURCES,
    KAI_SCHEDULER,
    NANO_CORE,
    NVIDIA_GPU,
    QGPU_CORE,
    QGPU_CORE_GREEDY,
    QGPU_PREFIX,
    REQUEST_ANNOTATIONS,
    T9K_GPU,
    T9K_GPU_NODE,
    VCUDA_CORE,
    CardLimits,
    ContainerRequest,
    Dialect,
    RequestError,
    asks_gpu_resource,
    parse_pod,
    percent_share_memory_mib,
)
from qgpu_runtime.webhook.claimquota import Usage

POD_KEY_PREFIX: Final = "pod:"
"""Ledger keys of pods; ``:`` is in no object name, so a pod's key never meets a claim's."""
TERMINAL_PHASES: Final = ("Succeeded", "Failed")
"""A pod in one of these phases holds no card: it counts nothing, as upstream quota does."""
CHARGE_ANNOTATIONS: Final = (*REQUEST_ANNOTATIONS, GPU_MODE)
"""The pod annotations a pod's charge is read from: the request parser's, and the DRA opt-out."""


def pod_key(name: str) -> str:
    return POD_KEY_PREFIX + name


def _container_charge(c: ContainerRequest, default_memory_mib: int, limits: CardLimits) -> Usage:
    if c.whole_node:
        return Usage(limits.max_cards_per_node * CORE_MILLI_PER_CARD, limits.max_cards_per_node * default_memory_mib)
    if c.exclusive:
        return Usage(c.cards * CORE_MILLI_PER_CARD, c.cards * default_memory_mib)
    memory = percent_share_memory_mib(default_memory_mib, c.memory_pct) if c.memory_pct is not None else c.memory_mib
    # At least the least share a card gives (as a claim is charged what the allocator consumes):
    # a share holds one of its card's pod slots however little it names, so a memory-only or 1 MiB
    # share (HAMi, KAI, T9k percent) is not nearly free, and a core-only quota still counts it.
    core = max(c.core_milli, CORE_STEP)
    memory = max(memory, limits.min_shared_memory_mib)
    return Usage(c.cards * core, c.cards * memory)


def _moved_onto_a_claim(container: Mapping[str, Any]) -> bool:
    """A container that uses a claim and asks no GPU resource: what /mutate-dra leaves of a KAI
    share (a container the webhook did not convert, as while it was down, keeps its charge)."""
    resources = container.get("resources") if isinstance(container.get("resources"), Mapping) else {}
    return bool(resources.get("claims")) and not asks_gpu_resource(container)


# Resources whose value counts a container's cards, and those counting percents of one card's
# compute (100 a card): what a pod the parser refuses still declares of its size.
_CARD_COUNTS = frozenset({NVIDIA_GPU, T9K_GPU})
_CORE_PERCENTS = frozenset({QGPU_CORE, QGPU_CORE_GREEDY, VCUDA_CORE, NANO_CORE, EGPU_CORE})


def _declared_cards(container: Mapping[str, Any], limits: CardLimits) -> int:
    """The cards a GPU-asking container's resources declare, read without the parser's rules (its
    resources are fixed once the pod exists): a card count, or percents of a card rounded up, and
    one card for anything else of ours. A value that is no positive number, or the whole node,
    counts every card a node may hold; never more than that, nor fewer than one."""
    resources = container.get("resources") if isinstance(container.get("resources"), Mapping) else {}
    declared: dict[str, Any] = {}
    for side in ("requests", "limits"):  # limits win, as the parser reads them
        if isinstance(resources.get(side), Mapping):
            declared.update(resources[side])
    cards = 1
    for name, value in declared.items():
        if not (name in GPU_RESOURCES or name.startswith(QGPU_PREFIX)):
            continue
        try:
            amount = parse_quantity(value)
        except QuantityError:
            return limits.max_cards_per_node
        if name == T9K_GPU_NODE or amount <= 0 or amount != amount.to_integral_value():
            return limits.max_cards_per_node
        if name in _CARD_COUNTS:
            cards = max(cards, min(int(amount), limits.max_cards_per_node))
        elif name in _CORE_PERCENTS:
            cards = max(cards, min(math.ceil(amount / 100), limits.max_cards_per_node))  # Decimal // truncates
    return cards


def refused_pod_charge(pod: Mapping[str, Any], default_memory_mib: int, limits: CardLimits) -> Usage:
    """The charge of a pod the parser refuses: at least what any reading of its containers could be.

    A container's resources are fixed once the pod exists, so each GPU-asking container is charged
    the cards they declare (:func:`_declared_cards`), each a whole card at the largest memory a
    card's share could be charged: an annotation that breaks the parse cannot lower it, and a pod
    admitted under other limits is not charged the whole node for one card. A pod naming
    KAI-Scheduler may take its share by annotation in any container, for as many cards as its
    annotation says: there every container counts every card a node may hold.
    """
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    containers = [c for c in spec.get("containers") or [] if isinstance(c, Mapping)]
    if spec.get("schedulerName") == KAI_SCHEDULER:
        cards = len(containers) * limits.max_cards_per_node
    else:
        cards = sum(_declared_cards(c, limits) for c in containers if asks_gpu_resource(c))
    return Usage(cards * CORE_MILLI_PER_CARD, cards * max(default_memory_mib, limits.max_card_memory_mib))


@dataclass(frozen=True)
class ClaimSeen:
    """A claim of the namespace as the quota check listed it: what it is charged, and the UID of
    its controlling owner (None: it has none)."""

    usage: Usage
    controller: str | None = None


def _less(a: Usage, b: Usage) -> Usage:
    """``a`` less ``b``, each part at least zero."""
    return Usage(max(0, a.core_milli - b.core_milli), max(0, a.memory_mib - b.memory_mib))


def _status_claim(pod: Mapping[str, Any], status: Mapping[str, Any], claims: Mapping[str, ClaimSeen] | None) -> Usage | None:
    """The charge of the claim a pod's ``status.extendedResourceClaimStatus`` names, when that
    claim was listed and this pod controls it (kube-scheduler makes it so); None otherwise.

    Status is written by more than kube-scheduler, so the name alone proves nothing: pointed at
    another claim, or at none, it took the pod's cards off its namespace's quota."""
    ext = status.get("extendedResourceClaimStatus")
    if not claims or not isinstance(ext, Mapping):
        return None
    meta = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
    seen = claims.get(str(ext.get("resourceClaimName") or ""))
    uid = meta.get("uid")
    if seen is None or not uid or seen.controller != str(uid):
        return None
    return seen.usage


def pod_usage(pod: Mapping[str, Any], *, dra_namespace: bool = False, default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib,
              limits: CardLimits = DEFAULT_LIMITS, claims: Mapping[str, ClaimSeen] | None = None) -> Usage:
    """What ``pod`` is charged (nothing for a finished pod or a mirror pod). A pod the parser refuses is charged
    :func:`refused_pod_charge`, so a malformed pod cannot hide usage. ``claims``: the namespace's
    claims by name, against which a pod's extended-resource claim status is checked (without
    them, that status lowers no charge)."""
    status = pod.get("status") if isinstance(pod.get("status"), Mapping) else {}
    if status.get("phase") in TERMINAL_PHASES or mirror_pod(pod):
        return Usage()
    meta = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
    annotations = meta.get("annotations") if isinstance(meta.get("annotations"), Mapping) else {}
    converted = dra_namespace and annotations.get(GPU_MODE) != GPU_MODE_DEVICE_PLUGIN
    try:
        request = parse_pod(pod, limits)
    except RequestError:
        return refused_pod_charge(pod, default_memory_mib, limits)
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    selector = spec.get("nodeSelector") if isinstance(spec.get("nodeSelector"), Mapping) else {}
    # Only a pod /mutate-dra pinned to DRA pools: there kube-scheduler's extended-resource claim
    # carries nvidia.com/gpu. A pod of the namespace from before its label runs on a device-plugin
    # node, which grants the cards with no claim: charged as a pod (uncharged, a namespace labelled
    # dra freed its running pods' quota for new ones).
    pinned = converted and selector.get(POOL_MODE_LABEL) == POOL_MODE_DRA
    # A pod kube-scheduler gave its extended-resource claim says so in its status (Kubernetes >=
    # 1.34): one admitted before /mutate-dra pinned pods. NodeRestriction keeps the pod's node from
    # changing that field, but whoever may write pods/status can, so it counts only for a listed
    # claim this pod controls, and only as far as that claim's own charge goes:
    # the pod's cards and the claim are charged the larger of the two, never less than the pod asks.
    credit = _status_claim(pod, status, claims) if converted and not pinned else None
    raw = {str(c.get("name") or ""): c for c in spec.get("containers") or [] if isinstance(c, Mapping)}
    total = Usage()
    nvidia = Usage()
    for container in request.containers:
        if container.dialect is Dialect.NVIDIA and (pinned or credit is not None):
            if not pinned:
                nvidia += _container_charge(container, default_memory_mib, limits)
            continue  # kube-scheduler's extended-resource claim carries it, and is charged as a claim
        if converted and container.dialect is Dialect.KAI and _moved_onto_a_claim(raw.get(container.name, {})):
            # /mutate-dra put KAI's annotated share on a claim (charged as a claim) and took the
            # container's nvidia.com/gpu away: without a GPU resource no device plugin grants it a
            # card, so the annotation alone holds nothing (charged here too, it counted twice)
            continue
        total += _container_charge(container, default_memory_mib, limits)
    if credit is not None:
        total += _less(nvidia, credit)
    return total


def pods_usage(pods: Iterable[Mapping[str, Any]], namespace: str, *, skip: str | None = None, dra_namespace: bool = False,
               default_memory_mib: int = DEFAULT_LIMITS.max_card_memory_mib, limits: CardLimits = DEFAULT_LIMITS,
               claims: Mapping[str, ClaimSeen] | None = None) -> Usage:
    """The charge of the listed ``pods`` of ``namespace`` (others skipped, and the pod named ``skip``:
    the one being admitted); ``claims`` as :func:`pod_usage` takes them."""
    total = Usage()
    for pod in pods:
        meta = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
        if meta.get("namespace", namespace) != namespace or (skip is not None and meta.get("name") == skip):
            continue
        total += pod_usage(pod, dra_namespace=dra_namespace, default_memory_mib=default_memory_mib, limits=limits,
                           claims=claims)
    return total
