"""The duty-cycling actuator: SIGSTOP/SIGCONT a workload's process group, SIGTERM/SIGKILL to stop it.

Where no hardware cap exists, suspending the host processes is the one lever that works for any
CUDA program without hooking libcuda (the hook libraries' breakage on new CUDA versions is the
most common complaint against them). Kernels already queued keep running for a moment after
SIGSTOP; the control law repays that as debt.

Workloads are whole process groups (standalone jobs run in their own session), so a job's
children are held with it. Whoever maps a workload to its groups re-checks them when asked (the
PIDs behind them may have been reused); as a last line, the actuator itself never signals group 0
(``killpg(0)`` is the caller's own group), group 1 (init's) or the manager's own group.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Callable, Sequence

log = logging.getLogger("qgpu.isolation.signals")


def forbidden_group(pgid: int, own_pgid: int) -> str | None:
    """Why ``pgid`` must never be signalled, or None: ``killpg`` of 0 or 1 (or negative numbers,
    which Linux reads as "every process") reaches far beyond a workload, and the manager's own
    group would freeze the loop that is meant to resume it."""
    if pgid <= 1:
        return f"group {pgid} is never a workload's"
    if pgid == own_pgid:
        return "it is the manager's own process group"
    return None


class SignalActuator:
    """Acts on process groups; ``groups`` maps a workload key to its process-group ids.

    ``killpg`` is the kernel's ``os.killpg``; tests of callers that map processes themselves (the
    node manager) give one that acts on simulated processes, since signalling made-up process
    groups on the test host could hit real ones.
    """

    def __init__(self, groups: Callable[[str], Sequence[int]], grace_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 killpg: Callable[[int, int], None] = os.killpg, own_pgid: int | None = None,
                 running: Callable[[str], bool] | None = None):
        """``running(key)``: whether the workload's processes run (are not stopped), so the
        engine holds again a workload resumed behind its back; None: not known."""
        self._groups = groups
        if running is not None:
            # a workload being stopped runs because the stop continued it (SIGCONT before SIGTERM,
            # so it can handle SIGTERM in its grace): not a workload resumed behind the engine's back
            self.running = lambda key: key not in self._kill_due and running(key)
        self._grace_s = grace_s
        self._clock = clock
        self._killpg = killpg
        self._own_pgid = os.getpgrp() if own_pgid is None else own_pgid
        self._kill_due: dict[str, float] = {}  # workload key -> when its grace period ends
        self._kill_failing: set[str] = set()  # keys whose SIGKILL raised (logged once)

    def _signal(self, key: str, sig: signal.Signals) -> None:
        for pgid in self._groups(key):
            why = forbidden_group(pgid, self._own_pgid)
            if why is not None:
                log.error("refusing to send %s to process group %d of %s: %s", sig.name, pgid, key, why)
                continue
            try:
                self._killpg(pgid, sig)
            except ProcessLookupError:
                pass  # the workload already ended; the store reaps it
            except PermissionError as err:
                log.error("cannot send %s to process group %d of %s: %s", sig.name, pgid, key, err)

    def hold(self, key: str) -> None:
        self._signal(key, signal.SIGSTOP)

    def resume(self, key: str) -> None:
        self._signal(key, signal.SIGCONT)

    def stop(self, key: str, reason: str) -> None:
        """Terminate politely (a stopped process cannot handle SIGTERM, so continue it first)."""
        log.warning("stopping %s: %s", key, reason)
        self._signal(key, signal.SIGCONT)
        self._signal(key, signal.SIGTERM)
        # a stop of a workload already being stopped does not put its SIGKILL off
        self._kill_due.setdefault(key, self._clock() + self._grace_s)

    def kill(self, key: str, reason: str) -> None:
        """Kill at once, without the grace period: a workload over its memory quota again soon
        after a stop (isolation/watchdog.py)."""
        log.warning("killing %s: %s", key, reason)
        self._kill_due.pop(key, None)
        self._signal(key, signal.SIGCONT)
        self._signal(key, signal.SIGKILL)

    def reap(self) -> None:
        """SIGKILL the workloads whose grace period ran out; call every tick.

        The kill goes to the groups the workload has now, asked for again (and re-checked by
        whoever maps it) at this moment, not to those it had at SIGTERM: seconds after SIGTERM a
        group may have ended and its number gone to someone else's process, which must not be
        killed, and a process of the workload may have left its group (``setsid`` in a SIGTERM
        handler), which must not escape.
        """
        now = self._clock()
        for key, due in sorted(self._kill_due.items()):
            if now < due:
                continue
            try:
                self._signal(key, signal.SIGKILL)
            except Exception:  # one workload's failure must not spare the others
                if key not in self._kill_failing:
                    log.exception("cannot send SIGKILL to %s after its grace period (tried again every reap)", key)
                self._kill_failing.add(key)
                continue
            del self._kill_due[key]
            self._kill_failing.discard(key)
