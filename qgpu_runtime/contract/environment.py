"""The container environment: what either door hands a container, and what the isolation engine reads.

Both doors build it here, from the cards granted and how the container asked: the device plugin
(Allocate, node/deviceplugin/response.py) and the DRA kubelet plugin (NodePrepareResources, the
CDI spec of node/dra/cdi.py). The variables (docs/node-manager.md, "Container environment"):

- ``NVIDIA_VISIBLE_DEVICES``: card UUIDs, comma-separated, in the grant's order.
- ``QGPU_CORE_MILLI`` / ``QGPU_MEMORY_MIB``: per card, comma-separated in the same order.
- ``QGPU_CLASS``: online, offline or normal. ``QGPU_POLICY``: the node's isolation policy.
- ``T9K_GPU_*`` for a T9k container: the mode (``xgn`` whole cards, ``sgn`` percent, ``node`` the
  whole node), the card count, and for percent requests the percent and MiB per card.
- For a HAMi container, the limits HAMi's images read: ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` (``<MiB>m``,
  i the card's position in ``NVIDIA_VISIBLE_DEVICES``) and ``CUDA_DEVICE_SM_LIMIT`` (percent, 0: none).
- For a KAI-Scheduler container asking ``gpu-fraction``, ``GPU_PORTION``: that fraction.

And ``quota.json`` (``quota_document``, ``quota_json``), the device plugin's per-container file for
the isolation engine. Pure: no I/O, the caller writes what it returns.

Beside the environment, each granted card is named by a mount (``device_list_mounts``): where the
nvidia_container_toolkit role set the toolkit to believe ``NVIDIA_VISIBLE_DEVICES`` only from
privileged containers, those mounts are what gives the container its cards (docs/security.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from qgpu_runtime.contract.record import CardShare, ContainerDialect
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, Dialect

NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
QGPU_CORE_MILLI = "QGPU_CORE_MILLI"
QGPU_MEMORY_MIB = "QGPU_MEMORY_MIB"
QGPU_CLASS = "QGPU_CLASS"
QGPU_POLICY = "QGPU_POLICY"
T9K_GPU_MODE = "T9K_GPU_MODE"
T9K_GPU_COUNT = "T9K_GPU_COUNT"
T9K_GPU_PERCENT = "T9K_GPU_PERCENT"
T9K_GPU_MEMORY = "T9K_GPU_MEMORY"
CUDA_DEVICE_MEMORY_LIMIT = "CUDA_DEVICE_MEMORY_LIMIT"  # HAMi: _<i> per visible card, "<MiB>m"
CUDA_DEVICE_SM_LIMIT = "CUDA_DEVICE_SM_LIMIT"  # HAMi: percent of each card's compute
GPU_PORTION = "GPU_PORTION"  # KAI-Scheduler / Run:ai: the fraction of each card asked

XGN, SGN, NODE = "xgn", "sgn", "node"

# The driver's device nodes a container given any card also gets (with each card's /dev/nvidiaN),
# through the device plugin's DeviceSpecs or a DRA claim's CDI spec alike.
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")

# The NVIDIA toolkit's device list as mounts (its accept-nvidia-visible-devices-as-volume-mounts):
# the source /dev/null mounted at <root>/<card UUID> names that card. A pod spec cannot put one
# there without a hostPath volume; qgpu's Allocate answer and CDI spec do, one per granted card.
DEVICE_LIST_MOUNT_ROOT = "/var/run/nvidia-container-devices"
DEVICE_LIST_MOUNT_SOURCE = "/dev/null"


@dataclass(frozen=True)
class T9kMode:
    """Which T9k mode a container's variables announce; ``percent`` only for ``sgn``."""

    mode: str
    percent: int | None = None

    @classmethod
    def of_dialect(cls, asked: ContainerDialect | None) -> T9kMode | None:
        """The mode of a record's container (None: it did not ask in the T9k dialect)."""
        if asked is None or asked.dialect != Dialect.T9K.value:
            return None
        if asked.whole_node:
            return cls(NODE)
        if asked.memory_pct is not None:
            return cls(SGN, asked.memory_pct)
        return cls(XGN)

    @classmethod
    def of_shares(cls, shares: Sequence[CardShare], card_memory_mib: Mapping[int, int]) -> T9kMode | None:
        """The mode for shares that come without a T9k request (a DRA claim): all cards at full
        core read as ``xgn``, anything less as ``sgn`` with the memory percent of the first card, so
        a T9k image finds the same names whichever door its cards came through."""
        if not shares:
            return None
        if all(s.core_milli >= CORE_MILLI_PER_CARD for s in shares):
            return cls(XGN)
        first = shares[0]
        return cls(SGN, max(1, min(100, round(100 * first.memory_mib / card_memory_mib[first.index]))))


def card_envs(shares: Sequence[CardShare], klass: str, policy: str) -> dict[str, str]:
    """The variables the isolation engine and the container read: cards and shares in one order."""
    return {
        NVIDIA_VISIBLE_DEVICES: ",".join(s.uuid for s in shares),
        QGPU_CORE_MILLI: ",".join(str(s.core_milli) for s in shares),
        QGPU_MEMORY_MIB: ",".join(str(s.memory_mib) for s in shares),
        QGPU_CLASS: klass,
        QGPU_POLICY: policy,
    }


def device_list_mounts(uuids: Sequence[str]) -> tuple[str, ...]:
    """The container paths that name these cards to the toolkit, in the grant's order (the
    source of each is ``DEVICE_LIST_MOUNT_SOURCE``)."""
    return tuple(f"{DEVICE_LIST_MOUNT_ROOT}/{uuid}" for uuid in uuids)


def t9k_envs(t9k: T9kMode | None, shares: Sequence[CardShare]) -> dict[str, str]:
    """The T9k variables, none without a mode. Every mode gets the same names, so a T9k image
    reads its mode and cards without guessing the request: ``T9K_GPU_MODE``, ``T9K_GPU_COUNT``
    (cards granted) and for sgn ``T9K_GPU_PERCENT`` and ``T9K_GPU_MEMORY`` (MiB per card)."""
    if t9k is None:
        return {}
    envs = {T9K_GPU_MODE: t9k.mode, T9K_GPU_COUNT: str(len(shares))}
    if t9k.mode == SGN:
        envs[T9K_GPU_PERCENT] = str(t9k.percent)
        envs[T9K_GPU_MEMORY] = ",".join(str(s.memory_mib) for s in shares)
    return envs


def peer_envs(asked: ContainerDialect | None, shares: Sequence[CardShare]) -> dict[str, str]:
    """The variables of the peer whose dialect the container spoke, where they mean something here
    (HAMi's limits, KAI's portion); none for other dialects or without the record's dialect."""
    if asked is None or not shares:
        return {}
    if asked.dialect == Dialect.HAMI.value:
        envs = {f"{CUDA_DEVICE_MEMORY_LIMIT}_{i}": f"{s.memory_mib}m" for i, s in enumerate(shares)}
        envs[CUDA_DEVICE_SM_LIMIT] = str(shares[0].core_milli * 100 // CORE_MILLI_PER_CARD)
        return envs
    if asked.dialect == Dialect.KAI.value and asked.memory_pct is not None:
        return {GPU_PORTION: f"{asked.memory_pct / 100:g}"}
    return {}


def container_environment(shares: Sequence[CardShare], klass: str, policy: str, t9k: T9kMode | None,
                          asked: ContainerDialect | None = None) -> dict[str, str]:
    """The whole environment of one container (device plugin) or one claim (DRA); ``asked``: the
    record's dialect of the container, for the peers' own variables."""
    return {**card_envs(shares, klass, policy), **t9k_envs(t9k, shares), **peer_envs(asked, shares)}


def quota_document(pod: str, pod_uid: str, container: str, klass: str, policy: str,
                   shares: Sequence[CardShare]) -> dict[str, Any]:
    """``quota.json``'s content for one container (``pod`` is namespace/name)."""
    return {
        "pod": pod, "pod_uid": pod_uid, "container": container, "class": klass, "policy": policy,
        "cards": [{"index": s.index, "uuid": s.uuid, "core_milli": s.core_milli, "memory_mib": s.memory_mib}
                  for s in shares],
    }


def quota_json(quota: Mapping[str, Any]) -> str:
    return json.dumps(quota, indent=2, sort_keys=True) + "\n"
