"""Estimate-and-correct accounting of sparse NVML samples."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgpu_runtime.isolation.control import ControlParams
from qgpu_runtime.isolation.engine import CardQuota, Workload
from qgpu_runtime.isolation.estimator import RawSample, UsageEstimator
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.isolation.simbackend import drive
from qgpu_runtime.model import AppClass

from .helpers import make_backend, make_engine


def test_between_samples_a_running_process_is_charged_its_last_running_rate():
    est = UsageEstimator()
    for n in range(1, 5):  # four free-running ticks, then the driver's sample for them: 60 % busy
        est.charge(7, 0.05, True, [RawSample(n * 50_000, 60.0)] if n == 4 else [])
    assert est.charge(7, 0.05, True, []) == pytest.approx(600 * 0.05)


def test_a_held_process_is_charged_nothing_until_a_sample_says_otherwise():
    est = UsageEstimator()
    est.charge(7, 0.05, True, [RawSample(50_000, 60.0)])
    assert est.charge(7, 0.05, False, []) == 0.0


def test_a_sample_replaces_the_estimates_of_the_ticks_of_its_period():
    est = UsageEstimator()
    charged = sum(est.charge(7, 0.05, True, []) for _ in range(3))  # 3 x 50 estimated at 1000
    # the sample for the last 200 ms (these 3 ticks and this one) says 50 % busy: 100 in all
    charged += est.charge(7, 0.05, True, [RawSample(200_000, 50.0)])
    assert charged == pytest.approx(100.0)


def test_a_sample_covers_one_driver_period_not_the_time_since_the_previous_one():
    # the H200 fault: a tenant held for a second, then sampled once at 25 %, was charged a second
    # at 25 % (250) instead of one 200 ms period (50), fell into debt and got 8 % of a 30 % share
    est = UsageEstimator()
    for n in range(1, 9):  # learn the driver's 200 ms period from a busy stretch
        for _ in range(3):
            est.charge(7, 0.05, True, [])
        est.charge(7, 0.05, True, [RawSample(n * 200_000, 100.0)])
    assert est.period_s() == pytest.approx(0.2)
    for _ in range(19):  # held a second: no samples
        est.charge(7, 0.05, False, [])
    # this tick's estimate (50 at the learned 1000) replaced by one period at 25 %: 50, not 250
    assert est.charge(7, 0.05, True, [RawSample(9 * 200_000 + 1_000_000, 25.0)]) == pytest.approx(50.0)


def test_a_sample_never_covers_more_than_the_time_since_the_previous_one():
    est = UsageEstimator()  # assumes 200 ms until it has learned the period
    est.charge(7, 0.05, True, [RawSample(1_000_000, 60.0)])
    # a driver that samples every 50 ms: this sample covers 50 ms, not an assumed 200
    assert est.charge(7, 0.05, True, [RawSample(1_050_000, 60.0)]) == pytest.approx(600 * 0.05)


def test_the_first_sample_reaches_back_no_further_than_the_process_is_known():
    est = UsageEstimator()
    assert est.charge(7, 0.05, True, [RawSample(9_000_000, 40.0)]) == pytest.approx(400 * 0.05)


@pytest.mark.parametrize(("gaps", "period"), [
    ([0.2] * 8, 0.2),
    ([0.4, 0.6, 0.4, 0.8, 0.6, 0.4, 1.0, 0.6], 0.2),  # a tenant sampled only when it ran: multiples
    ([0.4] * 8, 0.4),
    ([0.201, 0.399, 0.6, 0.198, 0.8, 0.2, 0.41, 0.19], 0.2),  # the driver's jitter
])
def test_the_driver_period_is_the_longest_one_every_spacing_is_a_multiple_of(gaps, period):
    est = UsageEstimator()
    ts = 1_000_000
    est.charge(7, 0.05, True, [RawSample(ts, 50.0)])
    for gap in gaps:
        ts += round(gap * 1e6)
        est.charge(7, 0.05, True, [RawSample(ts, 50.0)])
    assert est.period_s() == pytest.approx(period, rel=0.03)


def test_until_enough_spacings_were_seen_the_period_is_the_measured_default():
    est = UsageEstimator()
    for n in range(1, 4):
        est.charge(7, 0.05, True, [RawSample(n * 400_000, 50.0)])
    assert est.period_s() == 0.2


def test_a_slot_is_charged_by_time_and_a_sample_adds_only_what_ran_beyond_it():
    est = UsageEstimator()
    # one slot tick, three held ticks; the driver saw 30 % of the 200 ms: 60, of which 50 was the slot
    est.charge(7, 0.05, True, [], slot=True)
    est.charge(7, 0.05, False, [])
    est.charge(7, 0.05, False, [])
    assert est.charge(7, 0.05, False, [RawSample(200_000, 30.0)]) == pytest.approx(10.0)
    # within the slot's time: nothing more, and never a refund of the slot
    est.charge(7, 0.05, True, [], slot=True)
    est.charge(7, 0.05, False, [])
    est.charge(7, 0.05, False, [])
    assert est.charge(7, 0.05, False, [RawSample(400_000, 20.0)]) == 0.0


def test_a_busy_sample_beside_another_tenants_slot_corrects_nothing_but_zero_is_believed():
    est = UsageEstimator()
    # H200: tenants taking turns were each reported at ~95 % of the same periods
    for _ in range(3):
        est.charge(7, 0.05, False, [], others_slot=True)
    assert est.charge(7, 0.05, False, [RawSample(200_000, 95.0)], others_slot=True) == 0.0
    for _ in range(3):
        est.charge(7, 0.05, True, [], others_slot=True)  # running free beside it, estimated at 1000
    assert est.charge(7, 0.05, True, [RawSample(400_000, 0.0)], others_slot=True) == pytest.approx(50 - 200)


def test_beside_its_own_slots_a_busy_sample_is_not_believed_while_others_used_the_card():
    est = UsageEstimator()
    est.charge(7, 0.05, True, [], slot=True, others_busy=True)
    for _ in range(2):
        est.charge(7, 0.05, False, [], others_busy=True)
    assert est.charge(7, 0.05, False, [RawSample(200_000, 90.0)], others_busy=True) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(0, 100)), min_size=1, max_size=40))
def test_with_a_sample_every_period_every_measured_milli_second_is_charged_once(periods):
    # a process alone and never slotted, four 50 ms ticks per 200 ms driver period: whatever was
    # estimated, what is charged once a period's sample is in is exactly what the driver measured
    est = UsageEstimator()
    charged = measured = 0.0
    for n, (running, util) in enumerate(periods, start=1):
        for _ in range(3):
            charged += est.charge(1, 0.05, running, [])
        charged += est.charge(1, 0.05, running, [RawSample(n * 200_000, util)])
        measured += util * 10 * 0.2
    assert charged == pytest.approx(measured, abs=1e-6)


@pytest.mark.parametrize("core", [100, 300, 500, 700])
def test_fixed_share_holds_its_share_with_nvml_like_sparse_samples(core):
    backend = make_backend(drain_s=0.01)
    backend.sample_period_s = 0.4
    engine = make_engine(backend, Policy.FIXED_SHARE, ControlParams())
    backend.start("a", 0, 1, demand_milli=940)
    drive(backend, engine, [Workload("a", AppClass.NORMAL, (CardQuota(0, core, 0),))], duration_s=20.0, tick_s=0.05)
    assert backend.gpus[0].processes[1].used_total / 20.0 == pytest.approx(core, abs=20)


@pytest.mark.parametrize("attribution", ["exact", "card"])
def test_shares_hold_when_the_driver_skips_idle_periods_or_reports_the_whole_card(attribution):
    # what the H200 showed: no sample for a period a tenant was held, and tenants taking turns each
    # reported at the card's use; before, a 10 % tenant alone got 1 % and the smaller of two 8 %
    backend = make_backend(drain_s=0.002)
    backend.sample_period_s, backend.attribution = 0.2, attribution
    engine = make_engine(backend, Policy.FIXED_SHARE, ControlParams())
    cores = {"a": 100, "b": 300, "c": 500}
    for pid, key in enumerate(cores, start=1):
        backend.start(key, 0, pid, demand_milli=940)
    drive(backend, engine, [Workload(k, AppClass.NORMAL, (CardQuota(0, c, 0),)) for k, c in cores.items()], duration_s=20.0, tick_s=0.05)
    got = {k: backend.gpus[0].processes[pid].used_total / 20.0 / 0.94 for pid, k in enumerate(cores, start=1)}
    assert got == {k: pytest.approx(c, abs=20) for k, c in cores.items()}


def test_alone_a_tenant_gets_its_share_when_it_is_sampled_only_in_the_periods_it_ran():
    backend = make_backend(drain_s=0.002)
    backend.sample_period_s = 0.2
    engine = make_engine(backend, Policy.FIXED_SHARE, ControlParams())
    backend.start("a", 0, 1, demand_milli=940)
    drive(backend, engine, [Workload("a", AppClass.NORMAL, (CardQuota(0, 100, 0),))], duration_s=20.0, tick_s=0.05)
    assert backend.gpus[0].processes[1].used_total / 20.0 / 0.94 == pytest.approx(100, abs=10)
