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


@dataclass(frozen=True)
class PendingPod:
    """A GPU pod no node runs yet, and what the scheduler last said about it."""

    name: str  # namespace/name
    asks: str  # its GPU requests as written ("tke.cloud.tencent.com/qgpu-core=30, ...")
    reason: str  # PodScheduled's reason (Unschedulable, SchedulingGated, ...), or "NotTried"
    message: str = ""  # the scheduler's message (the extender's filter reasons among them)


_HEADER = ("NODE", "POLICY", "CARD", "MODEL", "MEMORY", "CORE ALLOC", "MEMORY ALLOC", "WORKLOADS")


def render_table(nodes: Sequence[NodeStatus], pending: Sequence[PendingPod] = ()) -> str:
    """A fixed-width table, one row per card; workloads listed as name(core%/memory); then the
    Pending GPU pods, one row each, with the scheduler's reason."""
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
    return _columns(rows) + (_pending_table(pending) if pending else "")


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _pending_table(pending: Sequence[PendingPod]) -> str:
    rows: list[tuple[str, ...]] = [("PENDING", "ASKS", "REASON", "MESSAGE")]
    rows += [(p.name, p.asks, p.reason, " ".join(p.message.split()) or "-") for p in pending]
    return "\n\n" + _columns(rows)


def render_json(nodes: Sequence[NodeStatus], pending: Sequence[PendingPod] = ()) -> str:
    return json.dumps({"nodes": [asdict(n) for n in nodes], "pending": [asdict(p) for p in pending]}, indent=2, sort_keys=True)
