"""The placement engine: which node and which cards a pod gets.

One engine serves three callers — the scheduler extender, the trace simulator and standalone
`qgpu run` — so a placement decision means the same everywhere. It is pure: given a
:class:`ClusterState`, a :class:`PodRequest` and a policy it computes a :class:`Placement` and
changes nothing; booking is the caller's explicit ``state.commit``.

How a decision is made:
1. Node checks, vectorised over all nodes: GPU model, T9k allocation mode, co-location class,
   CPU, memory, then card fit per container. Each failing node gets a reason a person can read.
2. For the common case (one GPU container) every feasible (node, card) pair is scored in one
   vector pass by the policy; multi-container pods are placed container by container per node.
3. Lowest cost wins; ties go to the lower node index, then the lower card slot, so the same input
   always gives the same answer.

``card_choice`` says who picks the cards inside the chosen node. ``POLICY`` (the default): the
policy, as the device-plugin path does, where qgpu's allocation record names the cards. ``FIRST_FIT``:
the DRA allocator of kube-scheduler, which qgpu cannot steer inside a node — it takes the first
device, in slice order (card index order: the node manager publishes one device per card, by index),
whose free capacity (core, memory, pod slots) holds the request. qgpu's extender then only ranks
nodes, and it ranks each by the card the allocator will take there.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from qgpu_runtime.contract.record import ContainerDialect
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, AppClass, ContainerRequest, PodRequest, percent_share_memory_mib
from qgpu_runtime.placement.policies import Policy, SharedCandidates
from qgpu_runtime.placement.state import ALLOC_MODES, CardShare, ClusterState, ContainerPlacement, Placement

MAX_SCORE = 10

REASONS = {
    1: "GPU model not allowed for this pod",
    2: "node allocation mode does not match the T9k request",
    3: "online/offline pods need a node labelled mixed-qgpu-enable=enable",
    4: "insufficient CPU",
    5: "insufficient memory",
    6: "no card has enough free core, memory and pod slots",
    7: "not enough whole free cards",
    8: "the whole node is not free",
    9: "node has no GPUs",
    10: "node unknown to qgpu (no GPU inventory reported yet)",
    11: "the whole node has more cards than one pod may take",
}
UNKNOWN_NODE = 10
WHOLE_NODE_TOO_LARGE = 11
"""A whole-node request (T9k ``nvidia-gpu-node``) takes every card of the node, and is charged
against the namespace's GPU quota as the most cards one pod may take (``CardLimits.max_cards_per_node``,
webhook/podquota.py), the limit every other request obeys too: a node with more cards would grant
more than was charged, so it is refused."""


def reason(state: ClusterState, row: int, code: int) -> str:
    """Why the node at state ``row`` failed with ``code``, in words a person reads in the pod's events
    (``row`` -1: a node the state does not know)."""
    if code == WHOLE_NODE_TOO_LARGE and row >= 0:
        return (f"the whole node has {int(state.n_cards[row])} cards and one pod may take at most "
                f"{state.limits.max_cards_per_node} (CardLimits.max_cards_per_node)")
    return REASONS[code]


class CardChoice(str, Enum):
    """Who picks the cards inside the chosen node (see the module docstring)."""

    POLICY = "policy"
    FIRST_FIT = "first-fit"


class Unschedulable(Exception):
    """No node can take the pod; ``reasons`` maps each node to why not."""

    def __init__(self, pod: str, reasons: dict[str, str]):
        self.pod = pod
        self.reasons = reasons
        counts: dict[str, int] = {}
        for reason in reasons.values():
            counts[reason] = counts.get(reason, 0) + 1
        summary = ", ".join(f"{n} {r}" for r, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        super().__init__(f"0/{len(reasons)} nodes can take {pod}: {summary or 'no nodes'}")


@dataclass(frozen=True)
class Feasibility:
    """Per-node verdict: ``ok`` rows passed every check; ``code`` says why the others failed."""

    ok: np.ndarray
    code: np.ndarray

    def reasons(self, state: ClusterState, rows: np.ndarray | None = None) -> dict[str, str]:
        rows = np.nonzero(~self.ok)[0] if rows is None else rows
        return {state.names[r]: reason(state, int(r), int(self.code[r])) for r in rows if not self.ok[r]}


def _model_mask(state: ClusterState, req: PodRequest) -> np.ndarray:
    """[N, C] cards whose model the pod accepts."""
    if req.models is None and req.model_patterns is None:
        return state.card_valid
    names = [m for m in state.models if req.models is None or m in req.models]
    if req.model_patterns is not None:
        names = [m for m in names if req.model_patterns.accepts(m)]
    return state.card_valid & np.isin(state.card_model, [state.models[m] for m in names])


def card_memory_need(state: ClusterState, container: ContainerRequest) -> np.ndarray | int:
    """GPU memory a shared container needs on each card (T9k percent depends on the card)."""
    if container.memory_pct is not None:
        return percent_share_memory_mib(state.card_mem_cap, container.memory_pct)
    return container.memory_mib


def shared_fit(state: ClusterState, container: ContainerRequest, allowed: np.ndarray) -> np.ndarray:
    """[N, C] cards that can take one more shared container of this size."""
    return (
        allowed
        & ~state.exclusive
        & (state.core_free >= container.core_milli)
        & (state.mem_free_card >= card_memory_need(state, container))
        & (state.pods < state.pod_limit)
    )


def check_nodes(state: ClusterState, req: PodRequest) -> tuple[Feasibility, np.ndarray]:
    """Vectorised node checks; returns the verdict and the [N, C] model mask."""
    n = state.node_count
    code = np.zeros(n, dtype=np.int64)

    def fail(mask: np.ndarray, reason: int) -> None:
        code[(code == 0) & mask] = reason

    allowed = _model_mask(state, req)
    gpu = req.wants_gpu
    if gpu:
        fail(state.n_cards == 0, 9)
        fail(~allowed.any(axis=1), 1)
        if req.alloc_mode is not None:
            fail(state.alloc_mode != ALLOC_MODES[req.alloc_mode], 2)
        if any(c.whole_node for c in req.containers):
            # T9k's node-exclusive request is served only by xgn nodes, whatever the parser said.
            fail(state.alloc_mode != ALLOC_MODES["xgn"], 2)
        if req.klass is not AppClass.NORMAL:
            fail(~state.mixed, 3)
    fail(state.cpu_free < req.cpu_milli, 4)
    fail(state.mem_free < req.memory_mib, 5)
    for container in req.containers:
        if container.whole_node:
            fail(state.n_cards > state.limits.max_cards_per_node, WHOLE_NODE_TOO_LARGE)
            free = state.card_free_whole() | ~state.card_valid
            fail(~(free.all(axis=1) & (state.n_cards > 0) & (allowed | ~state.card_valid).all(axis=1)), 8)
        elif container.exclusive:
            fail((state.card_free_whole() & allowed).sum(axis=1) < container.cards, 7)
        else:  # a share on each of ``cards`` distinct cards
            fail(shared_fit(state, container, allowed).sum(axis=1) < container.cards, 6)
    if len(req.containers) > 1:
        need = sum(c.cards for c in req.containers if c.exclusive and not c.whole_node)
        fail((state.card_free_whole() & allowed).sum(axis=1) < need, 7)
    return Feasibility(code == 0, code), allowed


def _co_location_tier(state: ClusterState, rows: np.ndarray, fit: np.ndarray, klass: AppClass) -> tuple[np.ndarray, np.ndarray]:
    """Online pods prefer cards without offline pods, offline pods cards without online pods.

    Where a node has such a card, only those cards stay candidates and the node is in tier 0;
    where it has none, the pod may still share a card with the other class (the isolation engine
    keeps online work ahead of offline work there) and the node drops to tier 1.
    """
    tier = np.zeros(len(rows), dtype=np.int64)
    if klass is AppClass.NORMAL:
        return fit, tier
    other = state.offline[rows] if klass is AppClass.ONLINE else state.online[rows]
    preferred = fit & (other == 0)
    has = preferred.any(axis=1)
    fit = np.where(has[:, None], preferred, fit)
    tier[~has] = 1
    return fit, tier


def _exclusive_slots(free_row: np.ndarray, k: int) -> list[int]:
    """The first ``k`` free slots: whole free cards are interchangeable, so take the lowest."""
    return [int(j) for j in np.nonzero(free_row)[0][:k]]


def _shares_for(state: ClusterState, node: int, container: ContainerRequest, slots: list[int]) -> tuple[CardShare, ...]:
    shares = []
    for j in slots:
        if container.exclusive:
            core, mem = CORE_MILLI_PER_CARD, int(state.card_mem_cap[node, j])
        else:
            need = card_memory_need(state, container)
            core = container.core_milli
            mem = int(need[node, j]) if isinstance(need, np.ndarray) else int(need)
        shares.append(CardShare(int(state.card_index[node, j]), state.card_uuid[node][j], core, mem))
    return tuple(shares)


@dataclass(frozen=True)
class Ranked:
    """Candidate nodes (row indices) with their costs and the card choice behind each cost.

    ``choice`` is kept in the cheapest form each path produces — a slot per row (one shared
    container), a [rows, cards] mask (whole cards), or explicit lists (several containers) — and
    turned into slots only for the winner.
    """

    rows: np.ndarray
    tier: np.ndarray
    cost: np.ndarray
    choice: np.ndarray | list[list[list[int]]] | None

    def order(self) -> np.ndarray:
        return np.lexsort((self.rows, self.cost, self.tier))

    def slots(self, i: int) -> list[list[int]]:
        if self.choice is None:
            return []
        if isinstance(self.choice, list):
            return self.choice[i]
        picked = self.choice[i]
        if picked.ndim == 0:
            return [[int(picked)]]
        return [[int(j) for j in np.nonzero(picked)[0]]]


def _index_order(state: ClusterState, rows: np.ndarray) -> np.ndarray:
    """[R, C] each row's card slots in card index order (the order of the devices in the node's
    ResourceSlice), missing slots last."""
    key = np.where(state.card_valid[rows], state.card_index[rows], np.iinfo(np.int64).max)
    return np.argsort(key, axis=1, kind="stable")


def _first_fit_slot(order: np.ndarray, fit: np.ndarray) -> np.ndarray:
    """[R] per row the slot of the first fitting card in ``order`` (rows have at least one)."""
    first = np.argmax(np.take_along_axis(fit, order, axis=1), axis=1)
    return order[np.arange(len(order)), first]


def _first_cards(order: np.ndarray, free: np.ndarray, k: int) -> np.ndarray:
    """[R, C] per row the first ``k`` free cards in ``order``."""
    in_order = np.take_along_axis(free, order, axis=1)
    take = np.zeros_like(free)
    np.put_along_axis(take, order, in_order & (np.cumsum(in_order, axis=1) <= k), axis=1)
    return take


def rank(state: ClusterState, req: PodRequest, policy: Policy, feasible: Feasibility, allowed: np.ndarray,
         card_choice: CardChoice = CardChoice.POLICY) -> Ranked:
    """Cost every feasible node (and its card choice) for the pod with the given policy.

    With ``CardChoice.FIRST_FIT`` the cards are the allocator's (first fit in index order) and each
    node costs what the policy charges for that card, so the node choice stays the policy's."""
    rows = np.nonzero(feasible.ok)[0]
    first_fit = card_choice is CardChoice.FIRST_FIT
    if not len(rows) or not req.containers:
        cost = policy.cpu_only_cost(state, rows, req) if len(rows) else np.zeros(0)
        return Ranked(rows, np.zeros(len(rows), dtype=np.int64), cost, None)
    if len(req.containers) == 1 and req.containers[0].shared and req.containers[0].cards == 1:
        container = req.containers[0]
        fit = shared_fit(state, container, allowed)[rows]
        # The allocator knows nothing of online/offline classes: it takes any card with room.
        # The class still ranks the nodes, which is the extender's part.
        preferred, tier = _co_location_tier(state, rows, fit, req.klass)
        cand = SharedCandidates(rows=rows, fit=fit if first_fit else preferred, core=container.core_milli,
                                cpu=req.cpu_milli, mem=req.memory_mib,
                                binpack_cards=req.klass is AppClass.OFFLINE, spread_cards=req.klass is AppClass.ONLINE)
        card_cost = policy.shared_card_cost(state, cand)
        slot = _first_fit_slot(_index_order(state, rows), fit) if first_fit else np.argmin(card_cost, axis=1)
        cost = card_cost[np.arange(len(rows)), slot]
        return Ranked(rows, tier, cost, slot)
    if len(req.containers) == 1 and not req.containers[0].shared:
        container = req.containers[0]
        if container.whole_node:
            take = state.card_valid[rows]
        else:
            free = (state.card_free_whole() & allowed)[rows]
            if first_fit:
                take = _first_cards(_index_order(state, rows), free, container.cards)
            else:
                take = free & (np.cumsum(free, axis=1) <= container.cards)
        cost = policy.exclusive_cost(state, rows, take, req)
        return Ranked(rows, np.zeros(len(rows), dtype=np.int64), cost, take)
    return _rank_multi(state, req, policy, rows, allowed, first_fit)


def _rank_multi(state: ClusterState, req: PodRequest, policy: Policy, rows: np.ndarray, allowed: np.ndarray,
                first_fit: bool = False) -> Ranked:
    """Several GPU containers: place them one by one on each candidate node (best-fit cards, or
    the first fitting cards in index order under ``first_fit``), then cost the node by the state
    the whole pod would leave behind."""
    keep_rows, costs, all_slots = [], [], []
    orders = _index_order(state, rows) if first_fit else None
    for i, r in enumerate(rows):
        order = orders[i] if orders is not None else np.arange(state.card_valid.shape[1])
        core = state.core_free[r].copy()
        mem = state.mem_free_card[r].copy()
        pods = state.pods[r].copy()
        taken = state.exclusive[r].copy()
        whole = state.card_free_whole()[r] & allowed[r]
        per_container: list[list[int]] = []
        ok = True
        for container in req.containers:
            if container.whole_node:
                chosen = _exclusive_slots(state.card_valid[r], int(state.n_cards[r]))
            elif container.exclusive:
                chosen = _exclusive_slots((whole & ~taken & (pods == 0) & (core == CORE_MILLI_PER_CARD))[order], container.cards)
                chosen = [int(order[j]) for j in chosen]
                ok = len(chosen) == container.cards
            else:
                need = card_memory_need(state, container)
                need_row = need[r] if isinstance(need, np.ndarray) else need
                fit = allowed[r] & ~taken & (core >= container.core_milli) & (mem >= need_row) & (pods < state.pod_limit[r])
                if fit.sum() < container.cards:  # one share on each of ``cards`` distinct cards
                    ok = False
                    chosen = []
                elif first_fit:
                    chosen = [int(j) for j in order[fit[order]][:container.cards]]
                else:
                    after = np.where(fit, core - container.core_milli, np.iinfo(np.int64).max)
                    chosen = [int(j) for j in np.argsort(after, kind="stable")[:container.cards]]
            if not ok:
                break
            for j in chosen:
                if container.exclusive or container.whole_node:
                    taken[j] = True
                else:
                    core[j] -= container.core_milli
                    mem[j] -= int(need_row[j]) if isinstance(need_row, np.ndarray) else need_row
                    pods[j] += 1
            per_container.append(chosen)
        if not ok:
            continue
        after_free = np.where(taken, 0, core)
        keep_rows.append(r)
        costs.append(float(policy.state_cost(state, np.array([r]), after_free[None, :], req)[0]))
        all_slots.append(per_container)
    rows_arr = np.array(keep_rows, dtype=np.int64)
    return Ranked(rows_arr, np.zeros(len(rows_arr), dtype=np.int64), np.array(costs, dtype=float), all_slots)


def _placement(state: ClusterState, req: PodRequest, row: int, slots: list[list[int]]) -> Placement:
    containers = tuple(
        ContainerPlacement(c.name, _shares_for(state, row, c, s), exclusive=c.exclusive or c.whole_node,
                           dialect=ContainerDialect.of_request(c))
        for c, s in zip(req.containers, slots)
    )
    return Placement(state.names[row], containers, req.klass, req.cpu_milli, req.memory_mib)


def place(state: ClusterState, req: PodRequest, policy: Policy, nodes: np.ndarray | None = None,
          card_choice: CardChoice = CardChoice.POLICY) -> Placement:
    """The best node and cards for ``req``, or :class:`Unschedulable` with a reason per node.

    ``nodes`` (a boolean mask over nodes) restricts the choice, as the extender's candidate list does;
    ``card_choice`` says who picks the cards inside the node (the policy, or DRA's first fit).
    """
    feasible, allowed = check_nodes(state, req)
    if nodes is not None:
        feasible = Feasibility(feasible.ok & nodes, feasible.code)
    ranked = rank(state, req, policy, feasible, allowed, card_choice)
    if not len(ranked.rows):
        scope = np.nonzero(nodes)[0] if nodes is not None else None
        reasons = feasible.reasons(state, scope)
        for r in np.nonzero(feasible.ok)[0]:
            reasons[state.names[r]] = REASONS[6]
        raise Unschedulable(req.key, reasons)
    best = int(ranked.order()[0])
    return _placement(state, req, int(ranked.rows[best]), ranked.slots(best))


@dataclass(frozen=True)
class Scored:
    """The extender's view of one candidate list, as arrays aligned with that list.

    ``rows``: each name's state row (-1: unknown node); ``score``: 0..10, or -1 where the node
    failed; ``code``: 0 where it passed, else the key of its reason in ``REASONS``;
    ``node_score``: the same scores by state row (-1 for rows not scored), so a later call with
    another list of names can look them up without scoring again; ``ranked``: the ranking behind
    the scores, which holds each ranked node's card choice (see :func:`placement_at`).
    """

    rows: np.ndarray
    score: np.ndarray
    code: np.ndarray
    node_score: np.ndarray
    ranked: Ranked | None = None


def placement_at(state: ClusterState, req: PodRequest, scored: Scored, row: int) -> Placement:
    """The placement on state row ``row`` that ``scored`` ranked: the same cards ``place`` would
    pick with the choice restricted to that node, without checking and ranking every node again."""
    ranked = scored.ranked
    at = int(np.searchsorted(ranked.rows, row)) if ranked is not None else 0  # ranked rows ascend
    if ranked is None or at >= len(ranked.rows) or int(ranked.rows[at]) != row:
        raise Unschedulable(req.key, {state.names[row]: "node was not ranked for this pod"})
    return _placement(state, req, row, ranked.slots(at))


def at_rows(by_row: np.ndarray, rows: np.ndarray, missing: int | bool) -> np.ndarray:
    """``by_row[rows]`` for rows from :meth:`ClusterState.rows_of`; ``missing`` where a row is -1."""
    known = rows >= 0
    if not len(by_row):  # no nodes at all: every row is -1
        return np.full(len(rows), missing, dtype=np.result_type(by_row, type(missing)))
    return np.where(known, by_row[np.where(known, rows, 0)], missing)


def score_rows(state: ClusterState, req: PodRequest, policy: Policy, rows: np.ndarray,
               card_choice: CardChoice = CardChoice.POLICY) -> Scored:
    """Score the nodes at ``rows`` (from :meth:`ClusterState.rows_of`) in one vector pass; with
    ``CardChoice.FIRST_FIT`` each node is scored with the card DRA's allocator will take there.

    No per-node Python work: a kube-scheduler that sends 5,000 names pays for numpy, not for a
    loop over them.
    """
    rows = np.asarray(rows, dtype=np.int64)
    known = rows >= 0
    mask = np.zeros(state.node_count, dtype=bool)
    mask[rows[known]] = True
    feasible, allowed = check_nodes(state, req)
    feasible = Feasibility(feasible.ok & mask, feasible.code)
    ranked = rank(state, req, policy, feasible, allowed, card_choice)
    node_score = np.full(state.node_count, -1, dtype=np.int64)
    if len(ranked.rows):
        key = ranked.tier * (np.ptp(ranked.cost) + 1.0) + ranked.cost
        lo, hi = float(key.min()), float(key.max())
        span = hi - lo
        if span == 0:
            node_score[ranked.rows] = MAX_SCORE
        else:
            node_score[ranked.rows] = np.round(MAX_SCORE * (hi - key) / span).astype(np.int64)
    node_code = feasible.code.copy()
    node_code[(node_code == 0) & (node_score < 0)] = 6  # feasible, but no card choice survived ranking
    return Scored(rows, at_rows(node_score, rows, -1), at_rows(node_code, rows, UNKNOWN_NODE), node_score, ranked)


def score(state: ClusterState, req: PodRequest, policy: Policy, names: list[str]) -> tuple[dict[str, int], dict[str, str]]:
    """Extender view as dicts: a 0..10 score per feasible node among ``names`` and a reason per
    failed one (see :func:`score_rows` for the array form the extender serves from).

    Unknown node names fail with a reason rather than raising, since the scheduler may know nodes
    the cache has not seen yet.
    """
    s = score_rows(state, req, policy, state.rows_of(names))
    scores = {n: v for n, v in zip(names, s.score.tolist()) if v >= 0}
    failed = {n: reason(state, r, c) for n, r, c in zip(names, s.rows.tolist(), s.code.tolist()) if c}
    return scores, failed
