"""What every caller of the isolation engine does the same way: build it, and tick it on time.

Two callers (the standalone host manager for `qgpu run` jobs, the node manager for a cluster's
containers) differ only in where workloads come from and how processes map to them; the engine,
its watchdog and the timing of the loop are shared here so both enforce exactly the same rules.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry

from qgpu_runtime.isolation.control import ControlParams
from qgpu_runtime.isolation.engine import Actuator, IsolationEngine, Sampler
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.isolation.watchdog import EventSink, MemoryWatchdog


def build_engine(
    policy: Policy,
    sampler: Sampler,
    actuator: Actuator,
    registry: CollectorRegistry,
    sink: EventSink,
    memory_tolerance_mib: int = 0,
    enforce_compute: bool = True,
    params: ControlParams = ControlParams(),
) -> IsolationEngine:
    """An engine whose memory watchdog stops offenders through ``actuator`` and counts them in ``registry``."""
    # a repeat offender is killed without the grace period where the actuator can (signals.py kill)
    watchdog = MemoryWatchdog(registry, sink, actuator.stop, kill=getattr(actuator, "kill", None))
    return IsolationEngine(policy, sampler, actuator, params, watchdog=watchdog,
                           memory_tolerance_mib=memory_tolerance_mib, enforce_compute=enforce_compute)


def run_every(period_s: float, stop: threading.Event, tick: Callable[[float, float], object],
              clock: Callable[[], float] = time.monotonic) -> None:
    """Call ``tick(dt_s, now)`` every ``period_s`` until ``stop`` is set.

    ``dt_s`` is the time really elapsed since the previous tick (a late tick is charged for the
    time it covers, so the control law's accounting stays exact when the host is busy).
    """
    if not period_s > 0:
        raise ValueError(f"period_s: {period_s!r} is not allowed: must be > 0")
    last = clock()
    while not stop.wait(max(0.0, last + period_s - clock())):
        now = clock()
        tick(max(now - last, 1e-3), now)
        last = now
