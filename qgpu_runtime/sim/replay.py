"""Replaying a trace through the placement engine.

:func:`replay_arrivals` reproduces the FGD study's experiment so our numbers compare with theirs:
seed a generator, sort pods by name and shuffle, extend the list to 130% of the cluster's GPU
capacity by sampling pods with replacement, submit them one at a time and never delete any. A pod
that fits nowhere is counted failed and skipped. After every pod the allocated and the arrived GPU
(failed pods included) are recorded and binned by integer arrived percent.

:func:`replay_times` honours creation and deletion times instead (pods leave), which the
published study never did.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from qgpu_runtime.model.requests import DEFAULT_LIMITS, CardLimits
from qgpu_runtime.placement.engine import CardChoice, Unschedulable, place
from qgpu_runtime.placement.policies import FragPolicy, Policy, WorkloadShapes, make_policy
from qgpu_runtime.placement.state import ClusterState, NodeSpec, Placement
from qgpu_runtime.sim.trace import TracePod

MAX_ARRIVED_PCT = 130


def _gpu_capacity(state: ClusterState) -> int:
    """The cluster's GPU in thousandths of a card; every figure of a replay is a share of it."""
    capacity = state.gpu_capacity_milli()
    if capacity <= 0:
        raise ValueError("no GPU capacity: no node has a card, and a replay measures allocation as a share of them")
    return capacity


@dataclass(frozen=True)
class ReplayOptions:
    """What the replay enforces beyond the study's model (both off by default, as in the study)."""

    gpu_memory_mib: int = 0  # GPU memory each sharing pod asks for; 0 leaves GPU memory out
    pod_limit: bool = False  # enforce the qGPU per-card pod-count limit
    extend_to_pct: int = MAX_ARRIVED_PCT
    # who picks the cards inside the policy's node: the policy, or first fit as DRA's allocator does
    card_choice: CardChoice = CardChoice.POLICY


@dataclass(frozen=True)
class ReplayEvent:
    """One step of a time-ordered replay, as an observer sees it after the state changed:
    ``arrive`` (placed), ``fail`` (fitted nowhere, ``placement`` None) or ``leave`` (released)."""

    time: int
    kind: str
    key: str
    placement: Placement | None
    state: ClusterState


@dataclass
class SeedResult:
    policy: str
    seed: int
    capacity_milli: int
    alloc_pct_by_bin: np.ndarray  # [0..extend_to_pct] mean allocation ratio (%) per arrived-% bin; NaN when empty
    failed_pods: int
    failed_gpu_milli: int
    pods: int
    frag_pct_at_100: float
    seconds: float = 0.0

    def unallocated_at(self, pct: int) -> float:
        value = self.alloc_pct_by_bin[pct]
        return float("nan") if np.isnan(value) else round(100.0 - float(value), 4)


def arrival_order(pods: Sequence[TracePod], seed: int, capacity_milli: int, extend_to_pct: int) -> list[TracePod]:
    """The study's submission order: sort by name, shuffle, then extend to ``extend_to_pct``% of
    capacity by sampling uniformly with replacement."""
    rng = random.Random(seed)
    order = sorted(pods, key=lambda p: p.name)
    rng.shuffle(order)
    target = capacity_milli * extend_to_pct / 100
    demand = sum(p.gpu_request_milli for p in order)
    if demand <= 0:
        return order
    base = list(order)
    while demand < target:
        pod = base[rng.randrange(len(base))]
        order.append(pod)
        demand += pod.gpu_request_milli
    return order


def fragmentation_pct(state: ClusterState, shapes: WorkloadShapes) -> float:
    """Expected fragment of the cluster's free GPU, in % of capacity, under ``shapes``."""
    meter = FragPolicy(shapes, model_pressure=False)
    free = np.where(state.exclusive, 0, state.core_free)
    full = state.card_free_whole().sum(axis=1)
    frag = meter.frag_of(free, full, state.cpu_free, state.mem_free, state, np.arange(state.node_count))
    return round(100.0 * float(frag.sum()) / max(state.gpu_capacity_milli(), 1), 4)


def _submit(state: ClusterState, policy, pod: TracePod, key: str, options: ReplayOptions) -> int | None:
    """Place and book one trace pod; its granted GPU (milli), or None when it fits nowhere."""
    req = pod.request(options.gpu_memory_mib)
    policy.observe(req)
    try:
        placement = place(state, req, policy, card_choice=options.card_choice)
    except Unschedulable:
        return None
    state.commit(key, placement)
    return placement.gpu_milli


def replay_arrivals(
    nodes: Sequence[NodeSpec],
    pods: Sequence[TracePod],
    policy_name: str,
    seed: int,
    options: ReplayOptions = ReplayOptions(),
    limits: CardLimits = DEFAULT_LIMITS,
    progress: Callable[[int], None] | None = None,
    policy_factory: Callable[[], Policy] | None = None,
    observer: Callable[[TracePod, int | None, float, ClusterState], None] | None = None,
) -> SeedResult:
    """``policy_factory`` replaces the named policy's constructor (a variant under test);
    ``policy_name`` still labels the result. ``observer`` is called after each pod with the pod,
    the GPU it was granted (None: it fitted nowhere), the arrived demand in % of capacity so far and
    the state (to read, not to change)."""
    state = ClusterState(nodes, limits, enforce_pod_limit=options.pod_limit)
    capacity = _gpu_capacity(state)
    policy = policy_factory() if policy_factory is not None else make_policy(policy_name)
    order = arrival_order(pods, seed, capacity, options.extend_to_pct)
    bins = options.extend_to_pct + 1
    sums = np.zeros(bins)
    counts = np.zeros(bins)
    observed = WorkloadShapes()
    allocated = arrived = failed = failed_gpu = 0
    frag_at_100 = float("nan")
    last_pct = prev_alloc_pct = 0.0
    for i, pod in enumerate(order):
        observed.observe(pod.request(options.gpu_memory_mib))
        arrived += pod.gpu_request_milli
        granted = _submit(state, policy, pod, f"{i}/{pod.name}", options)
        if granted is None:
            failed += 1
            failed_gpu += pod.gpu_request_milli
        else:
            allocated += granted
        arrived_pct = 100.0 * arrived / capacity
        alloc_pct = 100.0 * allocated / capacity
        # A large pod can jump arrived demand over whole bins; the allocation held during that
        # stretch was the one before the pod, so those bins take it.
        for skipped in range(int(last_pct) + 1, min(int(arrived_pct), bins)):
            if counts[skipped] == 0:
                sums[skipped] += prev_alloc_pct
                counts[skipped] += 1
        b = int(arrived_pct)
        if b < bins:
            sums[b] += alloc_pct
            counts[b] += 1
        last_pct, prev_alloc_pct = arrived_pct, alloc_pct
        if observer is not None:
            observer(pod, granted, arrived_pct, state)
        if np.isnan(frag_at_100) and arrived_pct >= 100.0:
            frag_at_100 = fragmentation_pct(state, observed)
        if progress is not None:
            progress(1)
    with np.errstate(invalid="ignore"):
        by_bin = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return SeedResult(policy_name, seed, capacity, by_bin, failed, failed_gpu, len(order), frag_at_100)


@dataclass
class TimedResult:
    policy: str
    capacity_milli: int
    pods: int
    failed_pods: int
    failed_gpu_milli: int
    mean_alloc_pct: float
    peak_alloc_pct: float
    samples: list[tuple[int, float]] = field(default_factory=list)  # (time, allocation %)


def replay_times(
    nodes: Sequence[NodeSpec],
    pods: Sequence[TracePod],
    policy_name: str,
    options: ReplayOptions = ReplayOptions(),
    limits: CardLimits = DEFAULT_LIMITS,
    progress: Callable[[int], None] | None = None,
    observer: Callable[[ReplayEvent], None] | None = None,
) -> TimedResult:
    """Pods arrive at ``creation_time`` and leave at ``deletion_time``; a pod that does not fit on
    arrival fails (no queueing). The allocation ratio is averaged over time between events.
    ``observer`` sees every event after the state changed (invariant checks)."""
    missing = [p.name for p in pods if p.creation_time is None]
    if missing:
        raise ValueError(f"--replay-times needs creation_time for every pod; missing for {missing[0]} and {len(missing) - 1} more")
    state = ClusterState(nodes, limits, enforce_pod_limit=options.pod_limit)
    capacity = _gpu_capacity(state)
    policy = make_policy(policy_name)
    # Events name pods by their place in arrival order, not by name: two pods of one name are
    # still two pods (the trace loader refuses such files, a caller's list may not).
    arriving = sorted(pods, key=lambda p: (p.creation_time, p.name))
    events: list[tuple[int, int, int, str]] = []  # (time, kind 0=leave 1=arrive, seq, name)
    for i, pod in enumerate(arriving):
        events.append((pod.creation_time or 0, 1, i, pod.name))
    heapq.heapify(events)
    allocated = failed = failed_gpu = 0
    area = 0.0
    peak = 0.0
    first = last = events[0][0] if events else 0
    samples: list[tuple[int, float]] = []
    while events:
        t, kind, seq, name = heapq.heappop(events)
        area += (t - last) * allocated
        last = t
        pod = arriving[seq]
        key = f"{seq}/{name}"
        if kind == 0:
            released = state.release(key)
            if released is not None:
                allocated -= released.gpu_milli
            if observer is not None:
                observer(ReplayEvent(t, "leave", key, released, state))
        else:
            granted = _submit(state, policy, pod, key, options)
            if granted is None:
                failed += 1
                failed_gpu += pod.gpu_request_milli
            else:
                allocated += granted
                if pod.deletion_time is not None and pod.deletion_time >= t:
                    heapq.heappush(events, (pod.deletion_time, 0, seq, name))
            if observer is not None:
                observer(ReplayEvent(t, "fail" if granted is None else "arrive", key, state.bookings.get(key), state))
            if progress is not None:
                progress(1)
        pct = 100.0 * allocated / capacity
        peak = max(peak, pct)
        samples.append((t, pct))
    span = max(last - first, 1)
    return TimedResult(policy_name, capacity, len(pods), failed, failed_gpu, round(100.0 * area / span / capacity, 4), round(peak, 4), samples)
