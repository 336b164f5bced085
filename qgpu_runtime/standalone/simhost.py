"""Real job processes on simulated cards: the standalone manager's demo and test backend.

Chosen only with ``gpu_backend: simulated``. Each live job becomes a simulated process on each of
its cards; holding a job both SIGSTOPs its real process group and suspends its simulated process,
so the manager's whole loop (database, placement, signals, control law, watchdog) runs for real
while only the card is pretend. A JSON *usage file* lets a test or demo say what each job does:
``{"JOB-ID": {"demand_milli": 600, "memory_mib": 7000}}`` (default: demand 1000, memory 0),
re-read every tick.
"""

from __future__ import annotations

import json
import logging
from typing import Mapping, Sequence

from qgpu_runtime.contract.inventory import MAX_MEMORY_MIB
from qgpu_runtime.isolation.control import Usage
from qgpu_runtime.isolation.engine import Workload
from qgpu_runtime.isolation.signals import SignalActuator
from qgpu_runtime.isolation.simbackend import SimBackend
from qgpu_runtime.isolation.simgpu import SimulatedGPU
from qgpu_runtime.standalone.store import JobRecord, StoredCard

log = logging.getLogger("qgpu.standalone.simhost")

MAX_DEMAND_MILLI = 1000
"""A job's demand on one card, in thousandths of it: all of it at most."""


class SimulatedHost:
    def __init__(self, cards: Sequence[StoredCard], signals: SignalActuator, usage_file: str | None = None):
        self.sim = SimBackend({c.index: SimulatedGPU(c.index, c.uuid, c.model, c.memory_mib) for c in cards})
        self._signals = signals
        self._usage_file = usage_file
        self._known: dict[str, JobRecord] = {}

    def _usage(self) -> dict[str, dict]:
        if not self._usage_file:
            return {}
        try:
            with open(self._usage_file) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            log.warning("simulated usage file %s unreadable: %s", self._usage_file, err)
            return {}
        return data if isinstance(data, dict) else {}

    def _wanted(self, key: str, want: object) -> tuple[float, int]:
        """(demand thousandths, memory MiB) the usage file gives job ``key``; the defaults (1000, 0)
        for an entry that is absent or malformed (logged): the file must never stop the manager."""
        if want is None:
            return 1000.0, 0
        demand, memory = (want.get("demand_milli", 1000), want.get("memory_mib", 0)) if isinstance(want, dict) else (None, None)
        if (isinstance(demand, (int, float)) and not isinstance(demand, bool) and 0 <= demand <= MAX_DEMAND_MILLI
                and isinstance(memory, int) and not isinstance(memory, bool) and 0 <= memory <= MAX_MEMORY_MIB):
            return float(demand), memory
        log.warning("simulated usage file %s: entry of job %s must be {\"demand_milli\": 0..%d, \"memory_mib\": "
                    "0..%d}, got %.200r: the defaults are used", self._usage_file, key, MAX_DEMAND_MILLI, MAX_MEMORY_MIB, want)
        return 1000.0, 0

    def sync(self, jobs: Sequence[JobRecord]) -> None:
        """Mirror the live jobs into the simulated cards and apply the usage file."""
        live = {j.id: j for j in jobs if j.pgid}
        for key in set(self._known) - set(live):
            for card, pid in self.sim.pids.pop(key, {}).items():
                self.sim.gpus[card].exit(pid)
            del self._known[key]
        usage = self._usage()
        for key, job in live.items():
            demand, memory = self._wanted(key, usage.get(key))
            if key not in self._known:
                for share in job.shares:
                    self.sim.start(key, share.index, job.pgid or 0, demand)
                self._known[key] = job
            for card, pid in self.sim.pids.get(key, {}).items():
                proc = self.sim.gpus[card].processes[pid]
                proc.demand_milli = demand
                proc.memory_mib = memory  # pretend allocations: set, not checked against the card

    # Sampler
    def sample(self, workloads: Sequence[Workload], dt_s: float, held: frozenset[str],
               slotted: Mapping[int, frozenset[str]] | None = None) -> Mapping[int, Mapping[str, Usage]]:
        self.sim.advance(dt_s)
        return self.sim.sample(workloads, dt_s, held, slotted)

    # Actuator
    def hold(self, key: str) -> None:
        self._signals.hold(key)
        self.sim.hold(key)

    def resume(self, key: str) -> None:
        self._signals.resume(key)
        self.sim.resume(key)

    def stop(self, key: str, reason: str) -> None:
        self._signals.stop(key, reason)
        self.sim.stop(key, reason)
        self._known.pop(key, None)

    def kill(self, key: str, reason: str) -> None:
        self._signals.kill(key, reason)
        self.sim.stop(key, reason)
        self._known.pop(key, None)
