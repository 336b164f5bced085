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
    est.charge(7, 0.05, True, [RawSample(50_000, 60.0)])
    assert est.charge(7, 0.05, True, []) == pytest.approx(600 * 0.05)


def test_a_held_process_is_charged_nothing_until_a_sample_says_otherwise():
    est = UsageEstimator()
    est.charge(7, 0.05, True, [RawSample(50_000, 60.0)])
    assert est.charge(7, 0.05, False, []) == 0.0


def test_a_sample_charges_the_difference_between_measured_and_estimated():
    est = UsageEstimator()
    est.charge(7, 0.1, True, [RawSample(100_000, 100.0)])  # rate 1000 learned
    est.charge(7, 0.1, True, [])  # estimated 100
    # the sample for (0.1 s, 0.3 s] says 50 % busy: 100 measured, 100 + 100 estimated -> refund 100
    assert est.charge(7, 0.1, True, [RawSample(300_000, 50.0)]) == pytest.approx(100 + 100 - 200)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(0, 100), st.booleans()), min_size=1, max_size=60))
def test_every_measured_milli_second_is_charged_exactly_once(ticks):
    # 60 ticks of 50 ms stay under the estimator's 5 s cap on one sample's interval
    est = UsageEstimator()
    dt = 0.05
    charged = measured = 0.0
    last_ts = 0
    for n, (running, util, sample_now) in enumerate(ticks, start=1):
        ts = round(n * dt * 1e6)
        raw = [RawSample(ts, util)] if sample_now else []
        if sample_now:
            measured += util * 10 * (ts - last_ts) / 1e6
            last_ts = ts
        charged += est.charge(1, dt, running, raw)
    # the close a final sample would bring: what was estimated since the last sample is not yet measured
    pending = est._tracks[1].pending
    assert charged - pending == pytest.approx(measured, abs=1e-6)


@pytest.mark.parametrize("core", [100, 300, 500, 700])
def test_fixed_share_holds_its_share_with_nvml_like_sparse_samples(core):
    backend = make_backend(drain_s=0.01)
    backend.sample_period_s = 0.4
    engine = make_engine(backend, Policy.FIXED_SHARE, ControlParams())
    backend.start("a", 0, 1, demand_milli=940)
    drive(backend, engine, [Workload("a", AppClass.NORMAL, (CardQuota(0, core, 0),))], duration_s=20.0, tick_s=0.05)
    assert backend.gpus[0].processes[1].used_total / 20.0 == pytest.approx(core, abs=20)
