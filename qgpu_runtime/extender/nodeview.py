"""The extender's mirror of the nodes: each node's spec as its inventory gives it, which nodes are
of a DRA pool, and which nodes' data was refused and why (extender/nodes.py decodes them).

Fed by node watch events through the cache; not thread-safe on its own: the cache's lock guards it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from qgpu_runtime.extender.nodes import NodeInventoryError, dra_pool, failed_cards, node_inventory, node_spec, refused_spec
from qgpu_runtime.placement.state import NodeSpec

log = logging.getLogger(__name__)

# A node's spec changes rarely (a card fails or comes back, a label, kubelet's allocatable as its
# plugins register), yet each change rebuilds the whole ClusterState under the cache's one lock:
# every booking and pod of the cluster replayed (~95 ms at 2,000 nodes and 8,000 pods). A node
# writes its own inventory and status, so a compromised one alternating two valid values would hold
# that lock for every filter and bind of the cluster. Each node may change its spec CHANGE_BURST
# times at once, then once per CHANGE_INTERVAL_S; a change past that waits, the node's latest spec
# replacing any earlier waiting one, and applies as soon as the node may change again.
CHANGE_BURST = 10
CHANGE_INTERVAL_S = 5.0


def node_name(node: Mapping[str, Any]) -> str:
    return str((node.get("metadata") or {}).get("name") or "")


class NodeView:
    """NodeSpec by node name, the DRA-pool nodes and the refused nodes' reasons."""

    def __init__(self, report: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 burst: int = CHANGE_BURST, interval_s: float = CHANGE_INTERVAL_S) -> None:
        self._specs: dict[str, NodeSpec] = {}
        self.dra_pool: set[str] = set()  # nodes of DRA pools (extender/nodes.py dra_pool)
        self._invalid: dict[str, str] = {}  # node -> why its data was refused (extender/nodes.py)
        self.failed: dict[str, dict[int, tuple[str, str]]] = {}  # node -> its unhealthy cards (index -> UUID, reason)
        self._report = report
        self._clock = clock
        self._burst = burst
        self._interval_s = interval_s
        self._allowance: dict[str, tuple[float, float]] = {}  # node -> (changes it may make, when counted)
        self.waiting: dict[str, NodeSpec] = {}  # node -> its latest spec, held back by the allowance
        self.held_back = 0  # changes that waited (a metric, and for tests)

    def _may_change(self, name: str, now: float) -> bool:
        """Take one of the node's changes if it has one left (refilled one per interval)."""
        left, at = self._allowance.get(name, (float(self._burst), now))
        left = min(float(self._burst), left + max(0.0, now - at) / self._interval_s)
        if left < 1.0:
            self._allowance[name] = (left, now)
            return False
        left -= 1.0
        self._allowance[name] = (left, now)
        return True

    def _set(self, name: str, spec: NodeSpec) -> None:
        self._specs[name] = spec
        if dra_pool(spec):
            self.dra_pool.add(name)
        else:
            self.dra_pool.discard(name)

    def take_due(self) -> bool:
        """Apply the held-back specs whose nodes may change again; True when one was applied (the
        state is rebuilt). Costs nothing while none waits."""
        if not self.waiting:
            return False
        now = self._clock()
        due = [name for name in self.waiting if self._may_change(name, now)]
        for name in due:
            self._set(name, self.waiting.pop(name))
        self._forget_full(now)
        return bool(due)

    def _forget_full(self, now: float) -> None:
        """Drop the allowance of nodes back at their full burst: the dict stays the size of the
        nodes changing now, not of every node that ever changed."""
        if len(self._allowance) > 2 * max(len(self._specs), 1):
            self._allowance = {n: (left, at) for n, (left, at) in self._allowance.items()
                               if min(float(self._burst), left + max(0.0, now - at) / self._interval_s) < self._burst}

    def apply(self, event: str, node: Mapping[str, Any]) -> bool:
        """Take one node event; True when a node left or its spec changed (the state is rebuilt)."""
        name = node_name(node)
        if event == "DELETED":  # at once: a node gone takes nothing (counted, so it cannot come and go freely)
            self.dra_pool.discard(name)
            self._invalid.pop(name, None)
            self.failed.pop(name, None)
            self.waiting.pop(name, None)
            if name in self._specs:
                self._may_change(name, self._clock())
            return self._specs.pop(name, None) is not None
        try:
            inventory = node_inventory(node)  # read once: for the unhealthy cards and the spec
        except NodeInventoryError:
            inventory = None  # refused: no card is placed on, nor reported failed (node_spec says why)
        failed = failed_cards(inventory) if inventory is not None else {}
        if failed:
            self.failed[name] = failed
        else:
            self.failed.pop(name, None)
        try:
            spec = node_spec(node, inventory)
            self._invalid.pop(name, None)
        except NodeInventoryError as exc:
            # The node's own data is out of bounds: it takes nothing, and filter says why.
            if self._invalid.get(name) != str(exc):
                self._report(str(exc))
            self._invalid[name] = str(exc)
            spec = refused_spec(node)
        if self._specs.get(name) == spec:
            self.waiting.pop(name, None)  # back where it is: nothing waits
            return False
        if not self._may_change(name, self._clock()):
            if name not in self.waiting:
                log.warning("node %s changes its inventory, labels or allocatable faster than %d times at once and once "
                            "per %g s: its latest spec applies when it may change again", name, self._burst,
                            self._interval_s)
            self.waiting[name] = spec
            self.held_back += 1
            return False
        self.waiting.pop(name, None)
        self._set(name, spec)
        return True

    def spec(self, name: str) -> NodeSpec | None:
        return self._specs.get(name)

    def specs(self) -> dict[str, NodeSpec]:
        """Every known node's spec by name (a copy, in the order the nodes arrived)."""
        return dict(self._specs)

    def sorted_specs(self) -> list[NodeSpec]:
        return [self._specs[n] for n in sorted(self._specs)]

    def names(self) -> list[str]:
        return sorted(self._specs)

    def name_invalid(self, failed: dict[str, str], unresolvable: dict[str, str]) -> None:
        """Nodes whose data was refused fail with that reason (not "no GPUs"), as unresolvable:
        preemption on them cannot help until their manager publishes a valid inventory."""
        for name, why in self._invalid.items():
            if name in failed or name in unresolvable:
                failed.pop(name, None)
                unresolvable[name] = f"qgpu refused this node's data: {why}"
