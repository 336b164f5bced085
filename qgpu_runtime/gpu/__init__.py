"""GPU backends: NVML on real hosts, a simulated one chosen explicitly for hosts without GPUs."""

from __future__ import annotations

from qgpu_runtime.gpu.types import BackendError, CardInfo, CardUsage, GpuBackend, HealthEvent, ProcessUsage

BACKENDS = ("nvml", "simulated")


def open_backend(kind: str, simulated_gpus: str | None, seed: str) -> GpuBackend:
    """The backend the operator asked for. There is no fallback from one kind to the other."""
    if kind == "nvml":
        if simulated_gpus:
            raise ValueError("--simulated-gpus given with --gpu-backend nvml; choose --gpu-backend simulated to use it")
        from qgpu_runtime.gpu.nvml import NvmlBackend

        return NvmlBackend()
    if kind == "simulated":
        if not simulated_gpus:
            raise ValueError("--gpu-backend simulated needs --simulated-gpus SPEC (e.g. 2xT4-16G) or a config file")
        from qgpu_runtime.gpu.simulated import SimulatedBackend

        return SimulatedBackend.from_option(simulated_gpus, seed)
    raise ValueError(f"--gpu-backend: {kind!r} is unknown; choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "BackendError", "CardInfo", "CardUsage", "GpuBackend", "HealthEvent", "ProcessUsage", "open_backend"]
