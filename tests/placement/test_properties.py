"""Property tests: whatever sequence of placements and releases, the books balance.

For any cluster and any sequence, no card exceeds 100% core, its memory or its pod count; no
exclusive card is shared; the arrays always equal what the bookings add up to; and releasing
everything restores the initial capacity exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qgpu_runtime.model import AppClass, ContainerRequest, Dialect, PodRequest
from qgpu_runtime.placement import CardSpec, ClusterState, NodeSpec, Unschedulable, make_policy, place
from qgpu_runtime.placement.engine import check_nodes, shared_fit
from qgpu_runtime.placement.policies import _CARD_WEIGHT, FragPolicy, SharedCandidates, _card_free

MODELS = ["T4", "V100", "A10"]


@st.composite
def clusters(draw):
    n = draw(st.integers(1, 4))
    nodes = []
    for i in range(n):
        cards = draw(st.integers(0, 4))
        model = draw(st.sampled_from(MODELS))
        mem = draw(st.sampled_from([8, 16, 32])) * 1024
        labels = {}
        if draw(st.booleans()):
            labels["mixed-qgpu-enable"] = "enable"
        nodes.append(NodeSpec(f"n{i}", draw(st.integers(1000, 16000)), 64 * 1024,
                              tuple(CardSpec(j, f"n{i}-{j}", model, mem) for j in range(cards)), labels))
    return nodes


@st.composite
def requests(draw, i):
    kind = draw(st.sampled_from(["share", "share", "whole", "online", "offline", "multi", "node", "cpu"]))
    cpu = draw(st.integers(0, 4000))
    models = draw(st.one_of(st.none(), st.sets(st.sampled_from(MODELS), min_size=1).map(frozenset)))
    klass = AppClass.NORMAL
    if kind in ("share", "online", "offline"):
        core = 0 if kind == "online" else draw(st.integers(1, 99)) * 10
        mem = draw(st.integers(1, 12)) * 1024
        containers = (ContainerRequest("c", Dialect.QGPU, 1, core, mem),)
        klass = {"share": AppClass.NORMAL, "online": AppClass.ONLINE, "offline": AppClass.OFFLINE}[kind]
    elif kind == "whole":
        containers = (ContainerRequest("c", Dialect.NVIDIA, draw(st.integers(1, 3)), 1000, exclusive=True),)
    elif kind == "multi":
        containers = (ContainerRequest("a", Dialect.QGPU, 1, draw(st.integers(1, 99)) * 10, 1024),
                      ContainerRequest("b", Dialect.QGPU, draw(st.integers(1, 2)), 1000, exclusive=True))
    elif kind == "node":
        containers = (ContainerRequest("c", Dialect.T9K, 0, 1000, exclusive=True, whole_node=True),)
    else:
        containers = ()
    return PodRequest("ns", f"p{i}", klass=klass, containers=containers, models=models, cpu_milli=cpu)


def recount(state: ClusterState):
    core = np.where(state.card_valid, 1000, 0)
    mem = state.card_mem_cap.copy()
    pods = np.zeros_like(state.pods)
    excl = np.zeros_like(state.exclusive)
    cpu = state.cpu_cap.copy()
    for placement in state.bookings.values():
        n = state.index[placement.node]
        cpu[n] -= placement.cpu_milli
        for c in placement.containers:
            for s in c.shares:
                j = state.slot_of(n, s.index)
                if c.exclusive:
                    assert not excl[n, j], "card held exclusively twice"
                    excl[n, j] = True
                else:
                    core[n, j] -= s.core_milli
                    mem[n, j] -= s.memory_mib
                    pods[n, j] += 1
    return core, mem, pods, excl, cpu


def check_invariants(state: ClusterState):
    assert (state.core_free >= 0).all() and (state.core_free <= 1000).all()
    assert (state.mem_free_card >= 0).all()
    assert (state.pods <= state.pod_limit).all()
    assert not (state.exclusive & (state.pods > 0)).any(), "exclusive card also shared"
    assert (state.cpu_free >= 0).all()
    core, mem, pods, excl, cpu = recount(state)
    assert np.array_equal(core, state.core_free)
    assert np.array_equal(mem, state.mem_free_card)
    assert np.array_equal(pods, state.pods)
    assert np.array_equal(excl, state.exclusive)
    assert np.array_equal(cpu, state.cpu_free)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), nodes=clusters(), policy=st.sampled_from(["binpack", "spread", "bestfit", "frag"]))
def test_any_sequence_of_placements_and_releases_keeps_the_books(data, nodes, policy):
    state = ClusterState(nodes)
    initial = (state.core_free.copy(), state.mem_free_card.copy(), state.pods.copy(), state.exclusive.copy(), state.cpu_free.copy())
    pol = make_policy(policy)
    for i in range(data.draw(st.integers(1, 25))):
        if state.bookings and data.draw(st.integers(0, 3)) == 0:
            key = data.draw(st.sampled_from(sorted(state.bookings)))
            state.release(key)
        else:
            req = data.draw(requests(i))
            pol.observe(req)
            try:
                placement = place(state, req, pol)
            except Unschedulable:
                continue
            state.commit(req.name, placement)
        check_invariants(state)
    for key in list(state.bookings):
        state.release(key)
    final = (state.core_free, state.mem_free_card, state.pods, state.exclusive, state.cpu_free)
    assert all(np.array_equal(a, b) for a, b in zip(initial, final))


def filled(data, nodes, pol, most: int = 12) -> tuple[ClusterState, Any]:
    """A cluster after a drawn sequence of up to ``most`` placements by ``pol``."""
    state = ClusterState(nodes)
    for i in range(data.draw(st.integers(0, most))):
        req = data.draw(requests(i))
        pol.observe(req)
        try:
            state.commit(req.name, place(state, req, pol))
        except Unschedulable:
            pass
    return state, pol


@settings(max_examples=60, deadline=None)
@given(data=st.data(), nodes=clusters())
def test_frag_fast_path_equals_scoring_each_after_state(data, nodes):
    """The vectorised (node, card) scoring must equal computing each after-state in full
    (expected fragment plus GPU stranded behind CPU)."""
    state, pol = filled(data, nodes, FragPolicy(tie_weight=0.0))
    req = data.draw(requests(99).filter(lambda r: len(r.containers) == 1 and r.containers[0].shared and r.klass is AppClass.NORMAL))
    pol.observe(req)
    feasible, allowed = check_nodes(state, req)
    rows = np.nonzero(feasible.ok)[0]
    if not len(rows):
        return
    c = req.containers[0]
    fit = shared_fit(state, c, allowed)[rows]
    cost = pol.shared_card_cost(state, SharedCandidates(rows, fit, c.core_milli, req.cpu_milli, req.memory_mib))
    free = _card_free(state, rows)
    whole = state.card_free_whole()[rows]
    full = whole.sum(axis=1)
    before = pol.frag_of(free, full, state.cpu_free[rows], state.mem_free[rows], state, rows)
    for a in range(len(rows)):
        for j in np.nonzero(fit[a])[0]:
            after_free = free[a:a + 1].copy()
            after_free[0, j] -= c.core_milli
            after_full = full[a:a + 1] - int(whole[a, j] and c.core_milli > 0)
            after = pol.frag_of(after_free, after_full, state.cpu_free[rows[a:a + 1]] - req.cpu_milli,
                                state.mem_free[rows[a:a + 1]] - req.memory_mib, state, rows[a:a + 1])[0]
            balance = pol.stranded(after_free.sum(axis=1), state.cpu_free[rows[a:a + 1]] - req.cpu_milli)[0] \
                - pol.stranded(free[a:a + 1].sum(axis=1), state.cpu_free[rows[a:a + 1]])[0]
            expected = after - before[a] + balance + _CARD_WEIGHT * (free[a, j] - c.core_milli)
            assert abs(expected - cost[a, j]) < 1e-6


@settings(max_examples=60, deadline=None)
@given(data=st.data(), nodes=clusters())
def test_frag_whole_card_and_cpu_only_costs_equal_scoring_the_after_state(data, nodes):
    """Whole-card and CPU-only costs update the node's per-need sums in place; they must equal
    the fragment, stranding and tie terms of the after-state computed in full."""
    state, pol = filled(data, nodes, FragPolicy())
    req = data.draw(requests(99).filter(lambda r: not r.containers or (len(r.containers) == 1 and r.containers[0].exclusive
                                                                       and not r.containers[0].whole_node)))
    pol.observe(req)
    feasible, allowed = check_nodes(state, req)
    rows = np.nonzero(feasible.ok)[0]
    if not len(rows):
        return
    free = _card_free(state, rows)
    full = state.card_free_whole()[rows].sum(axis=1)
    if req.containers:
        whole_free = (state.card_free_whole() & allowed)[rows]
        take = whole_free & (np.cumsum(whole_free, axis=1) <= req.containers[0].cards)
        cost = pol.exclusive_cost(state, rows, take, req)
    else:
        take = np.zeros_like(free, dtype=bool)
        cost = pol.cpu_only_cost(state, rows, req)
    free_a = np.where(take, 0, free)
    cpu_a = state.cpu_free[rows] - req.cpu_milli
    before = pol.frag_of(free, full, state.cpu_free[rows], state.mem_free[rows], state, rows)
    after = pol.frag_of(free_a, full - take.sum(axis=1), cpu_a, state.mem_free[rows] - req.memory_mib, state, rows)
    balance = pol.stranded(free_a.sum(axis=1), cpu_a) - pol.stranded(free.sum(axis=1), state.cpu_free[rows])
    tie = pol.tie_weight * (0.5 * cpu_a / np.maximum(state.cpu_cap[rows], 1)
                            + 0.5 * free_a.sum(axis=1) / np.maximum(state.n_cards[rows] * 1000, 1))
    assert np.allclose(cost, after - before + balance + tie, atol=1e-6)


def reference_scores(state: ClusterState, req: PodRequest, policy, names: list[str]):
    """The extender's scores computed the slow, obvious way: one node at a time.

    A node passes when ``place`` restricted to it succeeds; its cost is the ranking key of that
    node alone; scores then spread the keys of the passing nodes linearly over 0..10 (best = 10).
    """
    from qgpu_runtime.placement.engine import REASONS, Feasibility, rank

    feasible, allowed = check_nodes(state, req)
    keys: dict[str, tuple[int, float]] = {}
    failed: dict[str, str] = {}
    for name in names:
        if name not in state.index:
            failed[name] = REASONS[10]
            continue
        r = state.index[name]
        if not feasible.ok[r]:
            failed[name] = REASONS[int(feasible.code[r])]
            continue
        only = np.zeros(state.node_count, dtype=bool)
        only[r] = True
        ranked = rank(state, req, policy, Feasibility(feasible.ok & only, feasible.code), allowed)
        if not len(ranked.rows):
            failed[name] = REASONS[6]
            continue
        keys[name] = (int(ranked.tier[0]), float(ranked.cost[0]))
    if not keys:
        return {}, failed
    costs = [c for _, c in keys.values()]
    spread = max(costs) - min(costs) + 1.0
    flat = {n: t * spread + c for n, (t, c) in keys.items()}
    lo, hi = min(flat.values()), max(flat.values())
    return {n: 10 if hi == lo else int(round(10 * (hi - k) / (hi - lo))) for n, k in flat.items()}, failed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), nodes=clusters(), policy=st.sampled_from(["binpack", "spread", "bestfit"]))
def test_vector_scores_equal_the_node_by_node_reference(data, nodes, policy):
    """score_rows (one numpy pass over the scheduler's list) against a per-node loop, on random
    clusters, bookings and candidate lists with unknown and repeated names."""
    from qgpu_runtime.placement.engine import score, score_rows

    state, pol = filled(data, nodes, make_policy(policy), most=8)
    req = data.draw(requests(99))
    names = data.draw(st.lists(st.sampled_from([n.name for n in nodes] + ["ghost"]), max_size=8))
    want_scores, want_failed = reference_scores(state, req, pol, names)
    assert score(state, req, pol, names) == (want_scores, want_failed)
    scored = score_rows(state, req, pol, state.rows_of(names))
    assert [want_scores.get(n, -1) for n in names] == scored.score.tolist()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), nodes=clusters(), policy=st.sampled_from(["binpack", "spread", "bestfit", "frag"]))
def test_placement_from_the_ranking_equals_placing_on_that_node_alone(data, nodes, policy):
    """The extender holds the filter's best node with the card choice its ranking already made
    (engine.placement_at); it must be exactly what place() picks when restricted to that node."""
    from qgpu_runtime.placement.engine import placement_at, score_rows

    state, pol = filled(data, nodes, make_policy(policy), most=8)
    req = data.draw(requests(99))
    scored = score_rows(state, req, pol, np.arange(state.node_count))
    for row in range(state.node_count):
        only = np.zeros(state.node_count, dtype=bool)
        only[row] = True
        if scored.node_score[row] < 0:
            with pytest.raises(Unschedulable):
                placement_at(state, req, scored, row)
            continue
        assert placement_at(state, req, scored, row) == place(state, req, pol, only)
