"""The standalone host manager: enforces the host's isolation policy on the jobs `qgpu run` started.

One loop, no systemd needed: every tick it reads the live jobs from the database, turns each into
a workload (its process group and per-card bookings), and lets the isolation engine sample and act.
It records its settings in the database so every `qgpu run` and `qgpu status` sees the same policy,
and on exit it resumes every job it held and stops the MPS daemon it started.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from prometheus_client import CollectorRegistry

from qgpu_runtime.isolation.engine import CardQuota, IsolationEngine, TickReport, Workload
from qgpu_runtime.isolation.mps import MpsDaemon, MpsError, pinned_limits_supported
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.isolation.runner import build_engine, run_every
from qgpu_runtime.isolation.signals import SignalActuator
from qgpu_runtime.model import AppClass
from qgpu_runtime.standalone.config import HostConfig, discover_cards
from qgpu_runtime.standalone.simhost import SimulatedHost
from qgpu_runtime.standalone.store import JobRecord, Store, process_start_ticks

log = logging.getLogger("qgpu.standalone.manager")

REAP_EVERY_S = 1.0
USAGE_EVERY_S = 1.0
"""How often what the jobs used (the engine's per-tick samples, averaged) is written to the store
for `qgpu status`."""


def job_groups(job: JobRecord | None, start_of: Callable[[int], int | None] = process_start_ticks) -> list[int]:
    """The job's process group, checked at the moment of signalling: if a process now holds the
    group leader's PID with another start time, the job ended and the number was reused, so
    nothing is signalled. A leader that is gone leaves its group's number reserved while any of
    its children live (the kernel does not reuse a PID in use as a group ID), so the group is
    still the job's."""
    if job is None or not job.pgid:
        return []
    now = start_of(job.pgid)
    if now is not None and now != job.pgid_start:
        log.warning("job %s: PID %d now names another process (started at %d, not %s): not signalled",
                    job.id, job.pgid, now, job.pgid_start)
        return []
    return [job.pgid]


def workload_of(job: JobRecord) -> Workload:
    """Whole-card jobs carry no share to enforce: compute and memory are theirs."""
    cards = tuple(CardQuota(s.index, 0 if job.exclusive else s.core_milli, 0 if job.exclusive else s.memory_mib) for s in job.shares)
    return Workload(job.id, AppClass(job.klass), cards)


@dataclass
class _Mps:
    daemon: MpsDaemon
    pinned: bool


class StandaloneManager:
    def __init__(self, store: Store, config: HostConfig, registry: CollectorRegistry, usage_file: str | None = None):
        self.store = store
        self.config = config
        self.registry = registry
        self._running: dict[str, JobRecord] = {}
        self._by_pgid: dict[int, str] = {}
        self.signals = SignalActuator(lambda key: job_groups(self._running.get(key)))
        self._mps: _Mps | None = None
        self._sim: SimulatedHost | None = None
        self._usage_file = usage_file
        self.engine: IsolationEngine | None = None
        self._last_reap = 0.0
        self._used_milli_s: dict[tuple[str, int], float] = {}  # (job, card) -> milli-card-seconds since the last write
        self._memory: dict[tuple[str, int], int] = {}  # (job, card) -> MiB at the latest tick
        self._used_span_s = 0.0
        self._last_usage = 0.0
        self._card_indexes: tuple[int, ...] = ()  # every card's row is written, idle ones as (0, 0)

    # -- setup ------------------------------------------------------------------------------
    def start(self) -> None:
        """Record the inventory and settings, start MPS if asked, build the engine."""
        cards = discover_cards(self.config)
        self.store.set_cards(cards)
        self._resume_booked_jobs()
        self._card_indexes = tuple(c.index for c in cards)
        with self.store.transaction():
            for key, value in (("node", self.config.node_name), ("policy", self.config.policy.value),
                               ("placement", self.config.placement), ("gpu_backend", self.config.gpu_backend),
                               ("simulated_gpus", self.config.simulated_gpus or "")):
                self.store.set_meta(key, value)
        sampler: Any
        actuator: Any
        if self.config.gpu_backend == "simulated":
            if self.config.mps == "on":
                raise ValueError("mps: 'on' is not allowed with gpu_backend simulated: MPS needs real cards")
            self._sim = SimulatedHost(cards, self.signals, self._usage_file)
            sampler = actuator = self._sim
        else:
            from qgpu_runtime.gpu.nvml_lib import cuda_driver_version, load_nvml
            from qgpu_runtime.gpu.nvml_processes import ProcessSampler
            from qgpu_runtime.isolation.nvml_sampler import NvmlSampler

            nvml = load_nvml()
            sampler = NvmlSampler(ProcessSampler(nvml, [c.index for c in cards]).reader(), self._owner)
            actuator = self.signals
            self._start_mps(cuda_driver_version(nvml))
        # With MPS under fixed-share the thread percentage caps compute; duty cycling would cap twice.
        enforce_compute = not (self._mps is not None and self.config.policy is Policy.FIXED_SHARE)
        self.engine = build_engine(self.config.policy, sampler, actuator, self.registry, self.store,
                                   self.config.memory_tolerance_mib, enforce_compute)
        log.info("standalone manager on %s: %d card(s), policy %s, backend %s, MPS %s",
                 self.config.node_name, len(cards), self.config.policy.value, self.config.gpu_backend,
                 "on" if self._mps else "off")

    def _resume_booked_jobs(self) -> None:
        """SIGCONT every live booked job: a manager killed outright (SIGKILL, the OOM killer) could
        not resume the jobs it held, and nothing else would. The store does not say which jobs were
        held, so all are resumed (a job stopped by hand too); the engine holds again whatever its
        policy holds. The same checks as any signal: the group's leader must still be the recorded
        process, and never the manager's own group."""
        live = [j for j in self.store.jobs() if j.pgid]
        self._running = {j.id: j for j in live}
        for job in live:
            self.signals.resume(job.id)
        if live:
            log.info("resumed %d booked job(s) a previous manager may have held", len(live))

    def _start_mps(self, cuda_version: int) -> None:
        if self.config.mps == "off":
            return
        if MpsDaemon.find() is None:
            if self.config.mps == "on":
                raise MpsError("mps: 'on' but nvidia-cuda-mps-control is not on PATH")
            log.info("MPS not available (nvidia-cuda-mps-control not on PATH): duty cycling only")
            return
        base = os.path.abspath(self.store.path) + ".mps"
        daemon = MpsDaemon(os.path.join(base, "pipe"), os.path.join(base, "log"))
        daemon.start()
        self._mps = _Mps(daemon, pinned_limits_supported(cuda_version))
        with self.store.transaction():
            self.store.set_meta("mps_pipe_dir", daemon.pipe_dir)
            self.store.set_meta("mps_log_dir", daemon.log_dir)
            self.store.set_meta("mps_pinned", "1" if self._mps.pinned else "0")

    def _owner(self, pid: int) -> str | None:
        try:
            # the job's session, not its group: a child that made a group of its own is still the job's
            return self._by_pgid.get(os.getsid(pid))
        except (ProcessLookupError, PermissionError):
            return None

    # -- loop -------------------------------------------------------------------------------
    def tick(self, dt_s: float, now: float) -> TickReport:
        assert self.engine is not None, "start() first"
        if now - self._last_reap >= REAP_EVERY_S:
            jobs = self.store.jobs()
            self._last_reap = now
        else:
            jobs = self.store.booked_jobs()
        running = [j for j in jobs if j.pgid]
        self._running = {j.id: j for j in running}
        self._by_pgid = {j.pgid: j.id for j in running if j.pgid}
        if self._sim is not None:
            self._sim.sync(running)
        report = self.engine.tick([workload_of(j) for j in running], dt_s)
        self.signals.reap()
        self._account(report, dt_s, now)
        return report

    def _account(self, report: TickReport, dt_s: float, now: float) -> None:
        """Add the tick's use per job and card; every USAGE_EVERY_S write the means to the store."""
        self._used_span_s += dt_s
        for card, per_job in report.usage.items():
            for job, use in per_job.items():
                key = (job, card)
                self._used_milli_s[key] = self._used_milli_s.get(key, 0.0) + use.used_milli * dt_s
                self._memory[key] = use.memory_mib
        if now - self._last_usage < USAGE_EVERY_S or self._used_span_s <= 0:
            return
        live = set(self._running)
        jobs = {key: (min(100, round(milli_s / self._used_span_s / 10)), self._memory.get(key, 0))
                for key, milli_s in self._used_milli_s.items() if key[0] in live}
        # A row for every card, idle ones at 0: with no job running the sample still says when it
        # was taken, so `qgpu status` shows idle cards at 0 % and a manager that stopped writing as stale.
        cards: dict[int, tuple[int, int]] = {index: (0, 0) for index in self._card_indexes}
        for (_, card), (sm, mib) in jobs.items():
            total_sm, total_mib = cards.get(card, (0, 0))
            cards[card] = (min(100, total_sm + sm), total_mib + mib)
        self.store.write_usage(jobs, cards, time.time())
        self._used_milli_s, self._memory, self._used_span_s, self._last_usage = {}, {}, 0.0, now

    def serve(self, stop: threading.Event) -> None:
        try:
            run_every(self.config.tick_s, stop, self.tick)
        finally:
            self.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self._mps is not None:
            try:
                self._mps.daemon.stop()
            except MpsError as err:
                log.error("stopping MPS: %s", err)
            with self.store.transaction():
                for key in ("mps_pipe_dir", "mps_log_dir", "mps_pinned"):
                    self.store.delete_meta(key)
            self._mps = None
