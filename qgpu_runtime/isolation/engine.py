"""The isolation engine: sample, judge with the pure control law, act through thin actuators.

One engine per node. It keeps one controller state per card and holds a workload (all of its
processes) when any of its cards says hold, because a process cannot be suspended on one card
and not on another. It only signals on change, resumes a held workload that leaves, and resumes everything it
held when closed, so a manager that exits never leaves a workload frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from qgpu_runtime.isolation.control import CardState, ControlParams, Tenant, Usage, Verdict, step
from qgpu_runtime.isolation.memory import MemoryViolation, memory_violations
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.isolation.watchdog import MemoryWatchdog
from qgpu_runtime.model import AppClass


@dataclass(frozen=True)
class CardQuota:
    """A workload's booking on one card (from the placement engine's CardShare)."""

    index: int
    core_milli: int
    memory_mib: int


@dataclass(frozen=True)
class Workload:
    """Something the engine isolates: a standalone job or a container, with its bookings."""

    key: str
    klass: AppClass
    cards: tuple[CardQuota, ...]


class Sampler(Protocol):
    def sample(self, workloads: Sequence[Workload], dt_s: float, held: frozenset[str],
               slotted: Mapping[int, frozenset[str]] = ...) -> Mapping[int, Mapping[str, Usage]]:
        """Per card index, per workload key: use over the last ``dt_s`` seconds and memory now.

        ``held`` names the workloads that were suspended during that tick and ``slotted``, per card,
        those that held the card's time slot (samplers that estimate between sparse measurements
        need both: a slot is charged by time, so a measurement of it corrects nothing)."""


class Actuator(Protocol):
    def hold(self, key: str) -> None: ...
    def resume(self, key: str) -> None: ...
    def stop(self, key: str, reason: str) -> None: ...


@dataclass(frozen=True)
class TickReport:
    verdicts: Mapping[int, tuple[Verdict, ...]]
    held: frozenset[str]
    violations: tuple[tuple[int, MemoryViolation], ...] = ()
    usage: Mapping[int, Mapping[str, Usage]] = field(default_factory=dict)


class IsolationEngine:
    def __init__(
        self,
        policy: Policy,
        sampler: Sampler,
        actuator: Actuator,
        params: ControlParams = ControlParams(),
        watchdog: MemoryWatchdog | None = None,
        memory_tolerance_mib: int = 0,
        enforce_compute: bool = True,
    ):
        """``enforce_compute`` False leaves compute to another mechanism (MPS thread limits) and
        keeps only the memory rule and the offline yield."""
        self.policy = policy
        self.params = params
        self._sampler = sampler
        self._actuator = actuator
        self._watchdog = watchdog
        self._tolerance = memory_tolerance_mib
        self._enforce_compute = enforce_compute
        self._states: dict[int, CardState] = {}
        self._held: set[str] = set()
        self._live: set[str] = set()

    @property
    def held(self) -> frozenset[str]:
        return frozenset(self._held)

    def tick(self, workloads: Sequence[Workload], dt_s: float) -> TickReport:
        slotted = {index: frozenset(k for k, t in state.tenants.items() if t.scheduled) for index, state in self._states.items()}
        usage = self._sampler.sample(workloads, dt_s, frozenset(self._held), slotted)
        tenants_by_card: dict[int, list[Tenant]] = {}
        for w in workloads:
            for c in w.cards:
                tenants_by_card.setdefault(c.index, []).append(Tenant(w.key, c.core_milli, c.memory_mib, w.klass))

        verdicts: dict[int, tuple[Verdict, ...]] = {}
        violations: list[tuple[int, MemoryViolation]] = []
        want_held: set[str] = set()
        for index, tenants in sorted(tenants_by_card.items()):
            card_usage = usage.get(index, {})
            policy = self.policy if self._enforce_compute else Policy.BEST_EFFORT
            state, card_verdicts = step(policy, self.params, tenants, card_usage, self._states.get(index, CardState()), dt_s)
            self._states[index] = state
            verdicts[index] = card_verdicts
            want_held.update(v.key for v in card_verdicts if not v.run)
            violations.extend((index, v) for v in memory_violations(tenants, card_usage, self._tolerance))
        for index in set(self._states) - set(tenants_by_card):
            del self._states[index]

        live = {w.key for w in workloads}
        if self._watchdog is not None:
            for gone in self._live - live:
                self._watchdog.forget(gone)
        self._live = live
        for key in sorted(want_held - self._held):
            self._actuator.hold(key)
        # A held workload that left the list is resumed too: a container whose pod is being
        # deleted must be able to handle its SIGTERM, and signals to ended work are harmless.
        for key in sorted(self._held - want_held):
            self._actuator.resume(key)
        self._held = want_held
        if self._watchdog is not None:
            for index, violation in violations:
                self._watchdog.handle(index, violation)
        return TickReport(verdicts, frozenset(self._held), tuple(violations), usage)

    def close(self) -> None:
        """Resume every workload still held: never leave work frozen behind."""
        for key in sorted(self._held):
            self._actuator.resume(key)
        self._held.clear()
