"""What a container gets back from Allocate: environment, mounts, device nodes, annotations.

Pure: built from the match, the cards and the node's settings. The variables are the contract
with the isolation engine (docs/node-manager.md, "Container environment"):

- ``NVIDIA_VISIBLE_DEVICES``: card UUIDs, comma-separated, in the record's order.
- ``QGPU_CORE_MILLI`` / ``QGPU_MEMORY_MIB``: per card, comma-separated in the same order.
- ``QGPU_CLASS``: online, offline or normal. ``QGPU_POLICY``: the node's isolation policy.
- ``T9K_GPU_*`` for every T9k request (:func:`t9k_envs`): the mode (``xgn`` whole cards, ``sgn``
  percent, ``node`` the whole node), the card count, and for percent requests the percent and MiB.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from qgpu_runtime.contract.record import CardShare
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model import requests as rq
from qgpu_runtime.node.matching import Match, container_quantity
from qgpu_runtime.node.store import Grant, Share

CONTAINER_CONFIG_DIR = "/etc/qgpu"
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str


@dataclass(frozen=True)
class ContainerGrant:
    envs: dict[str, str]
    mounts: tuple[Mount, ...]
    devices: tuple[DeviceNode, ...]
    annotations: dict[str, str]
    quota: dict  # written to <host dir>/quota.json for the isolation engine

    @property
    def config_host_dir(self) -> str:
        return self.mounts[0].host_path


class GrantError(ValueError):
    """The record names a card this node does not have; the message says which."""


def build_grant(m: Match, cards: dict[int, CardInfo], policy: str, state_dir: Path, pass_device_specs: bool) -> ContainerGrant:
    shares = m.share.shares
    for s in shares:
        card = cards.get(s.index)
        if card is None or card.uuid != s.uuid:
            have = f"card {s.index} is {card.uuid}" if card else f"no card {s.index}"
            raise GrantError(f"pod {m.namespace}/{m.pod} container {m.container}: record names card {s.index} "
                             f"({s.uuid}) but this node has {have}")
    envs = card_envs(shares, m.record.klass.value, policy)
    spec_container = next(c for c in (m.pod_obj.get("spec") or {}).get("containers", []) if c.get("name") == m.container)
    envs.update(t9k_envs(spec_container, shares))
    host_dir = state_dir / "containers" / m.pod_uid / m.container
    mounts = (Mount(CONTAINER_CONFIG_DIR, str(host_dir), True),)
    devices: tuple[DeviceNode, ...] = ()
    if pass_device_specs:
        devices = tuple(DeviceNode(p, p, "rw") for p in CONTROL_DEVICES) + tuple(
            DeviceNode(f"/dev/nvidia{cards[s.index].minor}", f"/dev/nvidia{cards[s.index].minor}", "rw") for s in shares)
    quota = {
        "pod": f"{m.namespace}/{m.pod}", "pod_uid": m.pod_uid, "container": m.container,
        "class": m.record.klass.value, "policy": policy,
        "cards": [{"index": s.index, "uuid": s.uuid, "core_milli": s.core_milli, "memory_mib": s.memory_mib} for s in shares],
    }
    notes = {"qgpu.io/pod": f"{m.namespace}/{m.pod}", "qgpu.io/pod-uid": m.pod_uid, "qgpu.io/container": m.container}
    return ContainerGrant(envs, mounts, devices, notes, quota)


def card_envs(shares: Sequence[CardShare], klass: str, policy: str) -> dict[str, str]:
    """The variables the isolation engine and the container read, for both front doors (device
    plugin Allocate and DRA NodePrepareResources): cards and their shares in one order."""
    return {
        "NVIDIA_VISIBLE_DEVICES": ",".join(s.uuid for s in shares),
        "QGPU_CORE_MILLI": ",".join(str(s.core_milli) for s in shares),
        "QGPU_MEMORY_MIB": ",".join(str(s.memory_mib) for s in shares),
        "QGPU_CLASS": klass,
        "QGPU_POLICY": policy,
    }


T9K_MODES = ((rq.T9K_GPU, "xgn"), (rq.T9K_GPU_PERCENT, "sgn"), (rq.T9K_GPU_NODE, "node"))


def t9k_envs(spec_container: Mapping[str, Any], shares: Sequence[CardShare]) -> dict[str, str]:
    """The T9k variables for a container that asks in the T9k dialect, none otherwise. Every mode
    gets the same names, so a T9k image reads its mode and cards without guessing the request.

    ``T9K_GPU_MODE`` xgn | sgn | node; ``T9K_GPU_COUNT`` cards granted; for sgn also
    ``T9K_GPU_PERCENT`` (percent of the card's memory asked) and ``T9K_GPU_MEMORY`` (MiB per card)."""
    for resource, mode in T9K_MODES:
        asked = container_quantity(spec_container, resource)
        if asked is None:
            continue
        envs = {"T9K_GPU_MODE": mode, "T9K_GPU_COUNT": str(len(shares))}
        if resource == rq.T9K_GPU_PERCENT:
            envs["T9K_GPU_PERCENT"] = str(asked)
            envs["T9K_GPU_MEMORY"] = ",".join(str(s.memory_mib) for s in shares)
        return envs
    return {}


def t9k_share_envs(shares: Sequence[CardShare], cards: Mapping[int, CardInfo]) -> dict[str, str]:
    """The T9k variables for shares that come without a T9k request (a DRA claim): all cards at
    full core read as ``xgn``, anything less as ``sgn`` with the memory percent of the first card, so a T9k
    image finds the same names whichever door its cards came through."""
    if not shares:
        return {}
    envs = {"T9K_GPU_COUNT": str(len(shares))}
    if all(s.core_milli >= rq.CORE_MILLI_PER_CARD for s in shares):
        return {"T9K_GPU_MODE": "xgn", **envs}
    first = shares[0]
    percent = max(1, min(100, round(100 * first.memory_mib / cards[first.index].memory_mib)))
    return {"T9K_GPU_MODE": "sgn", **envs, "T9K_GPU_PERCENT": str(percent),
            "T9K_GPU_MEMORY": ",".join(str(s.memory_mib) for s in shares)}


def store_rows(m: Match, resource: str, device_ids: tuple[str, ...], now_ns: int) -> tuple[Grant, list[Share]]:
    grant = Grant(m.pod_uid, m.namespace, m.pod, m.container, resource, device_ids, now_ns)
    shares = [Share(m.pod_uid, m.namespace, m.pod, m.container, s.index, s.uuid, s.core_milli, s.memory_mib,
                    m.record.klass.value, now_ns) for s in m.share.shares]
    return grant, shares


def quota_json(grant: ContainerGrant) -> str:
    return json.dumps(grant.quota, indent=2, sort_keys=True) + "\n"
