"""From NVML's sparse per-process samples to a usage figure every control tick.

Measured on an H100 (driver 580): nvmlDeviceGetProcessUtilization yields one sample per process
per driver *sample period* (200 ms there), each the process's SM busy percent over that period,
while the controller must act every ~50 ms. Treating "no new sample" as "used nothing" lets a
capped process run free between samples; waiting for samples makes the law sluggish and, with a
bounded bucket, loses credit (measured: a 30 % cap gave ~23 %).

So each tick is charged an *estimate* (the process's running rate, learned as measured use per
second it was allowed to run; nothing while it was held), and each real sample then replaces the
estimates of the ticks it covers, the last sample period, by what it measured. A sample covers
one period, never the time since the process's previous sample: NVML gives no sample for a period
in which a process did not run (its documented contract), and a sample can be missed. Charging
one period's percentage over a long gap was the fault measured on an H200 (2026-11-28): a tenant
held for a second, then sampled once at 25 %, was charged for a second at 25 %, went into debt,
was held again, and got 8 % of a 30 % share. Ticks no sample covers keep their estimate. The
period is the driver's (200 ms measured on an H100) until learned: the longest period of which the
spacings of consecutive samples are whole multiples (a held process's long gaps are periods
without a sample). Pure apart from its own state; no clocks, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from qgpu_runtime.isolation.control import CARD_MILLI

PERIOD_MIN_S = 0.02
PERIOD_MAX_S = 2.0


def _common_period(gaps: list[float], tolerance: float = 0.1, agree: float = 0.8) -> float | None:
    """The longest P in PERIOD_MIN_S..PERIOD_MAX_S such that at least ``agree`` of the gaps are
    within ``tolerance`` x P of a whole multiple of P (candidates: a gap over 1..8), refined to the
    mean of the agreeing gaps over their multiples; None when no candidate agrees."""
    candidates = sorted({g / k for g in gaps for k in range(1, 9) if PERIOD_MIN_S <= g / k <= PERIOD_MAX_S}, reverse=True)
    for p in candidates:
        fits = [(g, round(g / p)) for g in gaps if round(g / p) >= 1 and abs(g / p - round(g / p)) <= tolerance]
        if len(fits) >= agree * len(gaps):
            return sum(g / n for g, n in fits) / len(fits)
    return None


@dataclass(frozen=True)
class RawSample:
    """One NVML process-utilization sample: when (microseconds) and SM busy percent."""

    ts_us: int
    util_pct: float


@dataclass
class _Tick:
    dt_s: float
    estimate: float  # milli-card-seconds charged for it so far
    run_s: float  # time it was allowed to run
    slot: bool = False  # it held the card's time slot: charged by time, not by measurement
    others_slot: bool = False  # another workload held the card's time slot
    others_busy: bool = False  # another process (another workload's, or nobody's) used the card
    covered: bool = False


@dataclass
class _PidTrack:
    rate_milli: float
    ticks: deque = field(default_factory=deque)  # _Tick since the last sample, newest last
    last_ts_us: int | None = None
    seen_s: float = 0.0  # how long the process has been known, up to a period or so


@dataclass
class UsageEstimator:
    """Per-pid estimate-and-correct accounting.

    ``initial_rate_milli`` is assumed for a new pid until its first sample (1000: a new process is
    charged as if it kept the card busy). ``initial_period_s`` is the driver's sample period until
    ``min_gaps`` spacings of consecutive samples were seen; ``max_interval_s`` bounds how long
    ticks wait for a sample (older ones keep their estimate)."""

    initial_rate_milli: float = float(CARD_MILLI)
    initial_period_s: float = 0.2
    max_interval_s: float = 5.0
    min_gaps: int = 8
    _tracks: dict[int, _PidTrack] = field(default_factory=dict)
    _gaps: deque = field(default_factory=lambda: deque(maxlen=64))
    _period: float | None = None  # period_s() as last worked out
    _new_gaps: int = 0  # gaps seen since then

    def period_s(self) -> float:
        """The driver's sample period: the longest period of which (nearly) every recent spacing of
        a process's consecutive samples is a whole multiple. A process that did not run for a
        while has a spacing of several periods, so the shortest spacing alone can overstate it."""
        if len(self._gaps) < self.min_gaps:
            return self.initial_period_s
        # worked out again after every min_gaps new spacings: a node's many processes each bring
        # one every period, and the search is quadratic in the 64 spacings kept
        if self._period is None or self._new_gaps >= self.min_gaps:
            self._period = _common_period(list(self._gaps)) or self.initial_period_s
            self._new_gaps = 0
        return self._period

    def charge(self, pid: int, dt_s: float, running: bool, samples: Iterable[RawSample], slot: bool = False,
               others_slot: bool = False, others_busy: bool = False) -> float:
        """Milli-card-seconds to charge ``pid`` for the tick that just ended (may be negative: a refund).

        ``slot``: the process's workload held the card's time slot during the tick; ``others_slot``:
        another workload did; ``others_busy``: another process used the card. The control law
        charges a slot by time (the whole card), so a sample near the process's own slots corrects
        only what it measured beyond them (work queued before a hold, running on), and a busy
        sample near anyone's slot while others used the card corrects nothing: when contexts take
        turns, the driver's per-process figure is not a measure of who used the card (measured on
        an H200: two tenants alternating every 50 ms were each reported at 91-95 % of the same
        periods). A sample of 0 % is believed everywhere: the process did nothing."""
        track = self._tracks.setdefault(pid, _PidTrack(self.initial_rate_milli))
        estimate = track.rate_milli * dt_s if running else 0.0
        track.ticks.append(_Tick(dt_s, estimate, dt_s if running else 0.0, slot and running, others_slot, others_busy))
        track.seen_s = min(track.seen_s + dt_s, PERIOD_MAX_S)
        charged = estimate
        fresh = sorted((s for s in samples if track.last_ts_us is None or s.ts_us > track.last_ts_us), key=lambda s: s.ts_us)
        if fresh:
            period = self._learn(track, fresh)
            newest = fresh[-1].ts_us
            # each sample covers one period ending at its timestamp; the newest ends about now (it
            # was read this tick), so a tick's place is its age counted back from this tick's end
            previous = [track.last_ts_us, *(s.ts_us for s in fresh[:-1])]
            for s, before in reversed(list(zip(fresh, previous))):
                start = (newest - s.ts_us) / 1e6
                # one period, never more than the time since the process's previous sample, nor
                # reaching back before the process was first seen here (nobody's budget then)
                if before is None:
                    span = min(period, max(0.0, track.seen_s - start))
                else:
                    span = min(period, (s.ts_us - before) / 1e6)
                if span <= 0:
                    continue
                covered = self._take(track, start, start + span)
                near = self._around(track, start - dt_s, start + span + dt_s)  # the period and ticks are not aligned
                own_slots = any(t.slot for t in near)
                if s.util_pct > 0 and (any(t.others_slot for t in near) or (own_slots and any(t.others_busy for t in near))):
                    continue
                measured = s.util_pct * 10.0 * span
                slot_s = sum(t.dt_s for t in covered if t.slot)
                free = [t for t in covered if not t.slot]
                if own_slots:
                    charged += max(0.0, measured - CARD_MILLI * slot_s) - sum(t.estimate for t in free)
                else:
                    charged += measured - sum(t.estimate for t in free)
                    run_s = sum(t.run_s for t in free)
                    if run_s >= 0.3 * span:  # what it uses per second it runs freely
                        track.rate_milli = min(float(CARD_MILLI), measured / run_s)
            track.ticks.clear()  # every tick up to now is settled: measured, or kept at its estimate
            track.last_ts_us = newest
        else:
            waited = 0.0
            for t in reversed(track.ticks):
                waited += t.dt_s
            while track.ticks and waited > self.max_interval_s:
                waited -= track.ticks.popleft().dt_s  # too old for any sample to cover: settled
        return charged

    def _learn(self, track: _PidTrack, fresh: list[RawSample]) -> float:
        previous = track.last_ts_us
        for s in fresh:
            if previous is not None and s.ts_us - previous >= 1000:  # same-instant duplicates say nothing
                self._gaps.append((s.ts_us - previous) / 1e6)
                self._new_gaps += 1
            previous = s.ts_us
        return self.period_s()

    @staticmethod
    def _take(track: _PidTrack, age_from: float, age_to: float) -> list[_Tick]:
        """The ticks not yet covered whose end lies ``age_from``..``age_to`` seconds before now."""
        out = []
        age = 0.0  # how long before now the current tick ended
        for t in reversed(track.ticks):
            if age >= age_to - 1e-9:
                break
            if age >= age_from - 1e-9 and not t.covered:
                t.covered = True
                out.append(t)
            age += t.dt_s
        return out

    @staticmethod
    def _around(track: _PidTrack, age_from: float, age_to: float) -> list[_Tick]:
        """The ticks whose end lies ``age_from``..``age_to`` seconds before now, covered or not."""
        out = []
        age = 0.0
        for t in reversed(track.ticks):
            if age >= age_to - 1e-9:
                break
            if age >= age_from - 1e-9:
                out.append(t)
            age += t.dt_s
        return out

    def forget_except(self, live_pids: Iterable[int]) -> None:
        live = set(live_pids)
        for pid in list(self._tracks):
            if pid not in live:
                del self._tracks[pid]
