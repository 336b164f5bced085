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
# That bin is the documented figure itself, not an estimate of it: 4.15 for seed 42.
CUT_SEED = 42
CUT = ReplayOptions(extend_to_pct=101)

# Derived from the full figure (docs/benchmarks.md, seeds 42-51): median 4.19 % unallocated at
# arrived 100 %, per seed 4.15, 4.17, 4.24, 4.26, 4.20, 4.21, 4.18, 4.18, 4.17, 4.22; target for
# the median <= 4.3 %. The guard allows seed 42 to reach the worst seed of that run, 4.26: a
# change may trade one seed against another within the spread the documented figure already
# has (0.11 points, about 2.6 % of the waste), but once seed 42 packs worse than every seed of
# the documented run did, the figure regressed. 4.26 also keeps the check under the 4.3 target.
FRAG_UNALLOCATED_PCT_LIMIT = 4.26


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
