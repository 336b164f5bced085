"""The isolation engine's NVML sampler: the gpu edge's per-process samples, summed per workload.

NVML itself is the gpu edge's (gpu/nvml_lib.py loads it, gpu/nvml_processes.py samples the
processes, with the driver's timestamps handled there once). This adapter only attributes each
process to a workload through ``owner(pid) -> key | None`` and charges its SM samples through a
:class:`UsageEstimator`, because the driver's per-process samples are sparse (one per 200-800 ms)
while the control law acts every tick. Memory is what NVML reports now for each process.

Per-process utilization (nvmlDeviceGetProcessUtilization) is the driver's own accounting of which
process kept the SMs busy, so it sees work queued before a SIGSTOP too. On a node the reader comes
from the GPU backend's sampler, so the metrics show the figures the engine was given.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from qgpu_runtime.gpu.nvml_processes import ProcessReader
from qgpu_runtime.isolation.control import Usage
from qgpu_runtime.isolation.engine import Workload
from qgpu_runtime.isolation.estimator import RawSample, UsageEstimator


class NvmlSampler:
    """Implements the engine's ``Sampler`` over one :class:`ProcessReader` of the gpu edge."""

    def __init__(self, processes: ProcessReader, owner: Callable[[int], str | None]):
        self._processes = processes
        self._owner = owner
        self._estimators: dict[int, UsageEstimator] = {i: UsageEstimator() for i in processes.indices}

    def sample(self, workloads: Sequence[Workload], dt_s: float, held: frozenset[str],
               slotted: Mapping[int, frozenset[str]] | None = None) -> Mapping[int, Mapping[str, Usage]]:
        wanted = {w.key for w in workloads}
        out: dict[int, dict[str, Usage]] = {}
        for index, estimator in self._estimators.items():
            procs = self._processes.card(index)
            owners = {proc.pid: self._owner(proc.pid) for proc in procs}
            busy = {owners[proc.pid] or proc.pid for proc in procs if any(s.sm_pct > 0 for s in proc.sm)}
            slots = (slotted or {}).get(index, frozenset())
            per_key: dict[str, tuple[float, int]] = {}
            for proc in procs:
                key = owners[proc.pid]
                if key is None or key not in wanted:
                    continue
                samples = [RawSample(s.ts_us, float(s.sm_pct)) for s in proc.sm]
                # whether another workload held the slot, another process (anyone's) used the card
                charged = estimator.charge(proc.pid, dt_s, key not in held, samples, key in slots,
                                           bool(slots - {key}), bool(busy - {key}))
                used, mib = per_key.get(key, (0.0, 0))
                per_key[key] = (used + charged / dt_s, mib + proc.memory_mib)
            estimator.forget_except(p.pid for p in procs)
            out[index] = {k: Usage(u, m) for k, (u, m) in per_key.items()}
        return out
