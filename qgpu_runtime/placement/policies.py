"""Placement policies: how to rank the nodes and cards that can take a pod.

Every policy answers the same questions, in costs (lower wins):
- ``shared_card_cost``: for a pod sharing one card, the cost of each (node, card) pair;
- ``exclusive_cost``: for a pod taking whole cards, the cost of each node given the cards taken;
- ``state_cost``: the cost of the state a multi-container pod would leave behind on a node;
- ``cpu_only_cost``: for a pod with no GPU request (the trace has these), the cost of each node.

Policies:
- ``binpack``: fill the fullest node and the fullest card first (keeps whole cards and nodes free).
- ``spread``: the emptiest node and card first (less interference between tenants).
- ``bestfit``: the published baseline of the FGD study — node cost 0.5·CPU left / 128 cores +
  0.5·GPU left / 8 GPUs, best-fit card inside the node. Kept for calibration against their numbers.
- ``frag``: fragmentation-aware; see :class:`FragPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, PodRequest
from qgpu_runtime.placement.state import ClusterState

INF = np.inf
# A card-level term must never outweigh a node-level difference of one thousandth of a card.
_CARD_WEIGHT = 1.0 / (4 * CORE_MILLI_PER_CARD)


@dataclass(frozen=True)
class SharedCandidates:
    """Feasible (node, card) pairs for one shared container: ``fit`` is [rows, cards]."""

    rows: np.ndarray
    fit: np.ndarray
    core: int
    cpu: int
    mem: int
    binpack_cards: bool = False
    spread_cards: bool = False


class Policy(Protocol):
    name: str

    def shared_card_cost(self, state: ClusterState, cand: SharedCandidates) -> np.ndarray: ...

    def exclusive_cost(self, state: ClusterState, rows: np.ndarray, take: np.ndarray, req: PodRequest) -> np.ndarray: ...

    def state_cost(self, state: ClusterState, rows: np.ndarray, card_free_after: np.ndarray, req: PodRequest) -> np.ndarray: ...

    def cpu_only_cost(self, state: ClusterState, rows: np.ndarray, req: PodRequest) -> np.ndarray: ...

    def observe(self, req: PodRequest) -> None: ...


def _card_free(state: ClusterState, rows: np.ndarray) -> np.ndarray:
    """[R, C] free compute per card, zero on exclusively held or missing cards."""
    return np.where(state.exclusive[rows], 0, state.core_free[rows])


class _NodeLevelPolicy:
    """Policies whose node cost depends only on the free CPU and GPU a placement leaves."""

    name = "base"
    card_sign = 1.0  # +1: prefer the card left fullest (best fit); -1: the emptiest

    def node_cost(self, state: ClusterState, rows: np.ndarray, cpu_after: np.ndarray, gpu_after: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def observe(self, req: PodRequest) -> None:
        """Node-level policies learn nothing from arrivals."""

    def shared_card_cost(self, state: ClusterState, cand: SharedCandidates) -> np.ndarray:
        rows = cand.rows
        gpu_after = state.gpu_free_milli()[rows] - cand.core
        node = self.node_cost(state, rows, state.cpu_free[rows] - cand.cpu, gpu_after)
        sign = -1.0 if cand.spread_cards else (1.0 if cand.binpack_cards else self.card_sign)
        card_after = state.core_free[rows] - cand.core
        return np.where(cand.fit, node[:, None] + sign * _CARD_WEIGHT * card_after, INF)

    def exclusive_cost(self, state: ClusterState, rows: np.ndarray, take: np.ndarray, req: PodRequest) -> np.ndarray:
        gpu_after = state.gpu_free_milli()[rows] - take.sum(axis=1) * CORE_MILLI_PER_CARD
        return self.node_cost(state, rows, state.cpu_free[rows] - req.cpu_milli, gpu_after)

    def state_cost(self, state: ClusterState, rows: np.ndarray, card_free_after: np.ndarray, req: PodRequest) -> np.ndarray:
        return self.node_cost(state, rows, state.cpu_free[rows] - req.cpu_milli, card_free_after.sum(axis=1))

    def cpu_only_cost(self, state: ClusterState, rows: np.ndarray, req: PodRequest) -> np.ndarray:
        return self.node_cost(state, rows, state.cpu_free[rows] - req.cpu_milli, state.gpu_free_milli()[rows])


class BinpackPolicy(_NodeLevelPolicy):
    name = "binpack"

    def node_cost(self, state, rows, cpu_after, gpu_after):
        cpu_share = cpu_after / np.maximum(state.cpu_cap[rows], 1)
        return gpu_after + cpu_share * 0.5


class SpreadPolicy(_NodeLevelPolicy):
    name = "spread"
    card_sign = -1.0

    def node_cost(self, state, rows, cpu_after, gpu_after):
        cpu_share = cpu_after / np.maximum(state.cpu_cap[rows], 1)
        return -(gpu_after + cpu_share * 0.5)


class BestFitPolicy(_NodeLevelPolicy):
    """The FGD study's best-fit baseline, with its normalisers (a 128-core, 8-GPU node)."""

    name = "bestfit"

    def node_cost(self, state, rows, cpu_after, gpu_after):
        return 0.5 * cpu_after / 128_000 + 0.5 * gpu_after / (8 * CORE_MILLI_PER_CARD)


@dataclass
class WorkloadShapes:
    """The distribution of pod shapes seen so far, which the frag policy plans for.

    A shape is (cards, core per card, CPU, GPU models accepted or None for any); host memory is
    rarely what strands GPUs. The most
    common shapes covering ``coverage`` of the observed pods (at most ``max_shapes``) are kept.
    The defaults keep the common shapes only, which is what the replay's fragmentation meter
    reports; the frag policy plans with every shape (see :data:`PLANNING_SHAPES`). Counting starts
    from nothing; the distribution follows the workload the scheduler actually sees.

    ``weigh``: what a shape's weight is. ``pods`` (the meter, FGD's measure): its pod count.
    ``demand`` (what frag plans with): the GPU its pods ask for, pod count times cards times
    thousandths per card, so the weight of a shape is the chance that a unit of arriving GPU
    demand comes in that shape; a CPU-only shape weighs the GPU its CPU would feed at the
    workload's CPU per GPU (:meth:`cpu_per_gpu`). Counting pods, a shape of eight whole cards
    weighs what one pod sharing a fifth of a card weighs, though one of its pods failing loses forty
    times the GPU; where such pods carry much of the demand, the pod-count measure carves up the
    whole nodes they need long before the cluster fills (docs/benchmarks.md, issue 27).
    """

    coverage: float = 0.95
    max_shapes: int = 48
    refresh_growth: float = 0.01
    weigh: str = "pods"
    counts: dict[tuple[int, int, int, frozenset[str] | None], int] = field(default_factory=dict)
    total: int = 0
    cpu_milli: int = 0  # CPU asked by every observed pod, CPU-only pods included
    gpu_milli: int = 0  # GPU (thousandths of a card) asked by every observed pod
    _built_at: int = -1
    _arrays: tuple[np.ndarray, ...] = ()

    def observe(self, req: PodRequest) -> None:
        if req.whole_node:
            return
        if req.containers:
            c = req.containers[0]
            cards = sum(x.cards for x in req.containers) if c.exclusive else 1
            core = c.core_milli if len(req.containers) == 1 else max(x.core_milli for x in req.containers)
        else:
            cards, core = 0, 0
        key = (cards, core, req.cpu_milli, req.models if cards else None)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.total += 1
        self.cpu_milli += req.cpu_milli
        self.gpu_milli += cards * core

    def cpu_per_gpu(self) -> float:
        """CPU (milli-cores) the workload asks per thousandth of a card it asks; 0 before any GPU.

        CPU-only pods count: they draw on the same nodes' CPU, so a node has to keep CPU for them
        as well as for the pods that will take its free cards."""
        return self.cpu_milli / self.gpu_milli if self.gpu_milli else 0.0

    def _demand_per_pod(self, keys: np.ndarray) -> np.ndarray:
        """[M] GPU (thousandths of a card) one pod of each shape asks for; for a CPU-only shape the
        GPU its CPU feeds at the observed CPU per GPU. Rounded to whole thousandths, so equal
        states still score exactly equal."""
        gpu = keys[:, 0] * keys[:, 1]
        rho = self.cpu_per_gpu()
        fed = keys[:, 2] / rho if rho else np.zeros(len(keys))
        return np.rint(np.where(gpu > 0, gpu, fed))

    def arrays(self) -> tuple:
        """(cards, core, cpu, mem, pod count, accepted models) of the kept shapes; rebuilt when the
        sample grew. The models are a tuple of frozensets (None: any model)."""
        if self._built_at < 0 or self.total > self._built_at * (1 + self.refresh_growth):
            ranked = sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0][:3], sorted(kv[0][3] or ())))
            kept, cum = [], 0
            for key, n in ranked[: self.max_shapes]:
                kept.append((key, n))
                cum += n
                if cum >= self.coverage * self.total:
                    break
            if not kept:
                self._arrays = tuple(np.zeros(0) for _ in range(5)) + ((),)
            else:
                keys = np.array([k[:3] for k, _ in kept], dtype=np.int64)
                weight = np.array([n for _, n in kept], dtype=float)
                if self.weigh == "demand":
                    weight = weight * self._demand_per_pod(keys)
                models = tuple(k[3] for k, _ in kept)
                self._arrays = (keys[:, 0], keys[:, 1], keys[:, 2], np.zeros(len(keys), dtype=np.int64), weight, models)
            self._built_at = self.total
        return self._arrays


# What the frag policy plans with: every observed shape. The rare shapes are the big, CPU-hungry
# ones (eight whole cards and 64-120 cores) whose needs keep whole nodes and their CPU intact;
# cutting them off lets every node be carved up. Keeping them is cheap because a decision costs
# per distinct per-card need plus one lookup by CPU, not per shape; the cap only bounds a
# pathological workload. Shapes weigh the GPU demand they bring, not their pod count (see
# WorkloadShapes.weigh): the plan is for the demand to come, and a multi-card pod is much of it.
PLANNING_SHAPES = {"coverage": 1.0, "max_shapes": 512, "weigh": "demand"}


@dataclass(frozen=True)
class _FragTables:
    """Lookup tables over a card's free thousandths (0..1000) for each distinct per-card need."""

    needs: np.ndarray  # [U] per-card needs of the shapes, the whole card (1000) last
    full_u: int
    below: np.ndarray  # [1001, U] free if free < need else 0
    fits: np.ndarray  # [1001, U] 1 if free >= need
    share_onehot: np.ndarray  # [M, U] sharing shape m has need u
    whole_onehot: np.ndarray  # [M, K] whole-card shape m takes whole_cards[k] cards
    whole_cards: np.ndarray  # [K]
    cpu_only: np.ndarray  # [M] shape asks for no GPU
    cpu: np.ndarray
    mem: np.ndarray
    p: np.ndarray  # [M] shape weights (pod counts, or GPU demand): whole numbers, so equal states score exactly equal
    allowed: np.ndarray  # [G, M] shape m may run on nodes of model group g
    weight: np.ndarray  # [M] p, times each shape's pressure on the cards it may use (see build)
    scale: float  # 1 / total count, turning count-weighted sums into expectations
    # The shapes' weights per need summed over every shape whose CPU is at most a threshold: a
    # node's weights are then one row lookup by its free CPU instead of a [nodes x shapes] product.
    cpu_steps: np.ndarray  # [D] distinct CPU requests, ascending
    # One such table per model group: a shape that names GPU models counts only on nodes that
    # carry one of them; elsewhere the node's whole free GPU is a fragment for it.
    cum_share: np.ndarray  # [G, D + 1, U] weights of sharing shapes asking at most cpu_steps[i - 1]
    cum_whole: np.ndarray  # [G, D + 1, K]
    cum_cpu_only: np.ndarray  # [G, D + 1]

    @classmethod
    def build(cls, cards: np.ndarray, core: np.ndarray, cpu: np.ndarray, mem: np.ndarray, p: np.ndarray,
              models: tuple = (), groups: tuple[frozenset[str] | None, ...] = (None,),
              group_cards: np.ndarray | None = None) -> "_FragTables":
        """``group_cards`` (cards per model group) turns on the pressure weighting: a shape that may
        use only a part of the cluster's cards counts for total cards / cards it may use times its
        pods. Its demand falls on those cards alone, so a free card it may use is worth that much
        more to it, and taking such a card for a pod that could go anywhere costs that much more.
        With no model requirements every pressure is 1 and the measure is the plain expected
        fragment."""
        share = (cards >= 1) & (core < CORE_MILLI_PER_CARD)
        whole = (cards >= 1) & (core >= CORE_MILLI_PER_CARD)
        needs = np.array(sorted(set(core[share].tolist())) + [CORE_MILLI_PER_CARD], dtype=np.int64)
        values = np.arange(CORE_MILLI_PER_CARD + 1)[:, None]
        below = np.where(values < needs[None, :], values, 0).astype(float)
        fits = (values >= needs[None, :]).astype(np.int64)
        share_onehot = (share[:, None] & (core[:, None] == needs[None, :])).astype(float)
        whole_cards = np.array(sorted(set(cards[whole].tolist())), dtype=np.int64)
        whole_onehot = (whole[:, None] & (cards[:, None] == whole_cards[None, :])).astype(float)
        cpu_only = (cards == 0).astype(float)
        steps = np.unique(cpu)
        rank = np.searchsorted(steps, cpu)
        at_step = np.zeros((len(steps) + 1, len(p)))
        at_step[rank + 1, np.arange(len(p))] = p
        below_or_at = np.cumsum(at_step, axis=0)  # [D + 1, M]
        allowed = np.ones((len(groups), len(p)))
        for g, carried in enumerate(groups):
            if carried is None:  # a group that stands for every model
                continue
            for m, accepted in enumerate(models):
                if accepted is not None and not (accepted & carried):
                    allowed[g, m] = 0.0
        weight = p.astype(float)
        if group_cards is not None and len(p):
            usable = allowed.T @ group_cards  # [M] cards each shape may use
            pressure = np.where(usable > 0, group_cards.sum() / np.maximum(usable, 1), 0.0)
            weight = weight * pressure
            at_step = np.zeros((len(steps) + 1, len(p)))
            at_step[rank + 1, np.arange(len(p))] = weight
            below_or_at = np.cumsum(at_step, axis=0)
        per_group = below_or_at[None, :, :] * allowed[:, None, :]  # [G, D + 1, M]
        return cls(needs, len(needs) - 1, below, fits, share_onehot, whole_onehot, whole_cards,
                   cpu_only, cpu, mem, p, allowed, weight, 1.0 / max(float(p.sum()), 1.0), steps, per_group @ share_onehot,
                   per_group @ whole_onehot, per_group @ cpu_only)

    def after_deltas(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """How a card's contribution changes when ``g`` thousandths are taken from it, by its free."""
        values = np.arange(CORE_MILLI_PER_CARD + 1)
        after = np.clip(values - g, 0, None)
        return self.below[after] - self.below, self.fits[after] - self.fits


class FragPolicy:
    """Fragmentation-aware placement.

    A card's free compute is a *fragment* for a shape when that shape cannot use it: the card has
    less free than the shape needs per card, or the node lacks the CPU, memory, whole cards or
    model for the shape at all (then every free card on the node is a fragment for it). A node's
    fragmentation is the expected fragment over the observed shape distribution, and the policy
    picks the (node, card) whose placement adds the least of it — the idea published as FGD.

    That measure alone misses the coupling between CPU and GPU: it sees a node's CPU run out only
    when it drops below some shape's exact request, so pods that ask for much CPU per card (and
    pods with no GPU at all) drain nodes whose cards are then left free with nothing to feed them;
    on the public trace that is where most of the loss of best-fit-like policies sits. So each
    choice is also charged for the GPU it strands behind CPU: free GPU beyond what the node's free
    CPU can feed at the CPU-per-GPU ratio of the observed workload (CPU-only pods included, since
    they draw on the same CPU; counting only GPU pods' CPU left more stranded). The ratio is learned
    from arrivals like the shapes, so nothing is fitted to a trace, and a stranded thousandth of a
    card costs the same as a fragmented one (``cpu_balance`` = 1): both are capacity lost.

    The expectation is over the GPU demand to come, not over pods: each shape weighs the GPU its
    pods ask for (CPU-only shapes the GPU their CPU would feed). Weighed by pod count, a shape of
    eight whole cards counts no more than a pod sharing a fifth of a card; where multi-card pods
    carry much of the demand the policy then takes apart the whole 8-card nodes while the cluster
    is half empty, and those pods fail from about 70 % arrived on: the loss shows at arrived
    100 % and is filled in only later (issue 27; docs/benchmarks.md has the figures).

    Among choices left equal, the policy packs (positive ``tie_weight``: the least capacity left
    wins). Spreading ties opens new nodes early and takes apart the whole nodes that multi-card
    pods need later; the balance term already keeps packing from exhausting a node's CPU.
    """

    name = "frag"

    def __init__(self, shapes: WorkloadShapes | None = None, tie_weight: float = 0.05, cpu_balance: float = 1.0,
                 model_pressure: bool = True):
        self.shapes = shapes or WorkloadShapes(**PLANNING_SHAPES)
        self.tie_weight = tie_weight
        self.cpu_balance = cpu_balance
        self.model_pressure = model_pressure
        self._cache: tuple[tuple, tuple, _FragTables] | None = None

    def observe(self, req: PodRequest) -> None:
        self.shapes.observe(req)

    # -- fragmentation of given states -------------------------------------------------------
    #
    # For a node with card frees F_j, total T and enough CPU/memory/whole cards for shape m, the
    # fragment is S_m = sum of F_j below the shape's per-card need; otherwise it is all of T. With
    # p_m the shape weights, frag = T - sum_m p_m ok_m (T - S_m). S and "does any card fit" depend
    # on the shape only through its per-card need, so they are computed once per distinct need
    # (a handful) from lookup tables indexed by a card's free thousandths, and the shapes' weights
    # are folded per need after the CPU/memory check. That keeps a whole (node x card) scoring
    # pass to a few array operations.

    def _tables(self, state: ClusterState | None = None) -> _FragTables:
        """The lookup tables for the shapes seen so far, on ``state``'s model groups (without a
        state, one group that carries every model: model requirements are then not weighed)."""
        arrays = self.shapes.arrays()
        groups = tuple(state.model_groups) if state is not None else (None,)
        if self._cache is None or self._cache[0] is not arrays or self._cache[1] != groups:
            cards = state.group_cards() if state is not None and self.model_pressure else None
            self._cache = (arrays, groups, _FragTables.build(*arrays, groups=groups, group_cards=cards))
        return self._cache[2]

    @staticmethod
    def _groups(state: ClusterState | None, rows: np.ndarray | None, count: int) -> np.ndarray:
        if state is None or rows is None:
            return np.zeros(count, dtype=np.int64)
        return state.node_group[rows]

    def _weights(self, t: "_FragTables", cpu: np.ndarray, mem: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per node, the weight of the shapes it has CPU, memory and a GPU model for: by need, by
        whole-card count, and of CPU-only shapes."""
        if t.mem.any():
            ok = ((cpu[:, None] >= t.cpu[None, :]) & (mem[:, None] >= t.mem[None, :])) * t.weight[None, :] * t.allowed[groups]
            return ok @ t.share_onehot, ok @ t.whole_onehot, ok @ t.cpu_only
        at = np.searchsorted(t.cpu_steps, cpu, side="right")
        if (mem < 0).any():  # a node short of memory fits nothing
            at = np.where(mem < 0, 0, at)
        return t.cum_share[groups, at], t.cum_whole[groups, at], t.cum_cpu_only[groups, at]

    def frag_of(self, free: np.ndarray, full: np.ndarray, cpu: np.ndarray, mem: np.ndarray,
                state: ClusterState | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """[R] expected fragment (thousandths of a card) of nodes with card frees ``free`` [R, C].
        ``state`` and ``rows`` name the nodes, so that shapes asking for other GPU models count
        the node's free GPU as a fragment; without them every shape may use every node."""
        t = self._tables(state)
        if not len(t.p):
            return np.zeros(len(free))
        below_sum, fit_count = self._card_sums(t, free)
        groups = self._groups(state, rows, len(free))
        return self._frag(t, free.sum(axis=1).astype(float), below_sum, fit_count, full, cpu, mem, groups)

    @staticmethod
    def _card_sums(t: "_FragTables", free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[R, U] per need: free compute on cards below the need, and the count of cards that fit it."""
        return t.below[free].sum(axis=1), t.fits[free].sum(axis=1)

    def _frag(self, t: "_FragTables", total: np.ndarray, below_sum: np.ndarray, fit_count: np.ndarray,
              full: np.ndarray, cpu: np.ndarray, mem: np.ndarray, groups: np.ndarray) -> np.ndarray:
        w_share, w_whole, w_cpu = self._weights(t, cpu, mem, groups)
        gap = total[:, None] - below_sum
        whole_ok = (full[:, None] >= t.whole_cards[None, :]) * w_whole
        used = w_cpu * total + (w_share * (fit_count > 0) * gap).sum(axis=1) + gap[:, t.full_u] * whole_ok.sum(axis=1)
        return total - t.scale * used

    def _node_parts(self, state: ClusterState, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        free = _card_free(state, rows)
        full = state.card_free_whole()[rows].sum(axis=1)
        return free, full

    def stranded(self, gpu_free: np.ndarray, cpu_free: np.ndarray) -> np.ndarray:
        """Free GPU (thousandths) that the node's free CPU cannot feed at the workload's CPU per GPU."""
        rho = self.shapes.cpu_per_gpu()
        if not rho:
            return np.zeros(np.shape(gpu_free))
        return np.maximum(0.0, gpu_free - cpu_free / rho)

    def _balance(self, gpu_before: np.ndarray, cpu_before: np.ndarray, gpu_after: np.ndarray, cpu_after: np.ndarray) -> np.ndarray:
        if not self.cpu_balance:
            return np.zeros(np.shape(gpu_after))
        return self.cpu_balance * (self.stranded(gpu_after, cpu_after) - self.stranded(gpu_before, cpu_before))

    def _tie(self, state: ClusterState, rows: np.ndarray, cpu_after: np.ndarray, gpu_after: np.ndarray) -> np.ndarray:
        return self.tie_weight * (0.5 * cpu_after / np.maximum(state.cpu_cap[rows], 1)
                                  + 0.5 * gpu_after / np.maximum(state.n_cards[rows] * CORE_MILLI_PER_CARD, 1))

    # -- policy interface ---------------------------------------------------------------------

    def shared_card_cost(self, state: ClusterState, cand: SharedCandidates) -> np.ndarray:
        rows, g = cand.rows, cand.core
        t = self._tables(state)
        free, full = self._node_parts(state, rows)
        cpu_after = state.cpu_free[rows] - cand.cpu
        mem_after = state.mem_free[rows] - cand.mem
        total_after = (free.sum(axis=1) - g).astype(float)
        tie = self._tie(state, rows, cpu_after, total_after)
        tie = tie + self._balance(free.sum(axis=1), state.cpu_free[rows], total_after, cpu_after)
        card_term = _CARD_WEIGHT * (free - g) * (-1.0 if cand.spread_cards else 1.0)
        if not len(t.p):
            return np.where(cand.fit, tie[:, None] + card_term, INF)
        before = self.frag_of(free, full, state.cpu_free[rows], state.mem_free[rows], state, rows)
        # Cards of one node with the same free compute (and wholeness) score the same, so each
        # distinct one is scored once and its cost copied to its twins: an empty 8-card node is one
        # candidate, not eight, which is most of the work on a large, lightly used cluster.
        whole = state.card_free_whole()[rows]
        key = free + (CORE_MILLI_PER_CARD + 1) * whole
        twin = (key[:, :, None] == key[:, None, :]) & cand.fit[:, None, :]
        first = twin.argmax(axis=2)  # [R, C] lowest fitting slot with the same key
        ri, ci = np.nonzero(cand.fit & (first == np.arange(free.shape[1])[None, :]))
        f = free[ri, ci]
        # Only the chosen card changes: correct the node's per-need sums by that one card.
        below_delta, fits_delta = t.after_deltas(g)
        below_a = t.below[free].sum(axis=1)[ri] + below_delta[f]  # [K, U]
        usable_a = (t.fits[free].sum(axis=1)[ri] + fits_delta[f]) > 0
        w_share, w_whole, w_cpu = self._weights(t, cpu_after, mem_after, state.node_group[rows])
        gap_a = total_after[ri, None] - below_a
        share_term = (w_share[ri] * usable_a * gap_a).sum(axis=1)
        full_a = full[ri] - (whole[ri, ci] & (g > 0))
        whole_w = ((full_a[:, None] >= t.whole_cards[None, :]) * w_whole[ri]).sum(axis=1)
        after = total_after[ri] - t.scale * (total_after[ri] * w_cpu[ri] + share_term + gap_a[:, t.full_u] * whole_w)
        scored = np.full(free.shape, INF)
        scored[ri, ci] = after - before[ri] + tie[ri] + card_term[ri, ci]
        return np.where(cand.fit, scored[np.arange(len(rows))[:, None], first], INF)

    def exclusive_cost(self, state: ClusterState, rows: np.ndarray, take: np.ndarray, req: PodRequest) -> np.ndarray:
        free, full = self._node_parts(state, rows)
        free_a = np.where(take, 0, free)
        cpu_after = state.cpu_free[rows] - req.cpu_milli
        balance = self._balance(free.sum(axis=1), state.cpu_free[rows], free_a.sum(axis=1), cpu_after)
        tie = self._tie(state, rows, cpu_after, free_a.sum(axis=1))
        t = self._tables(state)
        if not len(t.p):
            return balance + tie
        groups = state.node_group[rows]
        # Taken cards are whole: they hold no compute below any need and each fits every need, so
        # the after-state's sums follow from the node's without scoring its cards again.
        below_sum, fit_count = self._card_sums(t, free)
        fit_a = fit_count - take.sum(axis=1)[:, None]
        before = self._frag(t, free.sum(axis=1).astype(float), below_sum, fit_count, full, state.cpu_free[rows],
                            state.mem_free[rows], groups)
        after = self._frag(t, free_a.sum(axis=1).astype(float), below_sum, fit_a, full - take.sum(axis=1), cpu_after,
                           state.mem_free[rows] - req.memory_mib, groups)
        return after - before + balance + tie

    def state_cost(self, state: ClusterState, rows: np.ndarray, card_free_after: np.ndarray, req: PodRequest) -> np.ndarray:
        free, full = self._node_parts(state, rows)
        before = self.frag_of(free, full, state.cpu_free[rows], state.mem_free[rows], state, rows)
        full_a = (card_free_after == CORE_MILLI_PER_CARD).sum(axis=1)
        cpu_after = state.cpu_free[rows] - req.cpu_milli
        after = self.frag_of(card_free_after, full_a, cpu_after, state.mem_free[rows] - req.memory_mib, state, rows)
        balance = self._balance(free.sum(axis=1), state.cpu_free[rows], card_free_after.sum(axis=1), cpu_after)
        return after - before + balance + self._tie(state, rows, cpu_after, card_free_after.sum(axis=1))

    def cpu_only_cost(self, state: ClusterState, rows: np.ndarray, req: PodRequest) -> np.ndarray:
        free, full = self._node_parts(state, rows)
        cpu_after = state.cpu_free[rows] - req.cpu_milli
        total = free.sum(axis=1)
        balance = self._balance(total, state.cpu_free[rows], total, cpu_after)
        tie = self._tie(state, rows, cpu_after, total)
        t = self._tables(state)
        if not len(t.p):
            return balance + tie
        groups = state.node_group[rows]
        # The cards do not change, only the CPU and memory that decide which shapes still fit.
        below_sum, fit_count = self._card_sums(t, free)
        before = self._frag(t, total.astype(float), below_sum, fit_count, full, state.cpu_free[rows], state.mem_free[rows], groups)
        after = self._frag(t, total.astype(float), below_sum, fit_count, full, cpu_after, state.mem_free[rows] - req.memory_mib, groups)
        return after - before + balance + tie


POLICIES = {"binpack": BinpackPolicy, "spread": SpreadPolicy, "bestfit": BestFitPolicy, "frag": FragPolicy}


def make_policy(name: str) -> Policy:
    """A fresh policy instance by name; unknown names fail listing the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy {name!r} is unknown; choose one of {', '.join(sorted(POLICIES))}") from None
