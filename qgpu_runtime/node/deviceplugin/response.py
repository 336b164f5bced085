"""What a container gets back from Allocate: environment, mounts, device nodes, annotations.

Pure: built from the match, the cards and the node's settings. The environment and ``quota.json``
are the contract with the isolation engine, built by contract/environment.py (the DRA door builds
its CDI specs' environment there too); the T9k mode comes from the record's dialect.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from qgpu_runtime.contract.environment import (
    CONTROL_DEVICES,
    DEVICE_LIST_MOUNT_SOURCE,
    NODE,
    SGN,
    XGN,
    T9kMode,
    container_environment,
    device_list_mounts,
    quota_document,
)
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model import requests as rq
from qgpu_runtime.node.deviceplugin.matching import Match, container_quantity
from qgpu_runtime.node.store import Grant, Share

CONTAINER_CONFIG_DIR = "/etc/qgpu"


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
    envs = container_environment(shares, m.record.klass.value, policy, t9k_mode(m), m.share.dialect)
    host_dir = state_dir / "containers" / m.pod_uid / m.container
    # The config folder stays first (config_host_dir); then one mount per card, which is what the
    # toolkit believes where the role turned NVIDIA_VISIBLE_DEVICES off for unprivileged containers.
    mounts = (Mount(CONTAINER_CONFIG_DIR, str(host_dir), True),) + tuple(
        Mount(path, DEVICE_LIST_MOUNT_SOURCE, True) for path in device_list_mounts([s.uuid for s in shares]))
    devices: tuple[DeviceNode, ...] = ()
    if pass_device_specs:
        devices = tuple(DeviceNode(p, p, "rw") for p in CONTROL_DEVICES) + tuple(
            DeviceNode(f"/dev/nvidia{cards[s.index].minor}", f"/dev/nvidia{cards[s.index].minor}", "rw") for s in shares)
    quota = quota_document(f"{m.namespace}/{m.pod}", m.pod_uid, m.container, m.record.klass.value, policy, shares)
    notes = {"qgpu.io/pod": f"{m.namespace}/{m.pod}", "qgpu.io/pod-uid": m.pod_uid, "qgpu.io/container": m.container}
    return ContainerGrant(envs, mounts, devices, notes, quota)


# The T9k resource each mode answers, in the order the pod spec was read before records carried
# their dialect; only records written before that still go this way (:func:`t9k_of_spec`).
T9K_MODES = ((rq.T9K_GPU, XGN), (rq.T9K_GPU_PERCENT, SGN), (rq.T9K_GPU_NODE, NODE))


def t9k_mode(m: Match) -> T9kMode | None:
    """The container's T9k mode from its record entry's dialect; a record an older extender
    wrote carries none, and the pod spec decides as it did then."""
    if m.share.dialect is not None:
        return T9kMode.of_dialect(m.share.dialect)
    spec_container = next(c for c in (m.pod_obj.get("spec") or {}).get("containers", []) if c.get("name") == m.container)
    return t9k_of_spec(spec_container)


def t9k_of_spec(spec_container: Mapping[str, Any]) -> T9kMode | None:
    """The T9k mode a container's own resources ask for, None when it asks in another dialect."""
    for resource, mode in T9K_MODES:
        asked = container_quantity(spec_container, resource)
        if asked is not None:
            return T9kMode(mode, asked if mode == SGN else None)
    return None


def store_rows(m: Match, resource: str, device_ids: tuple[str, ...], now_ns: int) -> tuple[Grant, list[Share]]:
    grant = Grant(m.pod_uid, m.namespace, m.pod, m.container, resource, device_ids, now_ns)
    shares = [Share(m.pod_uid, m.namespace, m.pod, m.container, s.index, s.uuid, s.core_milli, s.memory_mib,
                    m.record.klass.value, now_ns) for s in m.share.shares]
    return grant, shares

