"""Builders for the isolation tests: a simulated host and an engine over it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from qgpu_runtime.isolation.control import ControlParams
from qgpu_runtime.isolation.engine import IsolationEngine
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.isolation.simbackend import SimBackend
from qgpu_runtime.isolation.simgpu import SimulatedGPU
from qgpu_runtime.isolation.watchdog import IsolationEvent, MemoryWatchdog


class ListSink:
    def __init__(self) -> None:
        self.events: list[IsolationEvent] = []

    def emit(self, event: IsolationEvent) -> None:
        self.events.append(event)


def make_backend(cards: int = 1, memory_mib: int = 16384, drain_s: float = 0.0) -> SimBackend:
    return SimBackend({i: SimulatedGPU(i, f"GPU-sim-{i}", "SIM", memory_mib, drain_s) for i in range(cards)})


def make_engine(backend: SimBackend, policy: Policy, params: ControlParams = ControlParams(), sink: ListSink | None = None,
                registry: CollectorRegistry | None = None) -> IsolationEngine:
    watchdog = MemoryWatchdog(registry or CollectorRegistry(), sink or ListSink(), backend.stop, clock=lambda: 0.0)
    return IsolationEngine(policy, backend, backend, params, watchdog)
