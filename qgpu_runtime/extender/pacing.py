"""How often one node may change what the extender's placement state is built from.

A node's spec (its inventory, labels, allocatable) and its ResourceSlices change rarely: a card
fails or comes back, a label, kubelet's allocatable as its plugins register. Each change makes the
extender rebuild a whole placement state under a lock every filter or prioritize waits on, replaying
every booking (~95 ms at 2,000 nodes and 8,000 bound pods for the device-plugin state). A node
writes its own inventory, status and slices, so a compromised one alternating two valid values
would hold that lock for the whole cluster. :class:`ChangePacer` lets each node make ``burst``
changes at once, then one per ``interval_s``; :class:`PacedChanges` keeps a change past that
waiting (the latest replacing an earlier one) until the node may change again.
"""

from __future__ import annotations

import time
from typing import Callable, Generic, TypeVar

CHANGE_BURST = 10
CHANGE_INTERVAL_S = 5.0
V = TypeVar("V")


class ChangePacer:
    """A per-node allowance of changes: ``burst`` at once, refilled one per ``interval_s``. Not
    thread-safe: its owner's lock guards it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, burst: int = CHANGE_BURST,
                 interval_s: float = CHANGE_INTERVAL_S) -> None:
        if burst < 1 or interval_s <= 0:
            raise ValueError(f"burst={burst!r}, interval_s={interval_s!r}: must be >= 1 and > 0")
        self.clock = clock
        self.burst = burst
        self.interval_s = interval_s
        self._allowance: dict[str, tuple[float, float]] = {}  # node -> (changes it may make, when counted)

    def _left(self, node: str, now: float) -> float:
        left, at = self._allowance.get(node, (float(self.burst), now))
        return min(float(self.burst), left + max(0.0, now - at) / self.interval_s)  # a clock set back refills nothing

    def may_change(self, node: str) -> bool:
        """Take one of the node's changes if it has one left."""
        now = self.clock()
        left = self._left(node, now)
        allowed = left >= 1.0
        self._allowance[node] = (left - 1.0 if allowed else left, now)
        return allowed

    def forget_full(self, nodes: int) -> None:
        """Drop the nodes back at their full allowance once the map outgrows twice ``nodes``: it stays
        the size of the nodes changing now, not of every node that ever changed."""
        if len(self._allowance) > 2 * max(nodes, 1):
            now = self.clock()
            self._allowance = {n: v for n, v in self._allowance.items() if self._left(n, now) < self.burst}


class PacedChanges(Generic[V]):
    """Changes by key (a node's spec, a ResourceSlice), each counted against its node's
    :class:`ChangePacer` allowance. A change past the allowance waits, the latest replacing an
    earlier one of the same key, until :meth:`take_due` finds its node may change again. Not
    thread-safe: its owner's lock guards it."""

    def __init__(self, pacer: ChangePacer | None = None) -> None:
        self.pacer = pacer or ChangePacer()
        self.waiting: dict[str, tuple[str, V]] = {}  # key -> (its node, its latest value)
        self.held_back = 0  # changes that waited (for tests and the log)

    def offer(self, key: str, node: str, value: V) -> bool:
        """Count a change of ``key`` against ``node``: True when it applies now, False when it waits."""
        if self.pacer.may_change(node):
            self.waiting.pop(key, None)
            return True
        self.waiting[key] = (node, value)
        self.held_back += 1
        return False

    def settled(self, key: str) -> None:
        """``key`` is back at what applies: nothing of it waits (and nothing is counted)."""
        self.waiting.pop(key, None)

    def removed(self, key: str, node: str | None) -> None:
        """``key`` is gone: nothing of it waits, and a removal of what applied (``node`` given) is
        counted, so a node cannot delete and create freely."""
        self.waiting.pop(key, None)
        if node is not None:
            self.pacer.may_change(node)

    def take_due(self, known: int) -> list[tuple[str, V]]:
        """The waiting changes whose nodes may change again, taken out of the wait; ``known``
        (how many keys apply) bounds the pacer's memory. Costs nothing while none waits."""
        if not self.waiting:
            return []
        due = [(key, value) for key, (node, value) in self.waiting.items() if self.pacer.may_change(node)]
        for key, _ in due:
            del self.waiting[key]
        self.pacer.forget_full(known)
        return due

    def clear(self) -> None:
        self.waiting.clear()
