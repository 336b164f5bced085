"""Isolation on a REAL GPU: PyTorch workloads under each policy, driven by the isolation engine.

Run on a machine with an NVIDIA GPU, PyTorch and nvidia-ml-py, from the repository root:

    python3 bench/isolation_gpu.py --out results.json

Scenarios (each a fresh set of worker processes running bench/isolation_workload.py):
bare vs best-effort (overhead), best-effort pair (time-sliced split), fixed-share by duty cycling
(alone and in a pair), burst-share fall-back, offline throttling, the NVML memory watchdog, and,
when nvidia-cuda-mps-control is usable, fixed-share by MPS thread percentage and MPS pinned memory.
Throughput share = a worker's steps/s over a window divided by the bare worker's steps/s.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prometheus_client import CollectorRegistry  # noqa: E402

from qgpu_runtime.gpu.nvml_lib import cuda_driver_version, load_nvml  # noqa: E402
from qgpu_runtime.gpu.nvml_processes import ProcessSampler  # noqa: E402
from qgpu_runtime.isolation.control import ControlParams  # noqa: E402
from qgpu_runtime.isolation.engine import CardQuota, IsolationEngine, Workload  # noqa: E402
from qgpu_runtime.isolation.mps import MpsDaemon, client_env, pinned_limits_supported  # noqa: E402
from qgpu_runtime.isolation.nvml_sampler import NvmlSampler  # noqa: E402
from qgpu_runtime.isolation.policy import Policy  # noqa: E402
from qgpu_runtime.isolation.signals import SignalActuator  # noqa: E402
from qgpu_runtime.isolation.watchdog import IsolationEvent, MemoryWatchdog  # noqa: E402
from qgpu_runtime.model import AppClass  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TICK = 0.05


@dataclass
class Worker:
    key: str
    klass: AppClass
    core: int
    memory: int
    proc: subprocess.Popen
    out: str

    def series(self) -> list[tuple[float, int]]:
        rows = []
        try:
            with open(self.out) as f:
                for line in f:
                    if line.startswith("#"):
                        continue
                    parts = line.split()
                    if len(parts) == 2:
                        rows.append((float(parts[0]), int(parts[1])))
        except OSError:
            pass
        return rows

    def notes(self) -> list[str]:
        try:
            return [l.strip() for l in open(self.out) if l.startswith("#")]
        except OSError:
            return []


def rate(series: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Steps per second completed within [t0, t1]."""
    if t1 <= t0 or not series:
        return 0.0
    times = [t for t, _ in series]
    lo = bisect.bisect_left(times, t0)
    hi = bisect.bisect_right(times, t1)
    if hi <= lo:
        return 0.0
    base = series[lo - 1][1] if lo > 0 else series[lo][1]
    return (series[hi - 1][1] - base) / (t1 - t0)


def started_at(w: Worker) -> float | None:
    s = w.series()
    return s[0][0] if s else None


def spawn(tmp: str, key: str, seconds: float, klass=AppClass.NORMAL, core=0, memory=0, env=None, args=()) -> Worker:
    out = os.path.join(tmp, f"{key}.txt")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "isolation_workload.py"), "--seconds", str(seconds), "--out", out, *args],
        start_new_session=True, env={**os.environ, **(env or {})}, stderr=open(os.path.join(tmp, f"{key}.err"), "w"),
    )
    return Worker(key, klass, core, memory, proc, out)


def wait_started(workers: list[Worker], timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(started_at(w) is not None or w.proc.poll() is not None for w in workers):
            return
        time.sleep(0.05)


class Sink:
    def __init__(self) -> None:
        self.events: list[IsolationEvent] = []

    def emit(self, event: IsolationEvent) -> None:
        self.events.append(event)


def control(nvml, policy: Policy, workers: list[Worker], until, enforce_compute=True, later=()) -> dict:
    """Run the engine over live workers until ``until()`` is true or all exited. ``later`` is a list
    of (condition, action) run once each when the condition becomes true."""
    by_pgid: dict[int, str] = {}

    def owner(pid: int) -> str | None:
        try:
            return by_pgid.get(os.getpgid(pid))
        except ProcessLookupError:
            return None

    groups = lambda key: [w.proc.pid for w in workers if w.key == key]  # noqa: E731
    actuator = SignalActuator(groups, grace_s=2.0)
    sink = Sink()
    watchdog = MemoryWatchdog(CollectorRegistry(), sink, actuator.stop)
    raw: list[tuple[float, str | None, int, int]] = []  # (read at, workload, driver ts, SM %): the sampling as seen
    reader = RecordingReader(ProcessSampler(nvml, [0]).reader(), owner, raw)
    sampler = NvmlSampler(reader, owner)
    engine = IsolationEngine(policy, sampler, actuator, ControlParams(), watchdog, 0, enforce_compute)
    pending = list(later)
    held_log: list[tuple[float, list[str]]] = []
    ticks: list = []  # (time, dt, held, usage given to the law, buckets after it)
    last = time.monotonic()
    try:
        while True:
            for w in workers:
                by_pgid[w.proc.pid] = w.key
            live = [w for w in workers if w.proc.poll() is None]
            for item in list(pending):
                if item[0]():
                    item[1]()
                    pending.remove(item)
            if (not live and not pending) or until():
                break
            time.sleep(max(0.0, last + TICK - time.monotonic()))
            now = time.monotonic()
            report = engine.tick([Workload(w.key, w.klass, (CardQuota(0, w.core, w.memory),)) for w in live], now - last)
            actuator.reap()
            state = engine._states.get(0)
            ticks.append((round(now, 4), round(now - last, 4), sorted(report.held),
                          {k: round(u.used_milli, 1) for k, u in report.usage.get(0, {}).items()},
                          {k: round(t.bucket, 1) for k, t in state.tenants.items()} if state else {}))
            last = now
            held_log.append((now, sorted(report.held)))
    finally:
        engine.close()
    return {"held_log": held_log, "events": [e.__dict__ for e in sink.events], "raw_samples": raw, "ticks": ticks,
            "sampling": sampling_summary(raw)}


class RecordingReader:
    """The gpu edge's reader, recording every driver sample the engine is given."""

    def __init__(self, inner, owner, raw: list) -> None:
        self._inner, self._owner, self._raw = inner, owner, raw
        self.indices = inner.indices

    def card(self, index: int):
        procs = self._inner.card(index)
        now = time.time()  # NVML's timestamps are the CPU's wall clock
        for p in procs:
            for s in p.sm:
                self._raw.append((round(now, 4), self._owner(p.pid), s.ts_us, s.sm_pct))
        return procs


def sampling_summary(raw: list) -> dict:
    """Per workload: samples seen, how many said 0 %, and the spacing of its driver timestamps."""
    out: dict = {}
    for key in sorted({r[1] for r in raw if r[1]}):
        ts = [r[2] for r in raw if r[1] == key]
        gaps = sorted((b - a) / 1e6 for a, b in zip(ts, ts[1:]))
        out[key] = {"samples": len(ts), "zero_pct_samples": sum(1 for r in raw if r[1] == key and r[3] == 0),
                    "gap_s_min_p20_median_max": [round(gaps[int(q * (len(gaps) - 1))], 3) for q in (0, 0.2, 0.5, 1)] if gaps else None,
                    "read_lag_s_median": round(sorted(r[0] - r[2] / 1e6 for r in raw if r[1] == key)[len(ts) // 2], 3) if ts else None}
    return out


def finish(workers: list[Worker]) -> None:
    for w in workers:
        try:
            w.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            w.proc.kill()


def solo_rate(w: Worker) -> float:
    s = w.series()
    return rate(s, s[0][0] + 1.0, s[-1][0]) if len(s) > 2 else 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--only", help="comma-separated scenario names to run (the bare baseline always runs)")
    ap.add_argument("--trace", help="also write each duty-cycled scenario's NVML samples and per-tick law state here")
    a = ap.parse_args()
    traces: dict = {}
    nvml = load_nvml()
    results: dict = {"device": nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0)),
                     "driver": nvml.nvmlSystemGetDriverVersion(), "cuda_driver_version": cuda_driver_version(nvml),
                     "tick_s": TICK, "source": "real GPU"}
    tmp = tempfile.mkdtemp(prefix="qgpu-bench-")
    S = a.seconds

    def save():
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
        if a.trace:
            with open(a.trace, "w") as f:
                json.dump(traces, f, default=str)

    only = set(a.only.split(",")) if a.only else None

    def scenario(name):
        def wrap(fn):
            if only is not None and name not in only:
                return
            t = time.monotonic()
            try:
                results[name] = fn()
            except Exception as err:  # a failed scenario is reported, the rest still run
                results[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}
            results[name]["wall_s"] = round(time.monotonic() - t, 1) if isinstance(results[name], dict) else None
            print(name, json.dumps({k: v for k, v in results[name].items() if k not in ("held_log", "trace")}, default=str)[:600], flush=True)
            save()
        return wrap

    # 1. bare vs best-effort, alternated to average out clock drift
    bare_rates, be_rates = [], []
    for rnd in range(2):
        w = spawn(tmp, f"bare{rnd}", S)
        finish([w])
        bare_rates.append(solo_rate(w))
        w = spawn(tmp, f"be{rnd}", S, core=300, memory=8192)
        control(nvml, Policy.BEST_EFFORT, [w], until=lambda: False)
        finish([w])
        be_rates.append(solo_rate(w))
    T0 = sum(bare_rates) / len(bare_rates)
    results["bare_vs_best_effort"] = {
        "bare_steps_per_s": bare_rates, "best_effort_steps_per_s": be_rates,
        "overhead_pct": round(100 * (1 - (sum(be_rates) / len(be_rates)) / T0), 2)}
    print("bare_vs_best_effort", results["bare_vs_best_effort"], flush=True)
    save()

    def share_window(ws: list[Worker]) -> tuple[float, float]:
        starts = [started_at(w) for w in ws]
        ends = [w.series()[-1][0] for w in ws]
        return max(starts) + 1.0, min(ends) - 0.2

    @scenario("best_effort_pair")
    def _():
        ws = [spawn(tmp, "bea", S + 4, core=300, memory=8192), spawn(tmp, "beb", S + 4, core=600, memory=8192)]
        control(nvml, Policy.BEST_EFFORT, ws, until=lambda: False)
        finish(ws)
        t0, t1 = share_window(ws)
        return {"quota_pct": [30, 60], "share_pct": [round(100 * rate(w.series(), t0, t1) / T0, 1) for w in ws]}

    def fixed(name, cores):
        ws = [spawn(tmp, f"{name}{i}", S + 4, core=c * 10, memory=8192) for i, c in enumerate(cores)]
        out = control(nvml, Policy.FIXED_SHARE, ws, until=lambda: False)
        finish(ws)
        t0, t1 = share_window(ws)
        shares = [round(100 * rate(w.series(), t0, t1) / T0, 1) for w in ws]
        traces[name] = {"raw_samples": out["raw_samples"], "ticks": out["ticks"], "window": [t0, t1]}
        return {"mechanism": "duty cycling (SIGSTOP/SIGCONT) + NVML", "quota_pct": list(cores), "share_pct": shares,
                "sampling": out["sampling"],
                "error_points": [round(s - c, 1) for s, c in zip(shares, cores)],
                "held_fraction": [round(sum(1 for _, h in out["held_log"] if w.key in h) / max(1, len(out["held_log"])), 3) for w in ws]}

    for cores in ([30], [50], [70]):
        scenario(f"fixed_share_solo_{cores[0]}")(lambda cores=cores: fixed(f"fs{cores[0]}_", cores))
    scenario("fixed_share_pair_30_60")(lambda: fixed("fsp", [30, 60]))

    @scenario("burst_share_fallback")
    def _():
        a_ = spawn(tmp, "bsa", S + 14, core=300, memory=8192)
        holder: list[Worker] = []
        ws = [a_]

        def start_b():
            b = spawn(tmp, "bsb", S, core=700, memory=8192)
            holder.append(b)
            ws.append(b)

        wait_started([a_])
        launched = time.monotonic()
        out = control(nvml, Policy.BURST_SHARE, ws, until=lambda: False,
                      later=[(lambda: time.monotonic() - launched > 4.0, start_b)])
        traces["burst"] = {"raw_samples": out["raw_samples"], "ticks": out["ticks"]}
        finish(ws)
        b = holder[0]
        b_start = started_at(b)
        sa = a_.series()
        before = rate(sa, sa[0][0] + 0.5, b_start - 0.2) / T0
        b_end = b.series()[-1][0]
        # fall-back time: first moment after B's start from which A's 0.5 s mean stays <= 35 % while B runs
        grid = [b_start + k * 0.05 for k in range(int((b_end - 0.5 - b_start) / 0.05))]
        over = [rate(sa, u, u + 0.5) / T0 > 0.35 for u in grid]
        last_over = max((i for i, o in enumerate(over) if o), default=-1)
        fell = None if last_over == len(grid) - 1 else (grid[last_over + 1] - b_start if last_over >= 0 else 0.0)
        after_a = rate(sa, b_start + 2.0, b_end - 0.2) / T0
        after_b = rate(b.series(), b_start + 2.0, b_end - 0.2) / T0
        return {"quota_pct": [30, 70], "a_alone_share_pct": round(100 * before, 1),
                "after_owner_returns_share_pct": [round(100 * after_a, 1), round(100 * after_b, 1)],
                "sampling": out["sampling"],
                "fallback_s": None if fell is None else round(fell, 2)}

    @scenario("offline_throttling")
    def _():
        batch = spawn(tmp, "off", S + 10, klass=AppClass.OFFLINE, core=500, memory=8192)
        holder: list[Worker] = []
        ws = [batch]

        def start_online():
            o = spawn(tmp, "onl", S - 4, klass=AppClass.ONLINE, core=0, memory=8192)
            holder.append(o)
            ws.append(o)

        wait_started([batch])
        launched = time.monotonic()
        control(nvml, Policy.BEST_EFFORT, ws, until=lambda: False,
                later=[(lambda: time.monotonic() - launched > 4.0, start_online)])
        finish(ws)
        o = holder[0]
        o_start, o_end = started_at(o), o.series()[-1][0]
        sb = batch.series()
        # throttled: the batch job's last step before the first gap of >= 0.5 s that ends after the
        # online job's first step (0 when the batch job was already held by then: the online job
        # counts as busy from its CUDA context on)
        times = [t for t, _ in sb]
        stop_at = next((max(t, o_start) for t, nxt in zip(times, times[1:]) if nxt - t >= 0.5 and nxt > o_start), None)
        resumed = next((t for t in times if t > o_end), None)  # the batch job's first step after the online job ended
        return {"throttled_after_s": None if stop_at is None else round(stop_at - o_start, 3),
                "online_share_pct_while_busy": round(100 * rate(o.series(), o_start + 1.0, o_end - 0.2) / T0, 1),
                "offline_share_pct_while_online_busy": round(100 * rate(sb, o_start + 1.0, o_end - 0.2) / T0, 1),
                "offline_resumed_after_online_end_s": None if resumed is None else round(resumed - o_end, 3)}

    @scenario("memory_watchdog")
    def _():
        w = spawn(tmp, "greedy", S, core=500, memory=4096, args=("--grab-mib", "6144", "--grab-after", "2"))
        out = control(nvml, Policy.BEST_EFFORT, [w], until=lambda: False)
        finish([w])
        s = w.series()
        return {"quota_mib": 4096, "grabbed_mib_extra": 6144, "exit_code": w.proc.returncode,
                "ran_for_s_after_start": round(s[-1][0] - s[0][0], 2) if s else None,
                "notes": w.notes(), "events": out["events"]}

    mps_bin = MpsDaemon.find()
    results["mps_available"] = bool(mps_bin)
    if mps_bin and (only is None or any(n.startswith("mps") for n in only)):
        daemon = MpsDaemon(os.path.join(tmp, "mps-pipe"), os.path.join(tmp, "mps-log"))
        daemon.start()
        pinned = pinned_limits_supported(cuda_driver_version(nvml))
        try:
            def mps_fixed(name, cores):
                ws = [spawn(tmp, f"{name}{i}", S + 4, core=c * 10, memory=8192,
                            env=client_env(daemon.pipe_dir, daemon.log_dir, c * 10, 8192, pinned)) for i, c in enumerate(cores)]
                control(nvml, Policy.FIXED_SHARE, ws, until=lambda: False, enforce_compute=False)
                finish(ws)
                t0, t1 = share_window(ws)
                shares = [round(100 * rate(w.series(), t0, t1) / T0, 1) for w in ws]
                return {"mechanism": "MPS active thread percentage", "quota_pct": list(cores), "share_pct": shares,
                        "error_points": [round(s - c, 1) for s, c in zip(shares, cores)]}

            for cores in ([30], [50], [70], [30, 60]):
                scenario("mps_fixed_share_" + "_".join(map(str, cores)))(lambda cores=cores: mps_fixed("mps" + "_".join(map(str, cores)) + "_", cores))

            @scenario("mps_pinned_memory")
            def _():
                w = spawn(tmp, "mpsmem", S, core=500, memory=4096,
                          env=client_env(daemon.pipe_dir, daemon.log_dir, 500, 4096, pinned),
                          args=("--grab-mib", "6144", "--grab-after", "1"))
                finish([w])
                return {"pinned_limits_supported": pinned, "quota_mib": 4096, "exit_code": w.proc.returncode,
                        "notes": w.notes(), "stderr_tail": open(os.path.join(tmp, "mpsmem.err")).read()[-400:]}
        finally:
            daemon.stop()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
