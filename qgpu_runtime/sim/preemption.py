"""Replaying preemption on a trace: kube-scheduler's node-level choice against qgpu's card-level one.

The trace carries no priorities, so the mix is explicit and seeded (:class:`PriorityMix`): each
arriving pod is high-priority (priority 1) with probability ``high_fraction``, otherwise low-priority
(priority 0). Every pod keeps the class ``normal``: the trace's nodes carry no co-location label, and
with one class the chooser's order is by priority alone. Pods arrive in the study's order (:func:`replay.arrival_order`)
and never leave. A low-priority pod that fits nowhere fails. A high-priority pod that fits nowhere
triggers preemption, rounds of it as kube-scheduler retries, until it is placed or no node offers
victims (at most ``MAX_ROUNDS``):

- **node** (kube-scheduler alone): DefaultPreemption's dry run per node, over node totals (CPU,
  memory, GPU compute as ``qgpu-core`` counts it): remove every lower-priority pod, check the pod
  fits the totals, put pods back most important first (earlier arrival) while it still fits; a node
  with at least one victim is a candidate, nodes qgpu's filter calls unresolvable (wrong model, too
  few cards even empty) are not. kube-scheduler samples candidates (``max(100, 10 %)`` of the nodes,
  from a seeded offset) and picks the one with the fewest victims. The victims are evicted, then the
  pod is placed by the engine, at card level: evictions that free no usable card leave it pending
  and count as wasted.
- **extender** (as the roles wire qgpu): the same candidate nodes, but each node's victims are
  qgpu's preempt verb's (:func:`placement.preemption.choose_victims`, the extender's own code), and
  nodes where no set helps are dropped.
- **card** (what no HTTP extender can do): every node that could take the pod empty is weighed at
  card level, sampled as kube-scheduler samples, not only the nodes its totals flagged.

Reported per arm: high-priority pods placed directly, after preemption and left pending; pods
evicted, evicted per pod admitted by preemption, and wasted (evicted in rounds that admitted nothing).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from qgpu_runtime.model.requests import DEFAULT_LIMITS, CardLimits, PodRequest
from qgpu_runtime.placement.engine import Unschedulable, check_nodes, place
from qgpu_runtime.placement.policies import make_policy
from qgpu_runtime.placement.preemption import Candidate, FitBudget, choose_victims
from qgpu_runtime.placement.state import ClusterState, NodeSpec, Placement
from qgpu_runtime.sim.replay import ReplayOptions, arrival_order
from qgpu_runtime.sim.trace import TracePod

ARMS = ("node", "extender", "card")
MAX_ROUNDS = 8
HIGH, LOW = 1, 0
# DefaultPreemption's defaults: minCandidateNodesPercentage 10, minCandidateNodesAbsolute 100.
MIN_CANDIDATES_PCT, MIN_CANDIDATES_ABS = 10, 100


class MixError(ValueError):
    """A priority mix that cannot be replayed."""


@dataclass(frozen=True)
class PriorityMix:
    high_fraction: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.high_fraction < 1.0:
            raise MixError(f"--preemption={self.high_fraction}: the high-priority share must be above 0 and below 1")


@dataclass
class PreemptionResult:
    arm: str
    policy: str
    seed: int
    high_pods: int = 0
    low_pods: int = 0
    high_placed: int = 0  # directly, without preemption
    high_preempted_in: int = 0  # placed after preemption
    high_pending: int = 0
    low_failed: int = 0
    evicted: int = 0
    wasted: int = 0  # evicted in rounds after which the pod still did not fit
    seconds: float = 0.0

    @property
    def evicted_per_admission(self) -> float:
        return round(self.evicted / self.high_preempted_in, 4) if self.high_preempted_in else float("nan")

    def to_json(self) -> dict:
        return {"arm": self.arm, "policy": self.policy, "seed": self.seed, "high_pods": self.high_pods,
                "low_pods": self.low_pods, "high_placed": self.high_placed, "high_preempted_in": self.high_preempted_in,
                "high_pending": self.high_pending, "low_failed": self.low_failed, "evicted": self.evicted,
                "evicted_per_admission": self.evicted_per_admission, "wasted_evictions": self.wasted,
                "seconds": round(self.seconds, 2)}


class _Cluster:
    """The replay's state plus what preemption asks of it: the low-priority pods per node, in
    arrival order, and their totals."""

    def __init__(self, nodes: Sequence[NodeSpec], limits: CardLimits, options: ReplayOptions):
        self.state = ClusterState(nodes, limits, enforce_pod_limit=options.pod_limit)
        self.empty = ClusterState(nodes, limits, enforce_pod_limit=options.pod_limit)
        self.specs = {n.name: n for n in nodes}
        n = self.state.node_count
        self.keys_on: list[set[str]] = [set() for _ in range(n)]
        self.low_keys: list[list[str]] = [[] for _ in range(n)]
        self.low_gpu = np.zeros(n, dtype=np.int64)
        self.low_cpu = np.zeros(n, dtype=np.int64)
        self.low_mem = np.zeros(n, dtype=np.int64)

    def commit(self, key: str, placement: Placement, priority: int) -> None:
        self.state.commit(key, placement)
        row = self.state.index[placement.node]
        self.keys_on[row].add(key)
        if priority == LOW:
            self.low_keys[row].append(key)
            self.low_gpu[row] += placement.gpu_milli
            self.low_cpu[row] += placement.cpu_milli
            self.low_mem[row] += placement.memory_mib

    def evict(self, key: str) -> None:
        placement = self.state.release(key)
        if placement is None:
            return
        row = self.state.index[placement.node]
        self.keys_on[row].discard(key)
        self.low_keys[row].remove(key)
        self.low_gpu[row] -= placement.gpu_milli
        self.low_cpu[row] -= placement.cpu_milli
        self.low_mem[row] -= placement.memory_mib

    def unresolvable(self, req: PodRequest) -> np.ndarray:
        """[N] nodes the pod could not use even empty (qgpu's filter answers them unresolvable)."""
        return ~check_nodes(self.empty, req)[0].ok

    def node_level_victims(self, req: PodRequest, row: int) -> list[str] | None:
        """DefaultPreemption's victims on one node over node totals; None: no candidate."""
        s = self.state
        gpu = sum(c.cards * c.core_milli for c in req.containers)
        cpu_free, mem_free = int(s.cpu_free[row]), int(s.mem_free[row])
        gpu_free = int(np.where(s.exclusive[row], 0, s.core_free[row]).sum())
        free = [gpu_free + int(self.low_gpu[row]), cpu_free + int(self.low_cpu[row]), mem_free + int(self.low_mem[row])]
        need = (gpu, req.cpu_milli, req.memory_mib)
        if any(f < w for f, w in zip(free, need)):
            return None
        victims = []
        for key in self.low_keys[row]:  # most important first: earliest arrival
            p = s.bookings[key]
            back = (free[0] - p.gpu_milli, free[1] - p.cpu_milli, free[2] - p.memory_mib)
            if all(b >= w for b, w in zip(back, need)):
                free = list(back)  # reprieved
            else:
                victims.append(key)
        return victims or None

    def card_level_victims(self, req: PodRequest, row: int, policy, budget: FitBudget) -> list[str] | None:
        name = self.state.names[row]
        booked = {k: self.state.bookings[k] for k in self.keys_on[row]}
        candidates = [Candidate(k, k, LOW, booked[k]) for k in self.low_keys[row]]
        eviction = choose_victims(self.specs[name], booked, candidates, req, policy, self.state.limits, budget)
        if eviction is None or not eviction.victims:
            return None
        return [v.key for v in eviction.victims]


def _preempt(cluster: _Cluster, req: PodRequest, key: str, arm: str, policy, rng: random.Random,
             result: PreemptionResult) -> bool:
    wanted = max(MIN_CANDIDATES_ABS, cluster.state.node_count * MIN_CANDIDATES_PCT // 100)
    for _ in range(MAX_ROUNDS):
        usable = ~cluster.unresolvable(req) & (cluster.low_gpu > 0)
        rows = np.nonzero(usable)[0]
        offers: list[tuple[int, int, list[str]]] = []
        budget = FitBudget()
        start = rng.randrange(len(rows)) if len(rows) else 0
        for row in (int(r) for r in np.roll(rows, -start)):
            if arm == "card":
                victims = cluster.card_level_victims(req, row, policy, budget)
            else:
                victims = cluster.node_level_victims(req, row)
                if arm == "extender" and victims:  # a candidate of the dry run: qgpu names the victims
                    victims = cluster.card_level_victims(req, row, policy, budget)
            if victims:
                offers.append((len(victims), len(offers), victims))
                if len(offers) >= wanted:
                    break
        if not offers:
            return False
        _, _, victims = min(offers)  # fewest victims (all of one priority), first found
        for victim in victims:
            cluster.evict(victim)
        result.evicted += len(victims)
        try:
            placement = place(cluster.state, req, policy)
        except Unschedulable:
            result.wasted += len(victims)
            continue
        cluster.commit(key, placement, HIGH)
        return True
    return False


def replay_sequence(nodes: Sequence[NodeSpec], order: Sequence[tuple[TracePod, bool]], policy_name: str, arm: str,
                    sampling_seed: int = 0, options: ReplayOptions | None = None, limits: CardLimits = DEFAULT_LIMITS,
                    seed: int = 0) -> PreemptionResult:
    """Pods in the given order, each marked high-priority or not; see the module docstring."""
    options = options or ReplayOptions()
    if arm not in ARMS:
        raise ValueError(f"arm={arm!r}: one of {', '.join(ARMS)}")
    started = time.perf_counter()
    cluster = _Cluster(nodes, limits, options)
    policy = make_policy(policy_name)
    sampling = random.Random(sampling_seed)
    result = PreemptionResult(arm, policy_name, seed)
    for i, (pod, high) in enumerate(order):
        req = pod.request(options.gpu_memory_mib)
        policy.observe(req)
        key = f"{i}/{pod.name}"
        if high:
            result.high_pods += 1
        else:
            result.low_pods += 1
        try:
            cluster.commit(key, place(cluster.state, req, policy, card_choice=options.card_choice), HIGH if high else LOW)
        except Unschedulable:
            if not high:
                result.low_failed += 1
            elif req.wants_gpu and _preempt(cluster, req, key, arm, policy, sampling, result):
                result.high_preempted_in += 1
            else:
                result.high_pending += 1
            continue
        if high:
            result.high_placed += 1
    result.seconds = time.perf_counter() - started
    return result


def replay_preemption(nodes: Sequence[NodeSpec], pods: Sequence[TracePod], policy_name: str, seed: int, mix: PriorityMix,
                      arm: str, options: ReplayOptions | None = None, limits: CardLimits = DEFAULT_LIMITS) -> PreemptionResult:
    """The study's arrival order for ``seed`` (extended to 130 % of capacity), each pod drawn high or
    low from ``mix``; the same draws for every arm."""
    options = options or ReplayOptions()
    capacity = ClusterState(nodes, limits, enforce_pod_limit=options.pod_limit).gpu_capacity_milli()
    order = arrival_order(pods, seed, capacity, options.extend_to_pct)
    classes = random.Random(mix.seed)
    marked = [(pod, classes.random() < mix.high_fraction) for pod in order]
    return replay_sequence(nodes, marked, policy_name, arm, seed * 7919 + mix.seed, options, limits, seed)
