"""Card health on the node: which cards are unhealthy and why, and the device-list version.

Both doors' health streams wait in ``wait_change`` until the version moves, so a card marked
unhealthy reaches every stream at once: the device plugin's ListAndWatch through its per-kind view
(node/deviceplugin/devices.py ``wait_devices``), the DRA plugin's ``NodeWatchResources``
(node/dra/health.py). Unhealthy lasts until the GPU backend reports the card fit again (after a
reset: NVML answers and no page retirement or row remapping is pending; gpu/nvml.py) or the manager
restarts. This module knows cards, never a door's device names.
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.node.store import PreparedClaim, Share

UNHEALTHY_EVENT = "GPUCardUnhealthy"
"""Reason of the Warning Event each pod holding a share of a card gets when the card turns unhealthy."""


def pods_on_card(index: int, shares: Iterable[Share], claims: Iterable[PreparedClaim]) -> list[tuple[str, str, str]]:
    """Pure: (namespace, pod, pod uid) of every pod holding a share of card ``index``, once each. A
    device-plugin share names its pod (workload_id is the pod's UID); a DRA share names its claim
    (workload_id is the claim's UID), whose pods are those it was reserved for at prepare."""
    by_claim = {c.claim_uid: c for c in claims}
    out: set[tuple[str, str, str]] = set()
    for share in shares:
        if share.card_index != index:
            continue
        claim = by_claim.get(share.workload_id)
        if claim is None:
            out.add((share.namespace, share.workload, share.workload_id))
        else:
            out.update((claim.namespace, pod.name, pod.uid) for pod in claim.pods)
    return sorted(out)


class CardHealth:
    def __init__(self, cards: Mapping[int, CardInfo]) -> None:
        self._cards = cards
        self._unhealthy: dict[int, str] = {}
        self._version = 0
        self._changed = threading.Condition()
        self._closed = False

    def mark(self, index: int, reason: str) -> bool:
        """Mark a card unhealthy; False when it already was, or is no card of this node."""
        with self._changed:
            if index in self._unhealthy or index not in self._cards:
                return False
            self._unhealthy[index] = reason
            self._version += 1
            self._changed.notify_all()
        return True

    def clear(self, index: int) -> bool:
        """The card is fit again; False when it was not unhealthy."""
        with self._changed:
            if self._unhealthy.pop(index, None) is None:
                return False
            self._version += 1
            self._changed.notify_all()
        return True

    def unhealthy(self) -> dict[int, str]:
        with self._changed:
            return dict(self._unhealthy)

    @property
    def cards(self) -> Mapping[int, CardInfo]:
        return self._cards

    def wait_change(self, seen: int, timeout_s: float) -> tuple[int, dict[int, str], bool]:
        """(health version, unhealthy cards, closed); blocks up to ``timeout_s`` while the version
        is ``seen`` and the health is open (or until ``wake``)."""
        with self._changed:
            if seen == self._version and not self._closed:
                self._changed.wait(timeout_s)
            return self._version, dict(self._unhealthy), self._closed

    def wake(self) -> None:
        """Wake every waiter without a change (a stream whose client went away checks and ends)."""
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        """Wake every waiting stream; later waits return at once (the manager is stopping)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
