"""Prometheus metrics of the node manager: requested against used, per card and per container.

The four TKEStack gpu-manager series keep their names and labels so existing dashboards work:

- ``container_gpu_utilization{pod_name,namespace,node,container_name,gpu}``: SM percent used, per
  card (``gpu="gpu<index>"``) and summed (``gpu="total"``).
- ``container_gpu_memory_total{…,gpu_memory}``: MiB used, per card and ``total``.
- ``container_request_gpu_utilization{…,req_of_gpu="total"}``: cards requested (0.3 = 30 %).
- ``container_request_gpu_memory{…,req_of_gpu_memory="total"}``: MiB requested.

qgpu's own series are prefixed ``qgpu_`` and use base units (ratios, bytes).

The sampler builds an immutable :class:`Snapshot` once per interval (pure: :func:`build_snapshot`);
a scrape only renders the latest snapshot, so scrapes never touch NVML or SQLite. The per-process
"used" figures are the GPU backend's sample; on NVML that is the per-process sampler the isolation
loop reads too (gpu/nvml_processes.py), so metrics and isolation never disagree about them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from qgpu_runtime.contract import names
from qgpu_runtime.gpu.types import CardInfo, CardUsage
from qgpu_runtime.kube.podslim import oversized
from qgpu_runtime.node.cgroups import container_id, pod_and_container
from qgpu_runtime.node.store import Share
from qgpu_runtime.node.tenants import WHOLE_POD

MIB = 1024 * 1024
TKE_LABELS = ("pod_name", "namespace", "node", "container_name")


@dataclass(frozen=True)
class ContainerRow:
    namespace: str
    pod: str
    container: str
    klass: str
    requested: dict[int, tuple[int, int]]  # card index -> (core milli, memory MiB)
    used: dict[int, tuple[int, int]] = field(default_factory=dict)  # card index -> (SM %, memory MiB)


@dataclass(frozen=True)
class Snapshot:
    node: str
    cards: tuple[CardInfo, ...] = ()
    unhealthy: Mapping[int, str] = field(default_factory=dict)
    usage: Mapping[int, CardUsage] = field(default_factory=dict)
    containers: tuple[ContainerRow, ...] = ()


def build_snapshot(
    node: str,
    cards: Sequence[CardInfo],
    unhealthy: Mapping[int, str],
    usage: Iterable[CardUsage],
    shares: Iterable[Share],
    pods: Iterable[Mapping[str, Any]],
) -> Snapshot:
    """Join the store's shares (requested) with process usage mapped through cgroups (used)."""
    names: dict[str, tuple[str, str, str]] = {}  # container id -> (namespace, pod, container)
    whole: dict[str, tuple[str, str, str]] = {}  # pod UID -> (namespace, pod, "*"): kept oversized, no statuses
    uid_of: dict[str, tuple[str, str]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        uid_of[str(meta.get("uid", ""))] = (meta.get("namespace", "default"), meta.get("name", ""))
        if oversized(pod) is not None:
            whole[str(meta.get("uid", ""))] = (meta.get("namespace", "default"), meta.get("name", ""), WHOLE_POD)
        for st in (pod.get("status") or {}).get("containerStatuses") or []:
            if st.get("containerID"):
                names[container_id(st["containerID"])] = (meta.get("namespace", "default"), meta.get("name", ""), st.get("name", ""))
    rows: dict[tuple[str, str, str], ContainerRow] = {}
    for s in shares:
        key = (s.namespace, s.workload, s.container)
        row = rows.setdefault(key, ContainerRow(s.namespace, s.workload, s.container, s.klass, {}, {}))
        core, mem = row.requested.get(s.card_index, (0, 0))
        row.requested[s.card_index] = (core + s.core_milli, mem + s.memory_mib)
    usage = list(usage)
    for card_usage in usage:
        for proc in card_usage.processes:
            owner = pod_and_container(proc.cgroup)
            if owner is None:
                continue
            uid, cid = owner
            key = names.get(cid) or whole.get(uid)
            if key is None:
                continue
            row = rows.get(key)
            if row is None:  # a GPU process in a pod that holds no share: still worth showing
                row = rows[key] = ContainerRow(key[0], key[1], key[2], "normal", {}, {})
            sm, mem = row.used.get(proc.card_index, (0, 0))
            row.used[proc.card_index] = (min(100, sm + proc.sm_util_pct), mem + proc.memory_mib)
    return Snapshot(node, tuple(cards), dict(unhealthy), {u.index: u for u in usage},
                    tuple(rows[k] for k in sorted(rows)))


class NodeCollector(Collector):
    """Renders the latest snapshot; ``update`` swaps it atomically."""

    def __init__(self, node: str) -> None:
        self._snapshot = Snapshot(node)
        self._lock = threading.Lock()

    def update(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def collect(self):
        with self._lock:
            snap = self._snapshot
        yield from render(snap)


def render(snap: Snapshot) -> list[GaugeMetricFamily]:
    node = snap.node
    util = GaugeMetricFamily("container_gpu_utilization", "gpu utilization (SM percent)", labels=[*TKE_LABELS, "gpu"])
    mem = GaugeMetricFamily("container_gpu_memory_total", "gpu memory usage in MiB", labels=[*TKE_LABELS, "gpu_memory"])
    req_util = GaugeMetricFamily("container_request_gpu_utilization", "request of gpu utilization (cards)",
                                 labels=[*TKE_LABELS, "req_of_gpu"])
    req_mem = GaugeMetricFamily("container_request_gpu_memory", "request of gpu memory in MiB",
                                labels=[*TKE_LABELS, "req_of_gpu_memory"])
    q_req_core = GaugeMetricFamily("qgpu_container_core_requested_ratio", "requested share of a card's compute",
                                   labels=["node", "namespace", "pod", "container", "card", "class"])
    q_req_mem = GaugeMetricFamily("qgpu_container_memory_requested_bytes", "GPU memory reserved on a card",
                                  labels=["node", "namespace", "pod", "container", "card", "class"])
    q_used_core = GaugeMetricFamily(names.CONTAINER_CORE_USED, "SM utilisation of the container on a card",
                                    labels=["node", "namespace", "pod", "container", "card"])
    q_used_mem = GaugeMetricFamily(names.CONTAINER_MEMORY_USED, "GPU memory used by the container on a card",
                                   labels=["node", "namespace", "pod", "container", "card"])
    alloc_core: dict[int, int] = {}
    alloc_mem: dict[int, int] = {}
    for row in snap.containers:
        base = [row.pod, row.namespace, node, row.container]
        if row.used:
            for card, (sm, used) in sorted(row.used.items()):
                util.add_metric([*base, f"gpu{card}"], sm)
                mem.add_metric([*base, f"gpu{card}"], used)
                q_used_core.add_metric([node, row.namespace, row.pod, row.container, str(card)], sm / 100)
                q_used_mem.add_metric([node, row.namespace, row.pod, row.container, str(card)], used * MIB)
            util.add_metric([*base, "total"], sum(v[0] for v in row.used.values()))
            mem.add_metric([*base, "total"], sum(v[1] for v in row.used.values()))
        if row.requested:
            req_util.add_metric([*base, "total"], sum(v[0] for v in row.requested.values()) / 1000)
            req_mem.add_metric([*base, "total"], sum(v[1] for v in row.requested.values()))
            for card, (core, reserved) in sorted(row.requested.items()):
                q_req_core.add_metric([node, row.namespace, row.pod, row.container, str(card), row.klass], core / 1000)
                q_req_mem.add_metric([node, row.namespace, row.pod, row.container, str(card), row.klass], reserved * MIB)
                alloc_core[card] = alloc_core.get(card, 0) + core
                alloc_mem[card] = alloc_mem.get(card, 0) + reserved
    info = GaugeMetricFamily("qgpu_card_info", "a GPU of this node (value 1)", labels=["node", "card", "uuid", "model"])
    healthy = GaugeMetricFamily("qgpu_card_healthy", "1 healthy, 0 unhealthy (XID, ECC, lost)", labels=["node", "card"])
    total = GaugeMetricFamily("qgpu_card_memory_total_bytes", "memory of the card", labels=["node", "card"])
    used = GaugeMetricFamily(names.CARD_MEMORY_USED, "memory in use on the card", labels=["node", "card"])
    card_util = GaugeMetricFamily(names.CARD_UTILIZATION, "whole-card utilisation", labels=["node", "card"])
    core_alloc = GaugeMetricFamily("qgpu_card_core_allocated_ratio", "compute promised to workloads", labels=["node", "card"])
    mem_alloc = GaugeMetricFamily("qgpu_card_memory_allocated_bytes", "memory promised to workloads", labels=["node", "card"])
    for card in snap.cards:
        c = str(card.index)
        info.add_metric([node, c, card.uuid, card.model], 1)
        healthy.add_metric([node, c], 0 if card.index in snap.unhealthy else 1)
        total.add_metric([node, c], card.memory_mib * MIB)
        core_alloc.add_metric([node, c], alloc_core.get(card.index, 0) / 1000)
        mem_alloc.add_metric([node, c], alloc_mem.get(card.index, 0) * MIB)
        u = snap.usage.get(card.index)
        if u is not None:
            used.add_metric([node, c], u.memory_used_mib * MIB)
            card_util.add_metric([node, c], u.util_pct / 100)
    return [util, mem, req_util, req_mem, q_req_core, q_req_mem, q_used_core, q_used_mem,
            info, healthy, total, used, card_util, core_alloc, mem_alloc]


@dataclass(frozen=True)
class EnforcedContainer:
    """What the isolation loop did to one container in its last tick."""

    namespace: str
    pod: str
    container: str
    held: bool
    allowance: Mapping[int, float | None]  # card -> allowance rate in milli of the card (None: unlimited)
    charged: Mapping[int, float]  # card -> use the engine charged over the tick, milli of the card


@dataclass(frozen=True)
class IsolationSnapshot:
    policy: str = ""
    containers: tuple[EnforcedContainer, ...] = ()
    unmanaged_processes: int = 0


class IsolationCollector(Collector):
    """Renders the isolation loop's last tick (empty until the loop runs)."""

    def __init__(self, node: str) -> None:
        self._node = node
        self._snapshot: IsolationSnapshot | None = None
        self._lock = threading.Lock()

    def update(self, snapshot: IsolationSnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def collect(self):
        with self._lock:
            snap = self._snapshot
        if snap is not None:
            yield from render_isolation(self._node, snap)


def render_isolation(node: str, snap: IsolationSnapshot) -> list[GaugeMetricFamily]:
    labels = ["node", "namespace", "pod", "container"]
    policy = GaugeMetricFamily("qgpu_isolation_policy_info", "isolation policy the node enforces (value 1)",
                               labels=["node", "policy"])
    policy.add_metric([node, snap.policy], 1)
    held = GaugeMetricFamily("qgpu_container_held", "1 while the isolation loop holds (SIGSTOP) the container's GPU processes",
                             labels=labels)
    allowance = GaugeMetricFamily("qgpu_container_core_allowance_ratio",
                                  "compute the control law allows the container on a card (absent: unlimited)",
                                  labels=[*labels, "card"])
    charged = GaugeMetricFamily("qgpu_container_core_charged_ratio",
                                "compute the isolation loop charged the container on a card over its last tick",
                                labels=[*labels, "card"])
    for c in snap.containers:
        base = [node, c.namespace, c.pod, c.container]
        held.add_metric(base, 1 if c.held else 0)
        for card, rate in sorted(c.allowance.items()):
            if rate is not None:
                allowance.add_metric([*base, str(card)], rate / 1000)
        for card, used in sorted(c.charged.items()):
            charged.add_metric([*base, str(card)], used / 1000)
    unmanaged = GaugeMetricFamily("qgpu_isolation_unmanaged_processes",
                                  "GPU processes in the last sample that belong to no qgpu container (left alone)",
                                  labels=["node"])
    unmanaged.add_metric([node], snap.unmanaged_processes)
    return [policy, held, allowance, charged, unmanaged]


@dataclass
class ManagerMetrics:
    """Everything the manager exports, in its own registry (no process-global state)."""

    registry: CollectorRegistry
    collector: NodeCollector
    allocations: Counter
    allocate_seconds: Histogram
    mismatches: Counter
    isolation: IsolationCollector
    holds: Counter
    tick_errors: Counter
    untrusted_records: Counter
    fallback_lists: Counter

    @classmethod
    def create(cls, node: str) -> "ManagerMetrics":
        registry = CollectorRegistry()
        collector = NodeCollector(node)
        registry.register(collector)
        allocations = Counter("qgpu_allocate_total", "Allocate calls by resource and result",
                              ["resource", "result"], registry=registry)
        seconds = Histogram("qgpu_allocate_duration_seconds", "time to answer one container's Allocate",
                            ["resource"], registry=registry,
                            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        mismatches = Counter("qgpu_allocation_owner_mismatch_total",
                             "PreStartContainer found kubelet gave the devices to another container than Allocate assumed",
                             ["resource"], registry=registry)
        isolation = IsolationCollector(node)
        registry.register(isolation)
        holds = Counter("qgpu_isolation_holds_total", "times the isolation loop held a container (SIGSTOP of its process groups)",
                        registry=registry)
        tick_errors = Counter("qgpu_isolation_tick_errors_total", "isolation loop ticks that failed (logged; the loop goes on)",
                              registry=registry)
        untrusted = Counter("qgpu_untrusted_records_total",
                            "allocation records Allocate refused as not qgpu's (unsigned, signed for another pod, node "
                            "or bind-time, or granting more than the pod asks for); they grant nothing",
                            ["resource"], registry=registry)
        fallback = Counter("qgpu_allocate_fallback_lists_total",
                           "Allocate or GetPreferredAllocation calls the watched pods could not answer, decided on a "
                           "LIST of the node's pods instead (a pod the watch had not delivered yet)",
                           ["resource"], registry=registry)
        return cls(registry, collector, allocations, seconds, mismatches, isolation, holds, tick_errors, untrusted,
                   fallback)
