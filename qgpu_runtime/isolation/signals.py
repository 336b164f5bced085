"""The duty-cycling actuator: SIGSTOP/SIGCONT a workload's process group, SIGTERM/SIGKILL to stop it.

Where no hardware cap exists, suspending the host processes is the one lever that works for any
CUDA program without hooking libcuda (the hook libraries' breakage on new CUDA versions is the
most common complaint against them). Kernels already queued keep running for a moment after
SIGSTOP; the control law repays that as debt.

Workloads are whole process groups (standalone jobs run in their own session), so a job's
children are held with it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Callable, Sequence

log = logging.getLogger("qgpu.isolation.signals")


class SignalActuator:
    """Acts on process groups; ``groups`` maps a workload key to its process-group ids.

    ``killpg`` is the kernel's ``os.killpg``; tests of callers that map processes themselves (the
    node manager) give one that acts on simulated processes, since signalling made-up process
    groups on the test host could hit real ones.
    """

    def __init__(self, groups: Callable[[str], Sequence[int]], grace_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 killpg: Callable[[int, int], None] = os.killpg):
        self._groups = groups
        self._grace_s = grace_s
        self._clock = clock
        self._killpg = killpg
        self._kill_due: dict[int, float] = {}

    def _signal(self, key: str, sig: signal.Signals) -> None:
        for pgid in self._groups(key):
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
        due = self._clock() + self._grace_s
        for pgid in self._groups(key):
            self._kill_due[pgid] = due

    def reap(self) -> None:
        """SIGKILL the groups whose grace period ran out; call every tick."""
        now = self._clock()
        for pgid, due in list(self._kill_due.items()):
            if now < due:
                continue
            del self._kill_due[pgid]
            try:
                self._killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
