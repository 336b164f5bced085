"""The NVML sampler: per-process SM utilization and memory, summed per workload per card.

NVML is a boundary this project does not own; this module is the only place that talks to it for
isolation. Per-process utilization (nvmlDeviceGetProcessUtilization) is the driver's own
accounting of which process kept the SMs busy, so it sees work queued before a SIGSTOP too.
A card where NVML fails is an error the operator must see, never a silent switch to simulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from qgpu_runtime.isolation.control import Usage
from qgpu_runtime.isolation.engine import Workload
from qgpu_runtime.isolation.estimator import RawSample, UsageEstimator


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or queried; the message says which call failed and why."""


@dataclass(frozen=True)
class NvmlCard:
    index: int
    uuid: str
    model: str
    memory_mib: int


def load_nvml() -> Any:
    try:
        import pynvml
    except ImportError as err:  # nvidia-ml-py is a dependency; a broken install is still possible
        raise NvmlUnavailable(f"import pynvml (package nvidia-ml-py): {err}") from err
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlUnavailable(f"nvmlInit: {err} (is the NVIDIA driver loaded on this host?)") from err
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def list_cards(nvml: Any) -> list[NvmlCard]:
    cards = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        cards.append(NvmlCard(index, _text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetName(handle)), memory.total // (1 << 20)))
    return cards


def cuda_driver_version(nvml: Any) -> int:
    """CUDA version the driver supports, as NVML encodes it (11050 = 11.5)."""
    return int(nvml.nvmlSystemGetCudaDriverVersion_v2())


class NvmlSampler:
    """Samples NVML and attributes processes to workloads through ``owner(pid) -> key | None``.

    Utilization is charged through a :class:`UsageEstimator` (NVML's per-process samples are
    sparse); memory is what NVML reports now for each process.
    """

    def __init__(self, nvml: Any, indices: Sequence[int], owner: Callable[[int], str | None]):
        self._nvml = nvml
        self._handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        self._owner = owner
        self._last_seen: dict[int, int] = {i: 0 for i in indices}
        self._estimators: dict[int, UsageEstimator] = {i: UsageEstimator() for i in indices}

    def _samples(self, index: int) -> dict[int, list[RawSample]]:
        """New per-pid samples since the newest one already seen on this card."""
        nvml = self._nvml
        try:
            got = nvml.nvmlDeviceGetProcessUtilization(self._handles[index], self._last_seen[index])
        except nvml.NVMLError_NotFound:
            return {}  # no new sample for any process
        out: dict[int, list[RawSample]] = {}
        for s in got:
            if s.timeStamp > self._last_seen[index]:
                out.setdefault(s.pid, []).append(RawSample(int(s.timeStamp), float(s.smUtil)))
        if out:
            self._last_seen[index] = max(r.ts_us for rs in out.values() for r in rs)
        return out

    def _memory(self, index: int) -> dict[int, int]:
        procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handles[index])
        return {p.pid: (p.usedGpuMemory or 0) // (1 << 20) for p in procs}

    def sample(self, workloads: Sequence[Workload], dt_s: float, held: frozenset[str]) -> Mapping[int, Mapping[str, Usage]]:
        wanted = {w.key for w in workloads}
        out: dict[int, dict[str, Usage]] = {}
        for index in self._handles:
            samples = self._samples(index)
            memory = self._memory(index)
            estimator = self._estimators[index]
            per_key: dict[str, tuple[float, int]] = {}
            live = set(memory) | set(samples)
            for pid in live:
                key = self._owner(pid)
                if key is None or key not in wanted:
                    continue
                charged = estimator.charge(pid, dt_s, key not in held, samples.get(pid, ()))
                used, mib = per_key.get(key, (0.0, 0))
                per_key[key] = (used + charged / dt_s, mib + memory.get(pid, 0))
            estimator.forget_except(live)
            out[index] = {k: Usage(u, m) for k, (u, m) in per_key.items()}
        return out
