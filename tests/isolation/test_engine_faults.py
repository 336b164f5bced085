"""The engine acts on each workload alone: a hold, resume or stop that raises (one tenant's doing,
or a bad read of /proc) is logged and reported, and never keeps the engine from acting on the
others, leaves a workload frozen, or lets an offender off the memory watchdog."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from qgpu_runtime.isolation.engine import CardQuota, IsolationEngine, Workload
from qgpu_runtime.isolation.memory import MemoryViolation
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.isolation.simbackend import SimBackend, drive
from qgpu_runtime.isolation.watchdog import STOP_ROUND_S, MemoryWatchdog
from qgpu_runtime.model import AppClass

from .helpers import ListSink, make_backend

TICK = 0.05


def job(key: str, core: int, memory: int = 0) -> Workload:
    return Workload(key, AppClass.NORMAL, (CardQuota(0, core, memory),))


class Failing:
    """The simulated actuator, except that ``action`` on ``key`` raises its first ``times`` times
    (forever when ``times`` is None); every call is recorded."""

    def __init__(self, backend: SimBackend, action: str, key: str, times: int | None = None) -> None:
        self.backend = backend
        self.action, self.key, self.left = action, key, times
        self.calls: list[tuple[str, str, bool]] = []  # (action, key, went through)

    def _do(self, action: str, key: str, *args: str) -> None:
        if (action, key) == (self.action, self.key) and (self.left is None or self.left > 0):
            if self.left is not None:
                self.left -= 1
            self.calls.append((action, key, False))
            raise RuntimeError(f"{action} {key}: cannot read /proc")
        self.calls.append((action, key, True))
        getattr(self.backend, action)(key, *args)

    def hold(self, key: str) -> None:
        self._do("hold", key)

    def resume(self, key: str) -> None:
        self._do("resume", key)

    def stop(self, key: str, reason: str) -> None:
        self._do("stop", key, reason)


def engine_over(actuator, backend: SimBackend, sink: ListSink | None = None, stop=None) -> IsolationEngine:
    watchdog = MemoryWatchdog(CollectorRegistry(), sink or ListSink(), stop or actuator.stop, clock=lambda: 0.0)
    return IsolationEngine(Policy.FIXED_SHARE, backend, actuator, watchdog=watchdog)


def test_a_hold_that_raises_keeps_the_engine_holding_and_resuming_the_others():
    backend = make_backend()
    actuator = Failing(backend, "hold", "x")
    engine = engine_over(actuator, backend)
    backend.start("a", 0, 1, demand_milli=1000)
    backend.start("x", 0, 2, demand_milli=1000)
    mismatches, failed = [], []

    def observe(t, report):
        failed.extend(report.failed)
        if (backend.gpus[0].processes[1].suspended_at is not None) != ("a" in report.held):
            mismatches.append(t)

    drive(backend, engine, [job("a", 300), job("x", 300)], duration_s=2.0, tick_s=TICK, observe=observe)
    assert mismatches == []  # 'a' was suspended exactly while the engine held it
    a_calls = [action for action, key, _ in actuator.calls if key == "a"]
    assert "hold" in a_calls and "resume" in a_calls
    assert failed and set(failed) == {"hold x"}


def test_a_hold_that_raised_is_sent_again_the_next_tick_while_still_wanted():
    backend = make_backend()
    actuator = Failing(backend, "hold", "x", times=1)
    engine = engine_over(actuator, backend)
    backend.start("x", 0, 1, demand_milli=1000)
    drive(backend, engine, [job("x", 100)], duration_s=0.1, tick_s=TICK)
    assert actuator.calls[:2] == [("hold", "x", False), ("hold", "x", True)]
    assert backend.gpus[0].processes[1].suspended_at is not None and engine.held == {"x"}


def test_closing_resumes_every_held_workload_when_one_resume_raises():
    backend = make_backend()
    actuator = Failing(backend, "resume", "a")
    engine = engine_over(actuator, backend)
    for pid, key in enumerate("abc", start=1):
        backend.start(key, 0, pid, demand_milli=1000)
    drive(backend, engine, [job(k, 100) for k in "abc"], duration_s=0.1, tick_s=TICK)
    held = set(engine.held)
    assert len(held) >= 2 and "a" in held  # time division: one slot, the others held
    engine.close()
    others = {1: "a", 2: "b", 3: "c"}
    assert [k for pid, k in others.items() if k != "a" and backend.gpus[0].processes[pid].suspended_at is not None] == []
    assert engine.held == {"a"}  # still owed its resume


def test_a_stop_that_raises_is_made_again_and_recorded_once_it_went_through():
    backend = make_backend()
    sink = ListSink()
    actuator = Failing(backend, "stop", "greedy", times=1)
    engine = engine_over(actuator, backend, sink)
    backend.start("greedy", 0, 1, demand_milli=100, memory_mib=4096)
    reports = []
    drive(backend, engine, [job("greedy", 500, memory=1024)], duration_s=0.5, tick_s=TICK, observe=lambda t, r: reports.append(r))
    assert [ok for action, _, ok in actuator.calls if action == "stop"] == [False, True]
    assert 1 not in backend.gpus[0].processes  # stopped on the second tick
    assert reports[0].failed == ("stop greedy",)
    assert [e.key for e in sink.events] == ["greedy"]


def test_a_workload_still_over_its_quota_a_stop_round_later_is_stopped_again():
    backend = make_backend()
    sink = ListSink()
    stops: list[str] = []
    # its processes escape every stop (left their process group on SIGTERM): the memory stays held
    engine = engine_over(backend, backend, sink, stop=lambda key, reason: stops.append(key))
    backend.start("escapee", 0, 1, demand_milli=100, memory_mib=12288)
    times: list[float] = []  # the simulated time of each stop (seen after the tick that sent it)

    def observe(t: float, report) -> None:
        if len(stops) > len(times):
            times.append(t)
    drive(backend, engine, [job("escapee", 500, memory=1024)], duration_s=16 * STOP_ROUND_S, tick_s=TICK, observe=observe)
    # stopped again every round while the violation lasts, not once for good
    assert stops == ["escapee"] * 16, times  # at 0, 10, 20 … 150 s
    assert all(round((b - a) / STOP_ROUND_S) == 1 for a, b in zip(times, times[1:])), times
    # but reported at rounds twice as far apart each time: 0, 10, 30, 70 and 150 s
    assert len(sink.events) == 5


def test_a_supervisor_restarting_its_worker_over_the_quota_is_killed_at_once_each_time():
    """Stops used to thin out like the reports (10, 20, 40 … 640 s apart): a container whose PID 1
    started its GPU worker again after each stop held memory over its quota for all but a few
    seconds of every ten minutes (helper audit, 2026-12-01). A violation after the workload was
    seen within its quota is a new one, stopped at once; within a minute of a stop it is killed
    without the grace period; the reports still thin out."""
    sink = ListSink()
    calls: list[tuple[str, float]] = []
    now = [0.0]
    watchdog = MemoryWatchdog(CollectorRegistry(), sink, lambda key, _: calls.append(("stop", now[0])), clock=lambda: 0.0,
                              kill=lambda key, _: calls.append(("kill", now[0])))
    over = MemoryViolation("ns/p/c", 61440, 4096, 0)
    for restart in range(30):  # every 2 s: the worker starts, allocates, is stopped, memory is freed
        now[0] = restart * 2.0
        watchdog.handle(0, over, now[0])
        now[0] += 1.0
        watchdog.within_quota(["ns/p/c"])
    assert calls[0] == ("stop", 0.0) and [c for c, _ in calls[1:]] == ["kill"] * 29  # each restart, at once
    assert len(sink.events) < 5  # the trail thins out: 0, 10, 30 s
    # a minute after the last stop, a violation is a first one again: SIGTERM and its grace
    now[0] = 58.0 + 61.0
    watchdog.handle(0, over, now[0])
    assert calls[-1] == ("stop", now[0])


def test_a_workload_within_its_quota_after_a_stop_is_not_stopped_again():
    calls: list[str] = []
    watchdog = MemoryWatchdog(CollectorRegistry(), ListSink(), lambda key, _: calls.append(key), clock=lambda: 0.0)
    watchdog.handle(0, MemoryViolation("k", 8192, 4096, 0), 0.0)
    for _ in range(1, 100):
        watchdog.within_quota(["k"])
    assert calls == ["k"]


class Escaping(Failing):
    """The simulated actuator, whose held workload ``key`` is resumed behind its back after each
    hold (a helper of the tenant sending SIGCONT) and reads as running."""

    def __init__(self, backend: SimBackend, key: str) -> None:
        super().__init__(backend, "none", key)
        self.resumed_by_tenant = False

    def hold(self, key: str) -> None:
        super().hold(key)
        if key == self.key:
            self.backend.resume(key)  # the tenant's SIGCONT, right after
            self.resumed_by_tenant = True

    def running(self, key: str) -> bool:
        return key == self.key and self.resumed_by_tenant


def test_a_held_workload_resumed_behind_the_engines_back_is_held_again_every_tick_it_runs():
    """A hold was sent once, on the change; a helper process of the tenant (its own group, never
    signalled) sending SIGCONT kept the workload running at a whole card against a 300 share
    (helper audit, 2026-12-01). The engine now asks whether held workloads run and holds again."""
    backend = make_backend()
    backend.start("greedy", 0, 1, demand_milli=1000)
    backend.start("fair", 0, 2, demand_milli=1000)
    escaping = Escaping(backend, "greedy")
    engine = engine_over(escaping, backend)
    drive(backend, engine, [job("greedy", 300), job("fair", 700)], duration_s=2.0, tick_s=TICK)
    holds = [k for action, k, _ in escaping.calls if action == "hold" and k == "greedy"]
    assert len(holds) > 10  # held again while it ran, not once

    plain = Failing(make_backend(), "none", "greedy")
    plain.backend.start("greedy", 0, 1, demand_milli=1000)
    plain.backend.start("fair", 0, 2, demand_milli=1000)
    drive(plain.backend, engine_over(plain, plain.backend), [job("greedy", 300), job("fair", 700)], duration_s=2.0, tick_s=TICK)
    plain_holds = [k for action, k, _ in plain.calls if action == "hold" and k == "greedy"]
    assert len(plain_holds) < len(holds)  # an actuator that cannot tell: holds on change only, as before
