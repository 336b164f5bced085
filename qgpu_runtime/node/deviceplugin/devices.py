"""What the kubelet-facing device plugin needs from the node: a narrow interface, and its health view.

The gRPC servicer (node/deviceplugin/plugin.py) turns kubelet's calls into calls of this Protocol and its
answers into protobuf; the node manager satisfies it. Keeping the servicer on this interface, not
on the manager class, breaks the import loop manager ⇄ plugin and lets the servicer be tested with
any implementation (tests/node/test_node_device_plugin.py drives the real manager through it).

``wait_devices`` is the device plugin's view of the node's ``CardHealth``: kubelet's ListAndWatch
(one stream per served resource) blocks in it until the health version moves, so a card marked
unhealthy reaches every stream at once, as each kind's device IDs on that card.
"""

from __future__ import annotations

from typing import Protocol

from qgpu_runtime.node.deviceplugin.resources import ResourceKind
from qgpu_runtime.node.deviceplugin.response import ContainerGrant
from qgpu_runtime.node.health import CardHealth


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


def wait_devices(health: CardHealth, kind: ResourceKind, seen: int, timeout_s: float) -> tuple[int, list[tuple[str, bool]]]:
    """(health version, [(device ID, healthy)]) of ``kind``'s devices; blocks up to ``timeout_s``
    while the version is ``seen``."""
    version, sick, _ = health.wait_change(seen, timeout_s)
    return version, [(d, not sick.keys() & set(cards)) for d, cards in kind.advertised(health.cards.values()).items()]
