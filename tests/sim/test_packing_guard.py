"""Regression guard on the headline packing figure of docs/benchmarks.md: `frag` on the bundled
openb trace. A change that makes `frag` pack worse fails here, not only in a benchmark run."""

from __future__ import annotations

import pytest

from qgpu_runtime.placement import CardChoice
from qgpu_runtime.placement.policies import FragPolicy
from qgpu_runtime.sim.replay import ReplayOptions, replay_arrivals
from qgpu_runtime.sim.trace import load_nodes, load_pods
from tests.tracedata import openb_trace_dir

TRACE = openb_trace_dir()
# `slow` by hand (docs/testing.md#the-tiers): these replays need nothing but Python, yet take
# about 75 s of CPU together, close to half of the fast tier; the README's command runs them.
pytestmark = [pytest.mark.skipif(TRACE is None, reason="the openb trace is not beside the checkout (set QGPU_TRACE_DIR)"),
              pytest.mark.slow]

# The cut: seed 42 of the documented 10-seed run, replayed only until the arrived demand passes
# 101 % of capacity instead of 130 %. One seed's replay is deterministic, and the shorter run is
# a prefix of the full one (same shuffle, same stream of extension draws, a policy that learns
# only from pods already arrived), so its 100 % bin holds exactly the pods of the full run's.
# That bin is the documented figure itself, not an estimate of it: 4.20 for seed 42.
CUT_SEED = 42
CUT = ReplayOptions(extend_to_pct=101)

# Derived from the full figure (docs/benchmarks.md, seeds 42-51, re-run after issue 27 weighed
# shapes by GPU demand): median 4.21 % unallocated at arrived 100 %, per seed 4.20, 4.23, 4.27,
# 4.24, 4.23, 4.22, 4.15, 4.19, 4.16, 4.18; target for the median <= 4.3 %. (Before issue 27: median
# 4.19, worst seed 4.26.) The guard allows seed 42 to reach the worst seed of that run, 4.27: a
# change may trade one seed against another within the spread the documented figure already
# has (0.12 points), but once seed 42 packs worse than every seed of the documented run did,
# the figure regressed. 4.27 also keeps the check under the 4.3 target.
FRAG_UNALLOCATED_PCT_LIMIT = 4.27


@pytest.fixture(scope="module")
def openb():
    assert TRACE is not None
    return load_nodes(TRACE / "openb_node_list_gpu_node.csv"), load_pods(TRACE / "openb_pod_list_default.csv")


def _unallocated_at_100(openb, policy: str, factory=None) -> float:
    nodes, pods = openb
    return replay_arrivals(nodes, pods, policy, CUT_SEED, CUT, policy_factory=factory).unallocated_at(100)


def test_frag_packs_the_trace_as_well_as_the_documented_figure(openb):
    """Threshold derivation: see FRAG_UNALLOCATED_PCT_LIMIT above (worst seed of the 10-seed run)."""
    unallocated = _unallocated_at_100(openb, "frag")
    assert unallocated <= FRAG_UNALLOCATED_PCT_LIMIT, (
        f"frag leaves {unallocated:.2f} % of the GPUs unallocated at arrived 100 % on seed {CUT_SEED}: "
        f"worse than every seed of the documented run (limit {FRAG_UNALLOCATED_PCT_LIMIT} %)")


@pytest.mark.parametrize("variant,factory", [
    ("bestfit", None),  # the study's baseline: 6.95 % over 10 seeds
    # one idea of frag undone: no charge for the GPU a choice strands behind the node's CPU (5.40)
    ("frag without the stranding term", lambda: FragPolicy(cpu_balance=0.0)),
])
def test_the_guard_fails_a_policy_that_packs_worse(openb, variant, factory):
    """The guard can fail: the same cut under a worse policy lands above the limit."""
    unallocated = _unallocated_at_100(openb, "bestfit" if factory is None else "frag", factory)
    assert unallocated > FRAG_UNALLOCATED_PCT_LIMIT, f"{variant}: {unallocated:.2f} %"


# The GPU-model variant (docs/simulator.md, --gpu-spec-fraction): the claim of docs/benchmarks.md
# is that frag packs it at least as well as the published FGD on the study's own 33 % variant,
# 12.1 % unallocated at arrived 100 % (frag's 10-seed median here: 8.85). The guard holds seed 42's
# cut to that published figure (it lands at 9.14); without the pressure weighting frag lands at 15.98.
FGD_PUBLISHED_GPU_SPEC_PCT = 12.1


@pytest.fixture(scope="module")
def openb_gpu_spec(openb):
    from qgpu_runtime.sim.variants import PRODUCTION_FRACTION, with_gpu_spec

    nodes, pods = openb
    return nodes, with_gpu_spec(pods, nodes, PRODUCTION_FRACTION, seed=0)


def test_frag_packs_the_gpu_model_variant_at_least_as_well_as_published_fgd(openb_gpu_spec):
    unallocated = _unallocated_at_100(openb_gpu_spec, "frag")
    assert unallocated <= FGD_PUBLISHED_GPU_SPEC_PCT, (
        f"frag leaves {unallocated:.2f} % unallocated at arrived 100 % on the GPU-model variant (seed {CUT_SEED}); "
        f"the published FGD leaves {FGD_PUBLISHED_GPU_SPEC_PCT} %")


def test_the_gpu_model_guard_fails_frag_without_the_pressure_weighting(openb_gpu_spec):
    unallocated = _unallocated_at_100(openb_gpu_spec, "frag", lambda: FragPolicy(model_pressure=False))
    assert unallocated > FGD_PUBLISHED_GPU_SPEC_PCT, f"{unallocated:.2f} %"


# On a DRA pool kube-scheduler's allocator picks the cards (first fit in index order) and qgpu's
# extender only ranks the nodes (docs/dra.md, "Packing on a DRA pool"). The claim of
# docs/benchmarks.md is that frag packs as well there as with its own card choice: seed 42's cut
# lands at 4.15 with first-fit cards as without, so it is held to the same limit. bestfit with
# first-fit cards lands at 7.14: the guard can fail.
def test_frag_packs_a_dra_pool_as_well_as_with_its_own_card_choice(openb):
    nodes, pods = openb
    first_fit = ReplayOptions(extend_to_pct=101, card_choice=CardChoice.FIRST_FIT)
    unallocated = replay_arrivals(nodes, pods, "frag", CUT_SEED, first_fit).unallocated_at(100)
    assert unallocated <= FRAG_UNALLOCATED_PCT_LIMIT, f"frag with first-fit cards: {unallocated:.2f} %"
    baseline = replay_arrivals(nodes, pods, "bestfit", CUT_SEED, first_fit).unallocated_at(100)
    assert baseline > FRAG_UNALLOCATED_PCT_LIMIT, f"bestfit with first-fit cards: {baseline:.2f} %"


# The multi-card mixes (issue 27, docs/simulator.md --multi-card-fraction): pods asking for several
# whole cards carry a given share of the GPU demand. Weighing shapes by pod count, frag took the
# 8-card nodes apart while the cluster was half empty and let the 8-card pods fail from arrived
# ~70 % on; the loss showed at arrived 100 % and was filled in by 110 % (collapse and recover).
# The cut: the mix with 20 % of the demand from multi-card pods, draw 1, replay seed 43, replayed
# to arrived 111 % (a prefix of the full run, so its 100 % and 110 % bins are the full run's).
MIX_CUT = ReplayOptions(extend_to_pct=111)
MIX_FRACTION, MIX_DRAW, MIX_SEED = 0.2, 1, 43
# Derived from the full runs of docs/benchmarks.md ("Workload mixes"), this cut's run: bestfit
# 6.34 %, binpack 5.43 % unallocated at arrived 100 %; frag before issue 27 5.87 % at 100 % against
# 3.87 % at 110 % (above binpack, and a 2-point collapse); frag now 4.31 % and 4.26 %. The limits are
# the two rules on this run: frag below binpack, the better of the two baselines here
# (MIX_BASELINE_PCT), and no collapse and recover (unallocated at 100 % at most COLLAPSE_POINTS
# above 110 %). The run is the family's worst for frag now (over the twelve multi-card runs, 2.73
# to 4.31 % at 100 %) and its old figure failed both rules, so it is the run that tells first.
MIX_BASELINE_PCT = 5.43
COLLAPSE_POINTS = 1.0


@pytest.fixture(scope="module")
def multi_card_mix(openb):
    from qgpu_runtime.sim.variants import with_demand_share

    nodes, pods = openb
    return nodes, with_demand_share(pods, "multi", MIX_FRACTION, seed=MIX_DRAW)


def _mix_run(mix, factory=None):
    nodes, pods = mix
    result = replay_arrivals(nodes, pods, "frag", MIX_SEED, MIX_CUT, policy_factory=factory)
    return result.unallocated_at(100), result.unallocated_at(110)


def _mix_verdict(at_100: float, at_110: float) -> list[str]:
    problems = []
    if at_100 > MIX_BASELINE_PCT:
        problems.append(f"{at_100:.2f} % unallocated at arrived 100 %, worse than binpack ({MIX_BASELINE_PCT} %)")
    if at_100 - at_110 > COLLAPSE_POINTS:
        problems.append(f"collapse and recover: {at_100:.2f} % at 100 % against {at_110:.2f} % at 110 %")
    return problems


def test_frag_holds_on_a_multi_card_mix(multi_card_mix):
    """Threshold derivation: see MIX_BASELINE_PCT above."""
    problems = _mix_verdict(*_mix_run(multi_card_mix))
    assert not problems, f"frag on the 20 % multi-card mix (draw {MIX_DRAW}, seed {MIX_SEED}): " + "; ".join(problems)


def test_the_mix_guard_fails_frag_weighing_shapes_by_pod_count(multi_card_mix):
    """The guard can fail: frag as it was before issue 27 (shapes weighed by pod count)."""
    from qgpu_runtime.placement.policies import PLANNING_SHAPES, WorkloadShapes

    by_pods = {**PLANNING_SHAPES, "weigh": "pods"}
    at_100, at_110 = _mix_run(multi_card_mix, lambda: FragPolicy(WorkloadShapes(**by_pods)))
    assert _mix_verdict(at_100, at_110), f"{at_100:.2f} % at 100 %, {at_110:.2f} % at 110 %"
