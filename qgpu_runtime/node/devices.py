"""What the kubelet-facing device plugin needs from the node: a narrow interface.

The gRPC servicer (node/plugin.py) turns kubelet's calls into calls of this Protocol and its
answers into protobuf; the node manager satisfies it. Keeping the servicer on this interface, not
on the manager class, breaks the import loop manager ⇄ plugin and lets the servicer be tested with
any implementation (tests/node/test_node_device_plugin.py drives the real manager through it).
"""

from __future__ import annotations

from typing import Protocol

from qgpu_runtime.node.resources import ResourceKind
from qgpu_runtime.node.response import ContainerGrant


class AllocateRefused(RuntimeError):
    """Allocate cannot be answered truthfully; the message is what the user sees on the pod."""


class DeviceService(Protocol):
    def wait_devices(self, kind: ResourceKind, seen: int, timeout_s: float) -> tuple[int, list[tuple[str, bool]]]:
        """(version, [(device ID, healthy)]) once the version differs from ``seen`` or the timeout passes."""
        ...

    def preferred(self, kind: ResourceKind, available: list[str], must: list[str], size: int) -> list[str]:
        ...

    def allocate(self, kind: ResourceKind, device_ids: tuple[str, ...]) -> ContainerGrant:
        """The container's grant; raises AllocateRefused with the reason the pod shows."""
        ...

    def prestart(self, kind: ResourceKind, device_ids: tuple[str, ...]) -> None:
        ...
