"""The policies' promises, checked on the simulated GPU (deterministic; no clocks, no GPU)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from qgpu_runtime.isolation.control import ControlParams
from qgpu_runtime.isolation.engine import CardQuota, IsolationEngine, Workload
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.isolation.simbackend import drive
from qgpu_runtime.isolation.watchdog import MemoryWatchdog
from qgpu_runtime.model import AppClass

from .helpers import make_backend, make_engine

TICK = 0.05


def job(key: str, core: int, memory: int = 0, klass: AppClass = AppClass.NORMAL, card: int = 0) -> Workload:
    return Workload(key, klass, (CardQuota(card, core, memory),))


def used_share(backend, pid: int, seconds: float, card: int = 0) -> float:
    return backend.gpus[card].processes[pid].used_total / seconds


@settings(max_examples=25, deadline=None)
@given(core=st.integers(min_value=10, max_value=990), drain=st.sampled_from([0.0, 0.02, 0.12]))
def test_fixed_share_never_exceeds_its_share_on_an_idle_card(core, drain):
    backend = make_backend(drain_s=drain)
    engine = make_engine(backend, Policy.FIXED_SHARE)
    backend.start("a", 0, 1, demand_milli=1000)
    worst = 0.0
    window_start = {"t": 0.0, "used": 0.0}

    def observe(t, report):
        nonlocal worst
        # over every 2-second window the tenant stays within its share plus the bucket bound
        if t - window_start["t"] >= 2.0 - 1e-9:
            used = backend.gpus[0].processes[1].used_total
            worst = max(worst, (used - window_start["used"]) / (t - window_start["t"]))
            window_start.update(t=t, used=used)

    drive(backend, engine, [job("a", core)], duration_s=10.0, tick_s=TICK, observe=observe)
    # the law is reactive: one tick plus the queued work that drains after a hold may overshoot
    bound = core + (core * ControlParams().window_s + 1000 * (TICK + drain)) / 2.0
    assert worst <= bound
    # and it is not starved either: over the whole run it gets its share within 2 points
    assert used_share(backend, 1, 10.0) == pytest.approx(core, abs=20)


def test_best_effort_splits_a_busy_card_about_evenly():
    backend = make_backend()
    engine = make_engine(backend, Policy.BEST_EFFORT)
    for pid, key in enumerate("abc", start=1):
        backend.start(key, 0, pid, demand_milli=1000)
    drive(backend, engine, [job("a", 100), job("b", 300), job("c", 600)], duration_s=3.0, tick_s=TICK)
    for pid in (1, 2, 3):
        assert used_share(backend, pid, 3.0) == pytest.approx(1000 / 3, abs=1)
    assert engine.held == frozenset()


def test_best_effort_lets_a_lone_tenant_use_the_whole_card():
    backend = make_backend()
    engine = make_engine(backend, Policy.BEST_EFFORT)
    backend.start("a", 0, 1, demand_milli=1000)
    drive(backend, engine, [job("a", 200)], duration_s=2.0, tick_s=TICK)
    assert used_share(backend, 1, 2.0) == pytest.approx(1000)


def test_fixed_share_gives_each_busy_tenant_its_share_under_contention():
    backend = make_backend()
    engine = make_engine(backend, Policy.FIXED_SHARE)
    backend.start("a", 0, 1, demand_milli=1000)
    backend.start("b", 0, 2, demand_milli=1000)
    drive(backend, engine, [job("a", 300), job("b", 600)], duration_s=10.0, tick_s=TICK)
    assert used_share(backend, 1, 10.0) == pytest.approx(300, abs=15)
    assert used_share(backend, 2, 10.0) == pytest.approx(600, abs=15)


def test_burst_share_borrows_idle_capacity():
    backend = make_backend()
    engine = make_engine(backend, Policy.BURST_SHARE)
    backend.start("a", 0, 1, demand_milli=1000)
    drive(backend, engine, [job("a", 300), job("b", 700)], duration_s=3.0, tick_s=TICK)
    assert used_share(backend, 1, 3.0) > 950


def test_burst_share_falls_back_to_the_share_within_a_bounded_time_when_the_owner_returns():
    backend = make_backend()
    engine = make_engine(backend, Policy.BURST_SHARE)
    backend.start("a", 0, 1, demand_milli=1000)
    owner_starts = 40  # tick 40 = 2.0 s
    fell_back_at: list[float] = []
    series: list[tuple[float, float]] = []

    def observe(t, report):
        a = report.usage.get(0, {}).get("a")
        if a is not None and t > owner_starts * TICK:
            series.append((t, a.used_milli))

    drive(backend, engine, [job("a", 300), job("b", 700)], duration_s=8.0, tick_s=TICK,
          events={owner_starts: lambda b: b.start("b", 0, 2, demand_milli=1000)}, observe=observe)
    # from some point within 0.5 s of the owner's return, the borrower's 0.5 s running mean stays at its share
    means = [(series[i][0], sum(u for _, u in series[i:i + 10]) / 10) for i in range(len(series) - 10)]
    fell_back_at = next(t for t, m in means if all(mm <= 300 + 30 for _, mm in means if _ >= t))
    assert fell_back_at - owner_starts * TICK <= 0.5
    owner_share = (backend.gpus[0].processes[2].used_total) / 6.0
    assert owner_share == pytest.approx(700, abs=35)


def test_offline_work_is_throttled_within_a_bounded_time_when_online_work_becomes_busy():
    backend = make_backend()
    engine = make_engine(backend, Policy.BEST_EFFORT)
    backend.start("batch", 0, 1, demand_milli=1000)
    online_starts = 20
    throttled_at: list[float] = []

    def observe(t, report):
        if t > online_starts * TICK and not throttled_at and "batch" in report.held:
            throttled_at.append(t)

    drive(backend, engine, [job("batch", 500, klass=AppClass.OFFLINE), job("web", 0, klass=AppClass.ONLINE)],
          duration_s=5.0, tick_s=TICK, events={online_starts: lambda b: b.start("web", 0, 2, demand_milli=1000)},
          observe=observe)
    assert throttled_at and throttled_at[0] - online_starts * TICK <= 2 * TICK
    # once held, the online tenant has the card: over the last 3 s it used (nearly) all of it
    proc = backend.gpus[0].processes
    assert proc[2].used_total / 4.0 > 950


def test_offline_work_resumes_after_online_work_goes_idle():
    backend = make_backend()
    engine = make_engine(backend, Policy.FIXED_SHARE)
    backend.start("batch", 0, 1, demand_milli=1000)
    backend.start("web", 0, 2, demand_milli=1000)
    workloads = [job("batch", 500, klass=AppClass.OFFLINE), job("web", 0, klass=AppClass.ONLINE)]
    drive(backend, engine, workloads, duration_s=1.0, tick_s=TICK)
    assert "batch" in engine.held
    backend.gpus[0].set_demand(2, 0)
    before = backend.gpus[0].processes[1].used_total
    drive(backend, engine, workloads, duration_s=3.0, tick_s=TICK)
    # batch regains its (fixed) share of 50 % after the online hysteresis (about 1 s)
    assert (backend.gpus[0].processes[1].used_total - before) / 3.0 > 300


def test_online_tenant_is_never_throttled_under_fixed_share():
    backend = make_backend()
    engine = make_engine(backend, Policy.FIXED_SHARE)
    backend.start("web", 0, 1, demand_milli=1000)
    drive(backend, engine, [job("web", 0, memory=1024, klass=AppClass.ONLINE)], duration_s=2.0, tick_s=TICK)
    assert used_share(backend, 1, 2.0) == pytest.approx(1000)


@pytest.mark.parametrize("policy", [Policy.FIXED_SHARE, Policy.BURST_SHARE])
@pytest.mark.parametrize("unreserved", [1, 3, 7])
def test_tenants_that_reserved_no_compute_do_not_dilute_a_busy_share(policy, unreserved):
    """HAMi ``gpumem`` without ``gpucores``, KAI fractions, T9k percents: core 0 booked and charged.
    Before, they ran unlimited beside a booked share: seven of them cut a busy 500-milli share to 63."""
    backend = make_backend(memory_mib=32768)
    engine = make_engine(backend, policy)
    backend.start("paid", 0, 1, demand_milli=1000)
    workloads = [job("paid", 500, memory=4096)]
    for i in range(unreserved):
        backend.start(f"free{i}", 0, 10 + i, demand_milli=1000)
        workloads.append(job(f"free{i}", 0, memory=1024))
    drive(backend, engine, workloads, duration_s=10.0, tick_s=TICK)
    assert used_share(backend, 1, 10.0) >= 470
    # and what the share leaves goes to them, not to waste
    assert sum(used_share(backend, 10 + i, 10.0) for i in range(unreserved)) >= 470


@pytest.mark.parametrize("policy", [Policy.FIXED_SHARE, Policy.BURST_SHARE])
def test_a_tenant_that_reserved_no_compute_has_the_card_while_the_shares_are_idle(policy):
    backend = make_backend(memory_mib=32768)
    engine = make_engine(backend, policy)
    backend.start("free", 0, 1, demand_milli=1000)
    drive(backend, engine, [job("free", 0, memory=1024), job("paid", 500, memory=4096)], duration_s=3.0, tick_s=TICK)
    assert used_share(backend, 1, 3.0) == pytest.approx(1000)


def test_memory_cap_stops_the_offender_and_records_why(sink):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    backend = make_backend()
    engine = make_engine(backend, Policy.BEST_EFFORT, sink=sink, registry=registry)
    backend.start("greedy", 0, 1, demand_milli=500, memory_mib=1024)
    backend.start("polite", 0, 2, demand_milli=500, memory_mib=1024)
    workloads = [job("greedy", 500, memory=2048), job("polite", 500, memory=2048)]
    drive(backend, engine, workloads, duration_s=0.5, tick_s=TICK,
          events={5: lambda b: b.gpus[0].allocate(1, 2048)})
    assert "greedy" in backend.stopped and "polite" not in backend.stopped
    assert 1 not in backend.gpus[0].processes and 2 in backend.gpus[0].processes
    assert [(e.key, e.reason) for e in sink.events] == [("greedy", "GPUMemoryQuotaExceeded")]
    assert "3072 MiB" in sink.events[0].message and "2048 MiB" in sink.events[0].message
    assert registry.get_sample_value("qgpu_memory_quota_violations_total", {"workload": "greedy", "card": "0"}) == 1.0


def test_closing_the_engine_resumes_every_held_workload():
    backend = make_backend()
    engine = make_engine(backend, Policy.FIXED_SHARE)
    backend.start("a", 0, 1, demand_milli=1000)
    drive(backend, engine, [job("a", 100)], duration_s=0.1, tick_s=TICK)
    assert engine.held == {"a"}
    engine.close()
    assert backend.gpus[0].processes[1].suspended_at is None and engine.held == frozenset()


def test_a_workload_on_two_cards_is_held_when_either_card_says_so():
    backend = make_backend(cards=2)
    engine = make_engine(backend, Policy.FIXED_SHARE)
    backend.start("ab", 0, 1, demand_milli=1000)
    backend.start("ab", 1, 2, demand_milli=100)
    w = Workload("ab", AppClass.NORMAL, (CardQuota(0, 200, 0), CardQuota(1, 900, 0)))
    drive(backend, engine, [w], duration_s=0.1, tick_s=TICK)
    assert engine.held == {"ab"}
    assert backend.gpus[1].processes[2].suspended_at is not None


def test_only_the_most_recently_gone_workloads_keep_their_violation_series(sink):
    """A job killed for its memory is gone at once, so its series stays for the next scrapes; before,
    every series stayed for the manager's life (one per pod ever stopped)."""
    registry = CollectorRegistry()
    backend = make_backend()
    watchdog = MemoryWatchdog(registry, sink, backend.stop, clock=lambda: 0.0, keep_gone=2)
    engine = IsolationEngine(Policy.BEST_EFFORT, backend, backend, ControlParams(), watchdog)
    for n in range(4):
        backend.start(f"ns/p{n}/main", 0, 10 + n, demand_milli=100, memory_mib=2048)
        drive(backend, engine, [job(f"ns/p{n}/main", 500, memory=1024)], duration_s=0.1, tick_s=TICK)
    kept = [n for n in range(4)
            if registry.get_sample_value("qgpu_memory_quota_violations_total", {"workload": f"ns/p{n}/main", "card": "0"}) == 1]
    assert kept == [2, 3]


def test_a_workload_that_left_and_came_back_is_judged_afresh_by_the_watchdog(sink):
    backend = make_backend()
    engine = make_engine(backend, Policy.BEST_EFFORT, sink=sink)
    w = job("j", 500, memory=1024)
    backend.start("j", 0, 1, demand_milli=100, memory_mib=2048)
    drive(backend, engine, [w], duration_s=0.1, tick_s=TICK)
    drive(backend, engine, [], duration_s=0.1, tick_s=TICK)  # gone: the key is forgotten
    backend.start("j", 0, 2, demand_milli=100, memory_mib=2048)
    drive(backend, engine, [w], duration_s=0.1, tick_s=TICK)
    assert [e.key for e in sink.events] == ["j", "j"]
