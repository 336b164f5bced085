"""The `qgpu status` view: per node and card, what is allocated to whom.

Cluster and standalone hosts both produce these values, so one renderer serves both.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass(frozen=True)
class WorkloadShare:
    """One container's (or standalone job's) share of a card."""

    name: str
    core_milli: int
    memory_mib: int
    klass: str = "normal"
    unverified: bool = False  # its record's signature failed (qgpu status --record-verify-key): counts nowhere


@dataclass(frozen=True)
class CardStatus:
    index: int
    uuid: str
    model: str
    memory_mib: int
    core_allocated_milli: int
    memory_allocated_mib: int
    workloads: tuple[WorkloadShare, ...] = ()


@dataclass(frozen=True)
class NodeStatus:
    name: str
    policy: str
    cards: tuple[CardStatus, ...] = ()


_HEADER = ("NODE", "POLICY", "CARD", "MODEL", "MEMORY", "CORE ALLOC", "MEMORY ALLOC", "WORKLOADS")


def render_table(nodes: Sequence[NodeStatus]) -> str:
    """A fixed-width table, one row per card; workloads listed as name(core%/memory)."""
    rows: list[tuple[str, ...]] = [_HEADER]
    for node in nodes:
        if not node.cards:
            rows.append((node.name, node.policy, "-", "-", "-", "-", "-", "no GPUs"))
        for card in node.cards:
            workloads = ", ".join(
                f"{w.name}({w.core_milli / 10:g}%/{w.memory_mib}MiB{'' if w.klass == 'normal' else ','+w.klass}"
                f"{',UNVERIFIED' if w.unverified else ''})"
                for w in card.workloads
            )
            rows.append((
                node.name,
                node.policy,
                str(card.index),
                card.model,
                f"{card.memory_mib}MiB",
                f"{card.core_allocated_milli / 10:g}%",
                f"{card.memory_allocated_mib}MiB",
                workloads or "-",
            ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def render_json(nodes: Sequence[NodeStatus]) -> str:
    return json.dumps({"nodes": [asdict(n) for n in nodes]}, indent=2, sort_keys=True)
