"""The isolation engine: sample, judge with the pure control law, act through thin actuators.

One engine per node. It keeps one controller state per card and holds a workload (all of its
processes) when any of its cards says hold, because a process cannot be suspended on one card
and not on another. It only signals on change, resumes a held workload that leaves, and resumes everything it
held when closed, so a manager that exits never leaves a workload frozen.

Each workload is acted on alone: a hold, resume or stop that raises is logged and counted (in the
tick's report) and never keeps the engine from acting on the others, since a failure one tenant
can provoke must not freeze or free its neighbours.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Mapping, Protocol, Sequence

from qgpu_runtime.isolation.control import CardState, ControlParams, Tenant, Usage, Verdict, step
from qgpu_runtime.isolation.memory import MemoryViolation, memory_violations
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.isolation.watchdog import MemoryWatchdog
from qgpu_runtime.model import AppClass

log = logging.getLogger("qgpu.isolation.engine")


@dataclass(frozen=True)
class CardQuota:
    """A workload's booking on one card (from the placement engine's CardShare)."""

    index: int
    core_milli: int
    memory_mib: int


@dataclass(frozen=True)
class Workload:
    """Something the engine isolates: a standalone job or a container, with its bookings.

    ``unheld`` workloads are measured, charged and judged for memory like any other, but never
    held (a pod being deleted, for a bounded time, so that its processes can handle SIGTERM)."""

    key: str
    klass: AppClass
    cards: tuple[CardQuota, ...]
    unheld: bool = False


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
    failed: tuple[str, ...] = ()  # "hold <key>", "resume <key>", "stop <key>": actions that raised (logged)


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
        self._held: set[str] = set()  # workloads that are, or may be, suspended
        self._hold_failed: set[str] = set()  # holds that raised: sent again while still wanted
        self._live: set[str] = set()
        self._elapsed_s = 0.0  # the engine's own clock: the sum of the ticks' dt_s
        self._failing: dict[tuple[str, str], str] = {}  # (action, key) -> the error last logged for it
        # whether a workload's processes run (not stopped), where the actuator can tell
        self._running: Callable[[str], bool] | None = getattr(actuator, "running", None)
        self._escaped: set[str] = set()  # held workloads found running last tick

    @property
    def held(self) -> frozenset[str]:
        return frozenset(self._held)

    def tick(self, workloads: Sequence[Workload], dt_s: float) -> TickReport:
        self._elapsed_s += dt_s
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

        want_held -= {w.key for w in workloads if w.unheld}
        live = {w.key for w in workloads}
        if self._watchdog is not None:
            for gone in self._live - live:
                self._watchdog.forget(gone)
        self._live = live
        failed: list[str] = []
        # a held workload whose processes run again (resumed by a helper of its own, which the
        # hold's signals do not reach) is held again, every tick it is found running
        escaped = {key for key in want_held & self._held if self._running is not None and self._running(key)}
        for key in sorted(escaped - self._escaped):
            log.warning("isolation: %s runs while held (resumed by someone else); held again every tick it runs", key)
        self._escaped = escaped
        to_hold = sorted((want_held - self._held) | (want_held & self._hold_failed) | escaped)
        self._hold_failed = {key for key in to_hold if not self._act("hold", key, partial(self._actuator.hold, key), failed)}
        # A held workload that left the list, or is now unheld, is resumed too (a container whose
        # pod is being deleted must be able to handle its SIGTERM; signals to ended work are
        # harmless). One whose resume raised stays held, so the resume is sent again next tick; one
        # whose hold raised counts as held, so that it is resumed once no longer wanted held.
        resume_failed = {key for key in sorted(self._held - want_held)
                         if not self._act("resume", key, partial(self._actuator.resume, key), failed)}
        self._held = want_held | resume_failed
        if self._watchdog is not None:
            over = {v.key for _, v in violations}
            # measured within its quota on every card it was sampled on: a stop round that ended
            measured = {key for card_usage in usage.values() for key in card_usage}
            self._watchdog.within_quota(sorted(measured - over))
            for index, violation in violations:
                self._act("stop", violation.key, partial(self._watchdog.handle, index, violation, self._elapsed_s), failed)
        self._failing = {what: err for what, err in self._failing.items() if what[1] in live | self._held}
        return TickReport(verdicts, frozenset(self._held), tuple(violations), usage, tuple(failed))

    def _act(self, action: str, key: str, call: Callable[[], object], failed: list[str]) -> bool:
        """``call()``, the ``action`` on workload ``key``; False when it raised, which is logged (in
        full once while the same error repeats) and noted in ``failed``."""
        what = (action, key)
        try:
            call()
        except Exception as exc:  # one workload's failure must not skip the others' signals
            failed.append(f"{action} {key}")
            if self._failing.get(what) != repr(exc):
                log.exception("isolation: could not %s %s (tried again next tick)", action, key)
            self._failing[what] = repr(exc)
            return False
        self._failing.pop(what, None)
        return True

    def close(self) -> None:
        """Resume every workload still held: never leave work frozen behind (a resume that
        raises is logged and the others are still sent)."""
        failed: list[str] = []
        self._held = {key for key in sorted(self._held) if not self._act("resume", key, partial(self._actuator.resume, key), failed)}
        self._hold_failed.clear()
