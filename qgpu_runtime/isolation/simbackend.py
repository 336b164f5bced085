"""Sampler and actuator over simulated GPUs, plus a deterministic driver loop.

The engine cannot tell this backend from NVML + signals: it sees per-workload usage and sends
hold/resume/stop. Tests and benchmarks use it to pin the controllers' behaviour without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from qgpu_runtime.isolation.control import Usage
from qgpu_runtime.isolation.engine import IsolationEngine, TickReport, Workload
from qgpu_runtime.isolation.estimator import RawSample, UsageEstimator
from qgpu_runtime.isolation.simgpu import SimulatedGPU


@dataclass
class SimProcessSampler:
    """Per-process samples of simulated cards, attributed to workloads by ``owner(pid)``.

    This is how the NVML sampler sees a real node (processes first, owners second), so a caller
    that maps processes to workloads itself (the node manager, through cgroups) is tested on the
    same path it runs in production. With ``sample_period_s`` set, utilization is reported the way
    NVML does it on real cards: one sample every period per process that used the card during it
    (none for a process held or idle all period), averaged over the period, charged
    through the same :class:`UsageEstimator` the NVML sampler uses. Without it, every tick is
    measured exactly. Several processes of one workload on one card are summed.
    """

    gpus: Mapping[int, SimulatedGPU]
    owner: Callable[[int], str | None]
    sample_period_s: float | None = None
    # "card": each process that used the card during a period is reported at the whole card's use
    # over it, as the H200's driver reported tenants taking turns (2026-11-28); "exact" otherwise
    attribution: str = "exact"
    _estimators: dict[int, UsageEstimator] = field(default_factory=dict)
    _pending: dict[tuple[int, int], float] = field(default_factory=dict)  # (card, pid) -> milli-s since last sample
    _since_sample: float = 0.0
    _card_window: dict[int, float] = field(default_factory=dict)  # card -> milli-s used by all since the last sample

    def sample(self, workloads: Sequence[Workload], dt_s: float, held: frozenset[str] = frozenset(),
               slotted: Mapping[int, frozenset[str]] | None = None) -> Mapping[int, Mapping[str, Usage]]:
        if self.attribution not in ("exact", "card"):
            raise ValueError(f"attribution: {self.attribution!r} is not allowed: must be 'exact' or 'card'")
        wanted = {w.key for w in workloads}
        sparse = self.sample_period_s is not None
        emit = False
        if sparse:
            self._since_sample += dt_s
            emit = self._since_sample >= self.sample_period_s - 1e-9
        out: dict[int, dict[str, Usage]] = {}
        for card, gpu in self.gpus.items():
            seen_now = gpu.sample(dt_s)
            if sparse:
                self._card_window[card] = self._card_window.get(card, 0.0) + sum(p.used_milli for p in seen_now.values()) * dt_s
            owners = {pid: self.owner(pid) for pid in seen_now}
            busy = {owners[pid] or pid for pid, seen in seen_now.items() if seen.used_milli > 0}
            slots = (slotted or {}).get(card, frozenset())
            for pid, seen in seen_now.items():
                key = owners[pid]
                if key is None or key not in wanted:
                    continue
                used = seen.used_milli
                if sparse:
                    slot = (card, pid)
                    self._pending[slot] = self._pending.get(slot, 0.0) + seen.used_milli * dt_s
                    raw = ()
                    if emit:
                        # NVML reports a process only when it used the card during the driver's
                        # last sample period: a process held (or idle) through it gets no sample
                        window_used = self._pending.pop(slot)
                        if window_used > 0:
                            if self.attribution == "card":
                                window_used = self._card_window[card]
                            raw = (RawSample(round(gpu.now * 1e6), window_used / self._since_sample / 10.0),)
                    estimator = self._estimators.setdefault(card, UsageEstimator())
                    used = estimator.charge(pid, dt_s, key not in held, raw, key in slots,
                                            bool(slots - {key}), bool(busy - {key})) / dt_s
                before = out.setdefault(card, {}).get(key, Usage(0.0, 0))
                out[card][key] = Usage(before.used_milli + used, before.memory_mib + seen.memory_mib)
        if emit:
            self._since_sample = 0.0
            self._card_window.clear()
        return out


@dataclass
class SimBackend:
    """Simulated cards plus which simulated pid runs each workload on each card.

    Sampling goes through :class:`SimProcessSampler` with the pid table as the owner map;
    ``sample_period_s`` and ``attribution`` are passed on (see there).
    """

    gpus: dict[int, SimulatedGPU]
    pids: dict[str, dict[int, int]] = field(default_factory=dict)  # workload key -> card -> pid
    stopped: dict[str, str] = field(default_factory=dict)  # workload key -> why
    sample_period_s: float | None = None
    attribution: str = "exact"
    _sampler: SimProcessSampler = field(init=False)

    def __post_init__(self) -> None:
        self._sampler = SimProcessSampler(self.gpus, self._owner)

    def start(self, key: str, card: int, pid: int, demand_milli: float, memory_mib: int = 0, memory_limit_mib: int | None = None) -> None:
        self.gpus[card].spawn(pid, demand_milli, memory_mib, memory_limit_mib)
        self.pids.setdefault(key, {})[card] = pid

    def _each(self, key: str) -> list[tuple[SimulatedGPU, int]]:
        return [(self.gpus[card], pid) for card, pid in self.pids.get(key, {}).items()]

    def _owner(self, pid: int) -> str | None:
        return next((key for key, cards in self.pids.items() if pid in cards.values()), None)

    # Sampler
    def sample(self, workloads: Sequence[Workload], dt_s: float, held: frozenset[str] = frozenset(),
               slotted: Mapping[int, frozenset[str]] | None = None) -> Mapping[int, Mapping[str, Usage]]:
        self._sampler.sample_period_s = self.sample_period_s
        self._sampler.attribution = self.attribution
        return self._sampler.sample(workloads, dt_s, held, slotted)

    # Actuator
    def hold(self, key: str) -> None:
        for gpu, pid in self._each(key):
            gpu.suspend(pid)

    def resume(self, key: str) -> None:
        for gpu, pid in self._each(key):
            gpu.resume(pid)

    def stop(self, key: str, reason: str) -> None:
        for gpu, pid in self._each(key):
            gpu.exit(pid)
        self.pids.pop(key, None)
        self.stopped[key] = reason

    def advance(self, dt_s: float) -> None:
        for gpu in self.gpus.values():
            gpu.advance(dt_s)


def drive(
    backend: SimBackend,
    engine: IsolationEngine,
    workloads: Sequence[Workload],
    duration_s: float,
    tick_s: float,
    events: Mapping[int, Callable[[SimBackend], None]] | None = None,
    observe: Callable[[float, TickReport], None] | None = None,
) -> None:
    """Run the card and the engine together for ``duration_s``: advance a tick, then control.

    ``events`` maps a tick number to a change of the world (a process starts, changes demand);
    ``observe`` sees the simulated time and every tick's report.
    """
    ticks = round(duration_s / tick_s)
    for n in range(ticks):
        if events and n in events:
            events[n](backend)
        backend.advance(tick_s)
        live = [w for w in workloads if w.key in backend.pids]
        report = engine.tick(live, tick_s)
        if observe is not None:
            observe((n + 1) * tick_s, report)
