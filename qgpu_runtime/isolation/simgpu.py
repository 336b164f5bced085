"""A simulated GPU with contention physics, for tests and demos only (always chosen explicitly).

What it models, because the controllers depend on exactly these effects:
- each process demands a compute rate (milli of the card it would use alone) and holds memory;
- the card time-shares among runnable processes: max-min fair, as time slicing does (a process
  that wants less than an equal slice gets what it wants, the rest is split among the others);
- a suspended process gets nothing, except that work it had already queued keeps running for
  ``drain_s`` seconds after suspension (kernels launched before SIGSTOP still execute);
- memory is finite: an allocation past the card's memory, or past a process's pinned limit
  (what MPS enforces), fails the way cudaMalloc does.

Time is an explicit number advanced by the caller, so every run is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

from qgpu_runtime.isolation.control import CARD_MILLI


class SimulatedOutOfMemory(RuntimeError):
    """An allocation the simulated card (or the process's pinned limit) cannot satisfy."""


@dataclass
class SimProcess:
    pid: int
    demand_milli: float
    memory_mib: int = 0
    memory_limit_mib: int | None = None
    suspended_at: float | None = None
    used_window: float = 0.0  # milli-card-seconds since the last sample
    used_total: float = 0.0


@dataclass(frozen=True)
class ProcessSample:
    """What NVML would report for one process: mean utilization since the last sample, memory."""

    pid: int
    used_milli: float
    memory_mib: int


def fair_split(demands: dict[int, float], capacity: float = CARD_MILLI) -> dict[int, float]:
    """Max-min fair shares of ``capacity`` for the given demands (water filling)."""
    shares: dict[int, float] = {}
    left = capacity
    pending = sorted(demands.items(), key=lambda kv: (kv[1], kv[0]))
    for i, (pid, demand) in enumerate(pending):
        give = min(max(0.0, demand), left / (len(pending) - i))
        shares[pid] = give
        left -= give
    return shares


class SimulatedGPU:
    """One simulated card. Not thread-safe: a test or benchmark drives it from one loop."""

    def __init__(self, index: int, uuid: str, model: str, memory_mib: int, drain_s: float = 0.0):
        if memory_mib <= 0:
            raise ValueError(f"simulated GPU {index}: memory_mib={memory_mib} is not allowed: must be > 0")
        if drain_s < 0:
            raise ValueError(f"simulated GPU {index}: drain_s={drain_s} is not allowed: must be >= 0")
        self.index = index
        self.uuid = uuid
        self.model = model
        self.memory_mib = memory_mib
        self.drain_s = drain_s
        self.now = 0.0
        self.processes: dict[int, SimProcess] = {}

    # -- process life -----------------------------------------------------------------------
    def spawn(self, pid: int, demand_milli: float, memory_mib: int = 0, memory_limit_mib: int | None = None) -> None:
        if pid in self.processes:
            raise ValueError(f"simulated GPU {self.index}: pid {pid} already runs here")
        self.processes[pid] = SimProcess(pid, float(demand_milli), 0, memory_limit_mib)
        if memory_mib:
            self.allocate(pid, memory_mib)

    def exit(self, pid: int) -> None:
        self.processes.pop(pid, None)

    def set_demand(self, pid: int, demand_milli: float) -> None:
        self.processes[pid].demand_milli = float(demand_milli)

    def allocate(self, pid: int, mib: int) -> None:
        proc = self.processes[pid]
        if proc.memory_limit_mib is not None and proc.memory_mib + mib > proc.memory_limit_mib:
            raise SimulatedOutOfMemory(
                f"pid {pid}: allocating {mib} MiB would hold {proc.memory_mib + mib} MiB, over its pinned limit of {proc.memory_limit_mib} MiB"
            )
        if self.memory_used_mib() + mib > self.memory_mib:
            raise SimulatedOutOfMemory(
                f"card {self.index}: allocating {mib} MiB for pid {pid} needs more than the {self.memory_mib - self.memory_used_mib()} MiB free"
            )
        proc.memory_mib += mib

    def memory_used_mib(self) -> int:
        return sum(p.memory_mib for p in self.processes.values())

    def suspend(self, pid: int) -> None:
        proc = self.processes.get(pid)
        if proc is not None and proc.suspended_at is None:
            proc.suspended_at = self.now

    def resume(self, pid: int) -> None:
        proc = self.processes.get(pid)
        if proc is not None:
            proc.suspended_at = None

    # -- physics ----------------------------------------------------------------------------
    def _runnable_until(self, proc: SimProcess) -> float:
        if proc.suspended_at is None:
            return float("inf")
        return proc.suspended_at + self.drain_s

    def shares(self) -> dict[int, float]:
        """Compute each process gets right now, in milli of the card."""
        demands = {p.pid: p.demand_milli for p in self.processes.values() if self._runnable_until(p) > self.now}
        shares = fair_split(demands)
        return {pid: shares.get(pid, 0.0) for pid in self.processes}

    def advance(self, dt_s: float) -> None:
        """Run the card for ``dt_s`` seconds, splitting at moments a suspended process drains."""
        if dt_s < 0:
            raise ValueError(f"dt_s: {dt_s} is not allowed: must be >= 0")
        end = self.now + dt_s
        while self.now < end:
            boundaries = [self._runnable_until(p) for p in self.processes.values()]
            next_change = min([b for b in boundaries if self.now < b < end], default=end)
            span = next_change - self.now
            for pid, share in self.shares().items():
                proc = self.processes[pid]
                proc.used_window += share * span
                proc.used_total += share * span
            self.now = next_change

    def utilization_milli(self) -> float:
        return sum(self.shares().values())

    def sample(self, window_s: float) -> dict[int, ProcessSample]:
        """Per-process mean use over the last ``window_s`` seconds and memory; resets the window."""
        out = {}
        for proc in self.processes.values():
            out[proc.pid] = ProcessSample(proc.pid, proc.used_window / window_s if window_s > 0 else 0.0, proc.memory_mib)
            proc.used_window = 0.0
        return out
