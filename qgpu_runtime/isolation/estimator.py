"""From NVML's sparse per-process samples to a usage figure every control tick.

Measured on an H100 (driver 580): nvmlDeviceGetProcessUtilization yields a new sample per process
only every 200-800 ms, while the controller must act every ~50 ms. Treating "no new sample" as
"used nothing" lets a capped process run free between samples; waiting for samples makes the law
sluggish and, with a bounded bucket, loses credit (measured: a 30 % cap gave ~23 %).

So each tick is charged an *estimate* (the process's running rate, learned as measured use per
second it was allowed to run, while it was allowed to run; nothing while it was held), and every real sample then charges the difference between what
it measured over its interval and what was estimated since the previous sample. Every
milli-card-second the driver measured is charged exactly once, so the long-run share is exact; the
estimate only decides how early it is charged. Pure apart from its own state; no clocks, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass(frozen=True)
class RawSample:
    """One NVML process-utilization sample: when (microseconds) and SM busy percent."""

    ts_us: int
    util_pct: float


@dataclass
class _PidTrack:
    rate_milli: float
    pending: float = 0.0  # milli-card-seconds estimated since the last real sample
    since_first_s: float = 0.0
    last_ts_us: int | None = None
    run_s: float = 0.0  # time allowed to run since the last sample


@dataclass
class UsageEstimator:
    """Per-pid estimate-and-correct accounting. ``initial_rate_milli`` is assumed for a new pid
    until its first sample (1000: a new process is charged as if it kept the card busy)."""

    initial_rate_milli: float = 1000.0
    max_interval_s: float = 5.0
    _tracks: dict[int, _PidTrack] = field(default_factory=dict)

    def charge(self, pid: int, dt_s: float, running: bool, samples: Iterable[RawSample]) -> float:
        """Milli-card-seconds to charge ``pid`` for the tick that just ended (may be negative: a refund)."""
        track = self._tracks.setdefault(pid, _PidTrack(self.initial_rate_milli))
        estimate = track.rate_milli * dt_s if running else 0.0
        track.pending += estimate
        track.since_first_s += dt_s
        if running:
            track.run_s += dt_s
        charged = estimate
        for s in sorted(samples, key=lambda s: s.ts_us):
            if track.last_ts_us is not None and s.ts_us <= track.last_ts_us:
                continue
            if track.last_ts_us is None:
                interval = min(track.since_first_s, self.max_interval_s)
            else:
                interval = min((s.ts_us - track.last_ts_us) / 1e6, self.max_interval_s)
            measured = s.util_pct * 10.0 * interval
            charged += measured - track.pending
            track.pending = 0.0
            # the running rate: what it used per second it was allowed to run (duty cycling holds
            # it part of most intervals); too little running time gives no reliable figure
            if track.run_s >= 0.3 * interval:
                track.rate_milli = min(1000.0, measured / track.run_s)
            track.run_s = 0.0
            track.last_ts_us = s.ts_us
        return charged

    def forget_except(self, live_pids: Iterable[int]) -> None:
        live = set(live_pids)
        for pid in list(self._tracks):
            if pid not in live:
                del self._tracks[pid]
