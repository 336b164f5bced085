"""The `qgpu status` view: per node and card, what is allocated to whom, and what is used.

Cluster and standalone hosts both produce these values, so one renderer serves both. What is used
comes from the node managers' own metrics (:func:`parse_usage` reads the series node/metrics.py
writes; :func:`with_usage` joins them to the allocations).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from qgpu_runtime.contract import names


@dataclass(frozen=True)
class WorkloadShare:
    """One container's (or standalone job's) share of a card."""

    name: str
    core_milli: int
    memory_mib: int
    klass: str = "normal"
    unverified: bool = False  # its record's signature failed (qgpu status --record-verify-key): counts nowhere
    container: str = ""  # the container's name (cluster); "" for a standalone job
    used_core_pct: int | None = None  # SM percent of the card its processes used at the manager's last sample
    used_memory_mib: int | None = None  # card memory its processes held then; None: not read


@dataclass(frozen=True)
class CardStatus:
    index: int
    uuid: str
    model: str
    memory_mib: int
    core_allocated_milli: int
    memory_allocated_mib: int
    workloads: tuple[WorkloadShare, ...] = ()
    util_pct: int | None = None  # whole-card utilisation at the manager's last sample; None: not read
    memory_used_mib: int | None = None  # whole-card memory in use then (every process, ours or not)


@dataclass(frozen=True)
class NodeStatus:
    name: str
    policy: str
    cards: tuple[CardStatus, ...] = ()
    usage_error: str = ""  # why what is used could not be read for this node ("" when read or not asked)


@dataclass(frozen=True)
class PendingPod:
    """A GPU pod no node runs yet, and what the scheduler last said about it."""

    name: str  # namespace/name
    asks: str  # its GPU requests as written ("tke.cloud.tencent.com/qgpu-core=30, ...")
    reason: str  # PodScheduled's reason (Unschedulable, SchedulingGated, ...), or "NotTried"
    message: str = ""  # the scheduler's message (the extender's filter reasons among them)


_HEADER = ("NODE", "POLICY", "CARD", "MODEL", "MEMORY", "CORE ALLOC", "MEMORY ALLOC", "USED", "WORKLOADS")


class UsageError(ValueError):
    """A manager's metrics could not be read as such; the message names the node."""


MAX_METRICS_BYTES = 8 * 1024 * 1024
"""A node manager's /metrics larger than this is refused. node/metrics.py's series for 16 cards and
110 one-container pods, each with a GPU process, render to 202 KB (measured 2026-11-28)."""
MAX_CARD_INDEX = 63
MIB = 1024 * 1024


@dataclass(frozen=True)
class NodeUsage:
    """What one node's manager last sampled: per card, and per container and card."""

    cards: Mapping[int, tuple[int | None, int | None]]  # card -> (utilisation %, memory used MiB)
    containers: Mapping[tuple[str, str, str, int], tuple[int | None, int | None]]  # (ns, pod, container, card) -> (SM %, MiB)


def _card_index(raw: str | None) -> int | None:
    if raw is None or not raw.isdigit() or int(raw) > MAX_CARD_INDEX:
        return None
    return int(raw)


def _amount(value: float, scale: float) -> int | None:
    if not math.isfinite(value) or value < 0:
        return None
    return round(value * scale)


def parse_usage(node: str, text: str) -> NodeUsage:
    """Pure: the used series of a node manager's /metrics text. Only samples labelled with this
    node count (a manager speaks for its own node); samples with a card index outside 0..63 or a
    negative or non-finite value are skipped."""
    if len(text) > MAX_METRICS_BYTES:
        raise UsageError(f"node {node}: the manager's /metrics is {len(text)} bytes, over the limit of {MAX_METRICS_BYTES}")
    wanted = {names.CARD_UTILIZATION: ("card", 0, 100.0), names.CARD_MEMORY_USED: ("card", 1, 1 / MIB),
              names.CONTAINER_CORE_USED: ("container", 0, 100.0), names.CONTAINER_MEMORY_USED: ("container", 1, 1 / MIB)}
    cards: dict[int, list[int | None]] = {}
    containers: dict[tuple[str, str, str, int], list[int | None]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                what = wanted.get(sample.name)
                labels = sample.labels
                if what is None or labels.get("node") != node:
                    continue
                card, amount = _card_index(labels.get("card")), _amount(sample.value, what[2])
                if card is None or amount is None:
                    continue
                if what[0] == "card":
                    cards.setdefault(card, [None, None])[what[1]] = amount
                else:
                    key = (labels.get("namespace", ""), labels.get("pod", ""), labels.get("container", ""), card)
                    containers.setdefault(key, [None, None])[what[1]] = amount
    except ValueError as exc:
        raise UsageError(f"node {node}: the manager's /metrics is not Prometheus text: {exc}") from None
    return NodeUsage({k: (v[0], v[1]) for k, v in cards.items()}, {k: (v[0], v[1]) for k, v in containers.items()})


def with_usage(nodes: Sequence[NodeStatus], usage: Mapping[str, "NodeUsage | str"]) -> list[NodeStatus]:
    """Pure: each node's cards and workloads with what its manager says is used; a str in place of
    a NodeUsage says why that node's figures are missing. Nodes not in ``usage`` are unchanged."""
    out = []
    for node in nodes:
        got = usage.get(node.name)
        if got is None:
            out.append(node)
        elif isinstance(got, str):
            out.append(replace(node, usage_error=got))
        else:
            out.append(replace(node, usage_error="", cards=tuple(_card_used(card, got) for card in node.cards)))
    return out


def _card_used(card: CardStatus, usage: NodeUsage) -> CardStatus:
    util, memory = usage.cards.get(card.index, (None, None))
    work = []
    for w in card.workloads:
        parts = w.name.split("/")
        if len(parts) < 2:  # a standalone job: no pod to join on
            work.append(w)
            continue
        core, used = usage.containers.get((parts[0], parts[1], w.container, card.index), (None, None))
        # a container with no GPU process on the card uses nothing of it
        work.append(replace(w, used_core_pct=core or 0, used_memory_mib=used or 0))
    return replace(card, util_pct=util, memory_used_mib=memory, workloads=tuple(work))


def _used(pct: int | None, mib: int | None) -> str:
    if pct is None and mib is None:
        return "-"
    return f"{'?' if pct is None else pct}%/{'?' if mib is None else mib}MiB"


def render_table(nodes: Sequence[NodeStatus], pending: Sequence[PendingPod] = ()) -> str:
    """A fixed-width table, one row per card; workloads listed as name(core%/memory); then the
    Pending GPU pods, one row each, with the scheduler's reason."""
    rows: list[tuple[str, ...]] = [_HEADER]
    for node in nodes:
        if not node.cards:
            rows.append((node.name, node.policy, "-", "-", "-", "-", "-", "-", "no GPUs"))
        for card in node.cards:
            workloads = ", ".join(
                f"{w.name}({w.core_milli / 10:g}%/{w.memory_mib}MiB{'' if w.klass == 'normal' else ','+w.klass}"
                f"{',UNVERIFIED' if w.unverified else ''}"
                f"{'' if w.used_memory_mib is None else ',used ' + _used(w.used_core_pct, w.used_memory_mib)})"
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
                _used(card.util_pct, card.memory_used_mib),
                workloads or "-",
            ))
    notes = "".join(f"\nusage of {n.name}: {n.usage_error}" for n in nodes if n.usage_error)
    return _columns(rows) + (("\n" + notes) if notes else "") + (_pending_table(pending) if pending else "")


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (escape sequences, bidi overrides,
    newlines) written as its Python escape: job, pod and node names are chosen by their users and
    this table is read on other users' terminals."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _columns(rows: list[tuple[str, ...]]) -> str:
    rows = [tuple(printable(cell) for cell in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _pending_table(pending: Sequence[PendingPod]) -> str:
    rows: list[tuple[str, ...]] = [("PENDING", "ASKS", "REASON", "MESSAGE")]
    rows += [(p.name, p.asks, p.reason, " ".join(p.message.split()) or "-") for p in pending]
    return "\n\n" + _columns(rows)


def render_json(nodes: Sequence[NodeStatus], pending: Sequence[PendingPod] = ()) -> str:
    return json.dumps({"nodes": [asdict(n) for n in nodes], "pending": [asdict(p) for p in pending]}, indent=2, sort_keys=True)
