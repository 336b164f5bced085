"""The extender's mirror of the nodes: each node's spec as its inventory gives it, which nodes are
of a DRA pool, and which nodes' data was refused and why (extender/nodes.py decodes them).

Fed by node watch events through the cache; not thread-safe on its own: the cache's lock guards it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from qgpu_runtime.extender.nodes import NodeInventoryError, dra_pool, failed_cards, node_inventory, node_spec, refused_spec
from qgpu_runtime.extender.pacing import ChangePacer, PacedChanges
from qgpu_runtime.placement.state import NodeSpec

log = logging.getLogger(__name__)


def node_name(node: Mapping[str, Any]) -> str:
    return str((node.get("metadata") or {}).get("name") or "")


class NodeView:
    """NodeSpec by node name, the DRA-pool nodes and the refused nodes' reasons."""

    def __init__(self, report: Callable[[str], None], pacer: ChangePacer | None = None) -> None:
        self._specs: dict[str, NodeSpec] = {}
        self.dra_pool: set[str] = set()  # nodes of DRA pools (extender/nodes.py dra_pool)
        self._invalid: dict[str, str] = {}  # node -> why its data was refused (extender/nodes.py)
        self.failed: dict[str, dict[int, tuple[str, str]]] = {}  # node -> its unhealthy cards (index -> UUID, reason)
        self._report = report
        # each node's spec changes are paced (extender/pacing.py): every change rebuilds the state
        self.paced: PacedChanges[NodeSpec] = PacedChanges(pacer)  # node -> its latest spec, held back

    def _set(self, name: str, spec: NodeSpec) -> None:
        self._specs[name] = spec
        if dra_pool(spec):
            self.dra_pool.add(name)
        else:
            self.dra_pool.discard(name)

    def take_due(self) -> bool:
        """Apply the held-back specs whose nodes may change again; True when one was applied (the
        state is rebuilt). Costs nothing while none waits."""
        due = self.paced.take_due(len(self._specs))
        for name, spec in due:
            self._set(name, spec)
        return bool(due)

    def apply(self, event: str, node: Mapping[str, Any]) -> bool:
        """Take one node event; True when a node left or its spec changed (the state is rebuilt)."""
        name = node_name(node)
        if event == "DELETED":  # at once: a node gone takes nothing (counted, so it cannot come and go freely)
            self.dra_pool.discard(name)
            self._invalid.pop(name, None)
            self.failed.pop(name, None)
            self.paced.removed(name, name if name in self._specs else None)
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
            self.paced.settled(name)  # back where it is: nothing waits
            return False
        first = name not in self.paced.waiting
        if not self.paced.offer(name, name, spec):
            if first:
                log.warning("node %s changes its inventory, labels or allocatable faster than %d times at once and once "
                            "per %g s: its latest spec applies when it may change again", name, self.paced.pacer.burst,
                            self.paced.pacer.interval_s)
            return False
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
