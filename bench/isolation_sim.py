"""Isolation benchmarks on the SIMULATED GPU (qgpu_runtime.isolation.simgpu): no GPU needed.

    python bench/isolation_sim.py [--json out.json]

Figures:
- fixed-share accuracy: card time achieved / quota, alone on an idle card and in pairs, with exact
  per-tick measurement and with NVML-like sampling (one sample every 200 ms covering the last
  200 ms for each process that used the card in it, as measured on an H100 and an H200; with
  ``_card``, each such process reported at the whole card's use, as the H200's driver reported
  tenants taking turns);
- burst-share fall-back time: from the moment the owner of the borrowed capacity starts until the
  borrower's 0.5 s running mean is back at its share (+3 points) and stays there;
- offline throttling time: from the moment an online tenant starts until the offline tenant is held.
The workload demands 940 milli of the card when running (the H100 matmul loop's measured busy
fraction) and its queued work drains for 2 ms after a hold (one 1.7 ms step of that loop);
card time = use / 0.94, drained work included. Every run is deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prometheus_client import CollectorRegistry  # noqa: E402

from qgpu_runtime.isolation.engine import CardQuota, IsolationEngine, Workload  # noqa: E402
from qgpu_runtime.isolation.policy import Policy  # noqa: E402
from qgpu_runtime.isolation.simbackend import SimBackend, drive  # noqa: E402
from qgpu_runtime.isolation.simgpu import SimulatedGPU  # noqa: E402
from qgpu_runtime.isolation.watchdog import MemoryWatchdog  # noqa: E402
from qgpu_runtime.model import AppClass  # noqa: E402

TICK = 0.05
DEMAND = 940.0


class _Drop:
    def emit(self, event) -> None:
        pass


def setup(policy: Policy, sampling: float | None, drain_s: float = 0.002, attribution: str = "exact") -> tuple[SimBackend, IsolationEngine]:
    backend = SimBackend({0: SimulatedGPU(0, "GPU-sim-0", "SIM", 81920, drain_s)}, sample_period_s=sampling, attribution=attribution)
    watchdog = MemoryWatchdog(CollectorRegistry(), _Drop(), backend.stop, clock=lambda: 0.0)
    return backend, IsolationEngine(policy, backend, backend, watchdog=watchdog)


def wl(key: str, core: int, klass: AppClass = AppClass.NORMAL) -> Workload:
    return Workload(key, klass, (CardQuota(0, core, 0),))


def card_time_pct(backend: SimBackend, pid: int, seconds: float) -> float:
    return backend.gpus[0].processes[pid].used_total / seconds / DEMAND * 100


def fixed_share(sampling: float | None, cores: list[int], seconds: float = 30.0, attribution: str = "exact") -> list[float]:
    backend, engine = setup(Policy.FIXED_SHARE, sampling, attribution=attribution)
    for i, _ in enumerate(cores):
        backend.start(f"t{i}", 0, i + 1, DEMAND)
    drive(backend, engine, [wl(f"t{i}", c * 10) for i, c in enumerate(cores)], seconds, TICK)
    return [round(card_time_pct(backend, i + 1, seconds), 1) for i in range(len(cores))]


def burst_fallback(sampling: float | None, attribution: str = "exact") -> dict:
    backend, engine = setup(Policy.BURST_SHARE, sampling, attribution=attribution)
    backend.start("a", 0, 1, DEMAND)
    start_tick = 100
    series: list[tuple[float, float]] = []
    last = {"used": 0.0}

    def observe(t: float, report) -> None:
        used = backend.gpus[0].processes[1].used_total
        series.append((t, (used - last["used"]) / TICK))
        last["used"] = used

    drive(backend, engine, [wl("a", 300), wl("b", 700)], 15.0, TICK,
          events={start_tick: lambda b: b.start("b", 0, 2, DEMAND)}, observe=observe)
    t_owner = start_tick * TICK
    after = [(t, u) for t, u in series if t > t_owner]
    window = int(0.5 / TICK)
    means = [(after[i][0], sum(u for _, u in after[i:i + window]) / window / DEMAND * 100) for i in range(len(after) - window)]
    last_over = max((i for i, (_, m) in enumerate(means) if m > 33.0), default=-1)
    fell = means[last_over + 1][0] - TICK - t_owner if last_over + 1 < len(means) else None
    alone = sum(u for t, u in series if t <= t_owner) / len([1 for t, _ in series if t <= t_owner]) / DEMAND * 100
    tail = [u for t, u in series if t > t_owner + 3]
    return {"borrower_alone_pct": round(alone, 1), "fallback_s": None if fell is None else round(max(0.0, fell), 3),
            "borrower_after_pct": round(sum(tail) / len(tail) / DEMAND * 100, 1),
            "owner_after_pct": round(card_time_pct(backend, 2, 15.0 - t_owner), 1)}


def offline_throttle(sampling: float | None, policy: Policy, attribution: str = "exact") -> dict:
    backend, engine = setup(policy, sampling, attribution=attribution)
    backend.start("batch", 0, 1, DEMAND)
    start_tick = 60
    held_at: list[float] = []

    def observe(t: float, report) -> None:
        if t > start_tick * TICK and not held_at and "batch" in report.held:
            held_at.append(t)

    drive(backend, engine, [wl("batch", 500, AppClass.OFFLINE), wl("web", 0, AppClass.ONLINE)], 8.0, TICK,
          events={start_tick: lambda b: b.start("web", 0, 2, DEMAND)}, observe=observe)
    return {"throttled_after_s": round(held_at[0] - start_tick * TICK, 3) if held_at else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    out: dict = {"source": "simulated GPU", "tick_s": TICK, "workload_demand_milli": DEMAND}
    for label, sampling, attribution in (("exact", None, "exact"), ("nvml_200ms", 0.2, "exact"), ("nvml_200ms_card", 0.2, "card")):
        rows = {}
        for cores in ([10], [30], [50], [70], [90], [30, 60], [20, 30, 50]):
            got = fixed_share(sampling, cores, attribution=attribution)
            rows["/".join(map(str, cores))] = {"quota_pct": cores, "card_time_pct": got,
                                              "achieved_over_quota": [round(g / c, 3) for g, c in zip(got, cores)]}
        out[f"fixed_share_{label}"] = rows
        out[f"burst_share_{label}"] = burst_fallback(sampling, attribution)
        out[f"offline_{label}"] = {p.value: offline_throttle(sampling, p, attribution) for p in Policy}
    text = json.dumps(out, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
