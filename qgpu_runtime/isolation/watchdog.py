"""Memory watchdog: what happens to a tenant caught over its memory quota, and the trail it leaves.

A suspended process still holds its GPU memory, so suspending the offender would not give the
neighbours their memory back: the watchdog stops it for good (through the actuator: SIGTERM, then
SIGKILL) and records why three ways, so the user finds the reason wherever they look first:
a log line, a Prometheus counter, and an event record (the standalone database, or a Kubernetes
Event in a cluster, through whichever sink the caller gives).

A workload counts as stopped only once its stop went out, and only for one stop round: if it is
still (or again) over its quota ``STOP_ROUND_S`` after the last stop (a process that left its
process group on SIGTERM, a child that took the memory over, a supervisor that started the
worker again), it is stopped again, every round while the violation lasts. The trail thins out
instead: the log line, the counter and the Event go out at the first stop and then at rounds
twice as far apart each time (``MAX_ROUND_DOUBLINGS``), so a stop that cannot reach its processes
does not raise an Event every 10 s for the workload's life. A workload seen within its quota
again ends its round: its next violation is a new one, stopped at once. (Stops once thinned out
as well: a supervisor restarting its worker then held memory over its quota for all but a few
seconds of every ten minutes.)

Within ``REPEAT_WINDOW_S`` of a stop, a workload over its quota again (a worker started again by
its supervisor, or processes the stop did not reach) is killed without the grace period, where
the actuator can (``kill``): the grace is for a workload to exit cleanly once, not a window of
memory it may hold again each time it is started.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from prometheus_client import CollectorRegistry, Counter

from qgpu_runtime.isolation.memory import MemoryViolation

log = logging.getLogger("qgpu.isolation.watchdog")

REASON_MEMORY = "GPUMemoryQuotaExceeded"

MAX_ROUND_DOUBLINGS = 6
"""A violation that outlasts its stops is stopped again every round; it is reported after 10, 20,
40 … s, at most 640 s apart."""

KEEP_GONE = 256
"""Workloads gone whose violation series are still exported: far more than are stopped between two
scrapes, and a bound on what a node that kills thousands of pods over its life keeps."""

REPEAT_WINDOW_S = 60.0
"""Over its quota again this soon after a stop: killed at once (no SIGTERM grace)."""

STOP_ROUND_S = 10.0
"""A stop's course: SIGTERM, the actuator's grace period (5 s) and SIGKILL, and time for the
samples to show the memory freed. A workload still over its quota after that is stopped again."""


@dataclass(frozen=True)
class IsolationEvent:
    """A durable note that the isolation engine acted on a workload."""

    time: float
    key: str
    card: int
    reason: str
    message: str


@dataclass
class _Stopped:
    """What the watchdog keeps of one workload it stopped."""

    last_stop: float | None = None  # monotonic time of the stop whose round runs; None: no round runs
    last_sent: float | None = None  # monotonic time of its last stop, kept when the round ends
    rounds: int = 0  # stops reported (log, counter, Event)
    last_report: float | None = None  # monotonic time of the last stop reported
    cards: set[str] = field(default_factory=set)  # the cards its violation series name


class EventSink(Protocol):
    def emit(self, event: IsolationEvent) -> None: ...


class MemoryWatchdog:
    """Turns memory violations into a stop plus a log line, a metric and an event, once per stop
    round of a workload."""

    def __init__(
        self,
        registry: CollectorRegistry,
        sink: EventSink,
        stop: Callable[[str, str], None],
        clock: Callable[[], float] = time.time,
        stop_round_s: float = STOP_ROUND_S,
        keep_gone: int = KEEP_GONE,
        kill: Callable[[str, str], None] | None = None,
        repeat_window_s: float = REPEAT_WINDOW_S,
    ):
        """``clock`` stamps the events (wall time); stop rounds are measured on the caller's
        monotonic time, given to :meth:`handle`. ``kill``: stops a repeat offender without the
        grace period (None: every stop goes through ``stop``)."""
        self._sink = sink
        self._stop = stop
        self._kill = kill
        self._repeat_window_s = repeat_window_s
        self._clock = clock
        self._stop_round_s = stop_round_s
        self._stopped: dict[str, _Stopped] = {}  # workload key -> what is kept of it, while it has series
        self._keep_gone = keep_gone
        self._gone: OrderedDict[str, None] = OrderedDict()  # keys gone whose series are kept, oldest first
        self.violations = Counter(
            "qgpu_memory_quota_violations",
            "Workloads stopped by the memory watchdog for holding more GPU memory than their quota",
            ["workload", "card"],
            registry=registry,
        )

    def handle(self, card: int, violation: MemoryViolation, now_s: float) -> bool:
        """Stop the offender, and record it when its report is due; False while the stop of its
        current round runs.

        The stop goes first: if it raises, nothing marks the workload stopped, and the next
        violation seen is judged again (marked first, a failed stop would never be retried)."""
        known = self._stopped.get(violation.key)
        if known is not None and known.last_stop is not None and now_s - known.last_stop < self._stop_round_s:
            return False
        message = violation.message()
        repeat = known is not None and known.last_sent is not None and now_s - known.last_sent < self._repeat_window_s
        if repeat and self._kill is not None:
            message += (f"; over its quota again within {self._repeat_window_s:g} s of its last stop: "
                        "killed without a grace period")
            self._kill(violation.key, message)
        else:
            self._stop(violation.key, message)
        known = self._stopped.setdefault(violation.key, _Stopped())
        known.last_stop = known.last_sent = now_s
        # the trail thins out (at most MAX_ROUND_DOUBLINGS doublings): a workload whose stop cannot
        # reach its processes, or that comes back over its quota, is stopped every round but
        # reported at rounds twice as far apart each time
        if (known.last_report is not None
                and now_s - known.last_report < self._stop_round_s * 2 ** min(known.rounds - 1, MAX_ROUND_DOUBLINGS)):
            return True
        known.last_report = now_s
        known.rounds += 1
        log.warning("card %d: %s", card, message)
        self.violations.labels(workload=violation.key, card=str(card)).inc()
        known.cards.add(str(card))
        self._gone.pop(violation.key, None)
        self._sink.emit(IsolationEvent(self._clock(), violation.key, card, REASON_MEMORY, message))
        return True

    def within_quota(self, keys: Iterable[str]) -> None:
        """Workloads seen within their memory quota this tick: a stop round that ran for one ends,
        so its next violation is stopped at once (killed, within the repeat window)."""
        for key in keys:
            known = self._stopped.get(key)
            if known is not None and known.last_stop is not None:
                known.last_stop = None  # the round ends; the trail's thinning and the repeat window stay

    def forget(self, key: str) -> None:
        """Called when a workload is gone, so a new one with the same key is judged afresh. Its
        counter series stay for the next scrapes (a job killed for its memory is gone at once);
        only the ``keep_gone`` most recently gone workloads keep theirs, so one series per
        workload ever stopped does not pile up for the manager's life."""
        known = self._stopped.get(key)
        if known is None:
            return
        known.last_stop, known.last_sent, known.last_report, known.rounds = None, None, None, 0
        self._gone[key] = None
        self._gone.move_to_end(key)
        while len(self._gone) > self._keep_gone:
            oldest, _ = self._gone.popitem(last=False)
            for card in self._stopped.pop(oldest).cards:
                self.violations.remove(oldest, card)
