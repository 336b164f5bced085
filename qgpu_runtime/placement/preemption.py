"""Which pods to evict from one node so that a pending pod fits there, at card level.

kube-scheduler's own preemption (DefaultPreemption) counts extended resources per node: it knows
nothing of cards, so it may evict pods whose removal frees no card the pending pod can use, or
miss the one eviction that would. The extender's preempt verb asks this module instead.

The answer is the engine's own: a set "fits" when :func:`engine.place` finds the pod a placement on
the node with those pods' bookings released, under the node's policy, model mask, pod slots and
whole-card rules (a two-card pod needs two whole cards). No fit arithmetic is repeated here.

Sets are ranked, best first, by:
0. fewer victims whose eviction violates a PodDisruptionBudget (``Candidate.violating``, from
   placement/disruption.py), as kube-scheduler ranks its candidates first by that count;
1. the victims' priorities and classes, worst first: a set whose most valuable victim has a lower
   priority wins; at equal priority an offline victim is cheaper than a normal one, a normal one
   cheaper than an online one (``tke.cloud.tencent.com/app-class``);
2. fewer pods;
3. less GPU share freed (thousandths of a card): the least disruption beyond need.

The search is bounded, like kube-scheduler's: for each of a few removal orders (all of them lowest
priority and cheapest class first, so the worst victim is already the lowest possible), remove
candidates one by one until the pod fits, then try to *reprieve* each victim, the most valuable
first, keeping it where the pod still fits without it. The orders differ only inside one priority
and class: largest share first (fewer pods), smallest first (less freed), and the pods of each card
first (the victims that free one card). The best set over the orders is the answer. At most
``MAX_CANDIDATES`` candidates are weighed (the cheapest ones) and at most ``MAX_ORDER_CARDS`` cards
get an order of their own, so one node costs at most (2 + cards) * 2 * candidates fit checks. A
:class:`FitBudget` shared by the nodes of one call bounds it further: every node gets the first
order (kube-scheduler's own greedy + reprieve, at card level), the other orders only while the
budget lasts. In every order a candidate protected by a PodDisruptionBudget comes after all the
unprotected ones, so it is removed last and reprieved first, as kube-scheduler's SelectVictimsOnNode
does: a budget is violated only where no set of unprotected pods frees what the pod needs.

Pure: the caller hands in the node, what is booked there and who may be evicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from qgpu_runtime.model.requests import DEFAULT_LIMITS, AppClass, CardLimits, PodRequest
from qgpu_runtime.placement import engine
from qgpu_runtime.placement.policies import Policy
from qgpu_runtime.placement.state import ClusterState, NodeSpec, Placement, StateError

MAX_CANDIDATES = 64
MAX_ORDER_CARDS = 8

# Cheapest to evict first at equal priority.
CLASS_COST = {AppClass.OFFLINE: 0, AppClass.NORMAL: 1, AppClass.ONLINE: 2}


DEFAULT_FIT_CHECKS = 5_000


@dataclass
class FitBudget:
    """Fit checks left to one preempt call, over all its nodes."""

    left: int = DEFAULT_FIT_CHECKS


@dataclass(frozen=True)
class Candidate:
    """A pod the preemptor may evict: lower priority, bound to the node, its booking as qgpu has it."""

    key: str
    uid: str
    priority: int
    placement: Placement
    violating: bool = False  # its eviction overdraws a PodDisruptionBudget (placement/disruption.py)

    @property
    def cost(self) -> tuple[int, int]:
        return self.priority, CLASS_COST[self.placement.klass]

    @property
    def order_key(self) -> tuple[bool, int, int]:
        """Removal order's first key: protected pods last, then the cheapest first."""
        return (self.violating, *self.cost)


@dataclass(frozen=True)
class Eviction:
    """The chosen victims (empty: the pod fits already) and the GPU share their removal frees."""

    victims: tuple[Candidate, ...]

    @property
    def freed_milli(self) -> int:
        return sum(v.placement.gpu_milli for v in self.victims)

    @property
    def pdb_violations(self) -> int:
        return sum(v.violating for v in self.victims)

    def rank(self) -> tuple[int, tuple[tuple[int, int], ...], int, int]:
        """Smaller is better (see the module docstring)."""
        return (self.pdb_violations, tuple(sorted((v.cost for v in self.victims), reverse=True)),
                len(self.victims), self.freed_milli)


def _fits(state: ClusterState, request: PodRequest, policy: Policy, budget: FitBudget) -> bool:
    budget.left -= 1
    try:
        engine.place(state, request, policy)
    except engine.Unschedulable:
        return False
    return True


def _orders(candidates: Sequence[Candidate], spec: NodeSpec) -> list[list[Candidate]]:
    by_size = sorted(candidates, key=lambda c: (c.order_key, -c.placement.gpu_milli, c.key))
    orders = [by_size, sorted(candidates, key=lambda c: (c.order_key, c.placement.gpu_milli, c.key))]
    for card in [c.index for c in spec.cards][:MAX_ORDER_CARDS]:
        def off_card(c: Candidate, card: int = card) -> bool:
            return all(s.index != card for ctr in c.placement.containers for s in ctr.shares)
        order = sorted(candidates, key=lambda c: (c.order_key, off_card(c), -c.placement.gpu_milli, c.key))
        if order not in orders:
            orders.append(order)
    return orders


def _greedy(state: ClusterState, request: PodRequest, policy: Policy, order: list[Candidate],
            budget: FitBudget) -> Eviction | None:
    """Remove in ``order`` until the pod fits, then reprieve the most valuable first; the state
    is left as it was found."""
    removed: list[Candidate] = []
    try:
        for candidate in order:
            state.release(candidate.key)
            removed.append(candidate)
            if _fits(state, request, policy, budget):
                break
        else:
            return None
        victims = []
        for candidate in reversed(removed):
            state.commit(candidate.key, candidate.placement)
            if _fits(state, request, policy, budget):
                continue  # reprieved
            state.release(candidate.key)
            victims.append(candidate)
        return Eviction(tuple(sorted(victims, key=lambda c: (c.cost, c.key))))
    finally:
        for candidate in removed:
            if candidate.key not in state.bookings:
                state.commit(candidate.key, candidate.placement)


def choose_victims(spec: NodeSpec, booked: Mapping[str, Placement], candidates: Sequence[Candidate],
                   request: PodRequest, policy: Policy, limits: CardLimits = DEFAULT_LIMITS,
                   budget: FitBudget | None = None) -> Eviction | None:
    """The best set of ``candidates`` to evict so that ``request`` fits on node ``spec``.

    ``booked``: every booking on the node (the candidates' among them; a candidate not booked here
    frees nothing and is ignored). Returns an empty :class:`Eviction` when the pod fits already,
    None when no set of candidates makes it fit.
    """
    budget = budget if budget is not None else FitBudget()
    state = ClusterState([spec], limits)
    for key, placement in booked.items():
        try:
            state.commit(key, placement)
        except StateError:
            continue  # the caller's state held it; a one-node copy cannot disagree, but never fail here
    if _fits(state, request, policy, budget):
        return Eviction(())
    usable = sorted((c for c in candidates if booked.get(c.key) == c.placement and c.key in state.bookings),
                    key=lambda c: (c.order_key, c.key))[:MAX_CANDIDATES]
    if not usable:
        return None
    best: Eviction | None = None
    for i, order in enumerate(_orders(usable, spec)):
        if i and budget.left <= 0:
            break
        found = _greedy(state, request, policy, order, budget)
        if found is not None and (best is None or found.rank() < best.rank()):
            best = found
    return best
