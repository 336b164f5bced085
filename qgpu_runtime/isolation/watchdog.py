"""Memory watchdog: what happens to a tenant caught over its memory quota, and the trail it leaves.

A suspended process still holds its GPU memory, so suspending the offender would not give the
neighbours their memory back: the watchdog stops it for good (through the actuator: SIGTERM, then
SIGKILL) and records why three ways, so the user finds the reason wherever they look first:
a log line, a Prometheus counter, and an event record (the standalone database, or a Kubernetes
Event in a cluster, through whichever sink the caller gives).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from prometheus_client import CollectorRegistry, Counter

from qgpu_runtime.isolation.memory import MemoryViolation

log = logging.getLogger("qgpu.isolation.watchdog")

REASON_MEMORY = "GPUMemoryQuotaExceeded"


@dataclass(frozen=True)
class IsolationEvent:
    """A durable note that the isolation engine acted on a workload."""

    time: float
    key: str
    card: int
    reason: str
    message: str


class EventSink(Protocol):
    def emit(self, event: IsolationEvent) -> None: ...


class MemoryWatchdog:
    """Turns memory violations into a stop plus a log line, a metric and an event, once per workload."""

    def __init__(
        self,
        registry: CollectorRegistry,
        sink: EventSink,
        stop: Callable[[str, str], None],
        clock: Callable[[], float] = time.time,
    ):
        self._sink = sink
        self._stop = stop
        self._clock = clock
        self._stopped: set[str] = set()
        self.violations = Counter(
            "qgpu_memory_quota_violations",
            "Workloads stopped by the memory watchdog for holding more GPU memory than their quota",
            ["workload", "card"],
            registry=registry,
        )

    def handle(self, card: int, violation: MemoryViolation) -> bool:
        """Stop and record the offender; False when it was already handled."""
        if violation.key in self._stopped:
            return False
        self._stopped.add(violation.key)
        message = violation.message()
        log.warning("card %d: %s", card, message)
        self.violations.labels(workload=violation.key, card=str(card)).inc()
        self._sink.emit(IsolationEvent(self._clock(), violation.key, card, REASON_MEMORY, message))
        self._stop(violation.key, message)
        return True

    def forget(self, key: str) -> None:
        """Called when a workload is gone, so a new one with the same key is judged afresh."""
        self._stopped.discard(key)
