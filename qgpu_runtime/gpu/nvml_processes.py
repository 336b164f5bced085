"""The per-process sample: which processes use a card, their memory, and their SM busy percent.

This is the single source of every per-process "used" figure on a host: the node's metrics
(gpu/nvml.py ``NvmlBackend.sample``) and the isolation engine (isolation/nvml_sampler.py) read
the same :class:`ProcessSampler`, so a container's memory and SM percent in
``container_gpu_utilization`` are the numbers the control law was given, not a second
measurement taken another way. (Before, metrics asked NVML for samples since the wall-clock time
of their previous sample and isolation asked since the newest driver timestamp it had seen; the
two could disagree and, polling the same ring buffer on their own, drift apart.)

Two NVML calls per card and poll:

- ``nvmlDeviceGetComputeRunningProcesses``: the processes with a context now and their memory;
- ``nvmlDeviceGetProcessUtilization(handle, since)``: the driver's per-process SM samples newer
  than ``since`` (microseconds, the driver's own timestamps). It keeps a short ring buffer and
  yields a new sample per process every 200-800 ms, each covering the driver's last window;
  NVML_ERROR_NOT_FOUND means nothing new.

The timestamps are handled here, once: ``since`` reaches one second behind the newest timestamp
already taken from the driver, and a sample enters the log only when it is newer than the last one
taken for its process, so each driver sample enters the log exactly once, also one stamped before
another process's sample that was already taken (under contention the H200's driver named one
process per period; a sample stamped earlier and written later would otherwise be lost behind
``since``). Consumers read at their own pace
(isolation every tick, metrics every ``--sample-interval``) through a :class:`ProcessReader`, a
cursor into that log: every read polls NVML and returns each sample that reader has not seen yet,
so a read by one consumer never takes samples away from the other. Samples every reader has seen
are dropped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from qgpu_runtime.gpu.nvml_lib import MIB
from qgpu_runtime.gpu.types import BackendError


@dataclass(frozen=True)
class SmSample:
    """One driver sample of a process: when (microseconds, NVML's timestamp) and SM busy percent."""

    ts_us: int
    sm_pct: int


@dataclass(frozen=True)
class ProcessSample:
    """A process on one card as one read sees it: its memory now and its SM samples new to the reader."""

    pid: int
    memory_mib: int
    sm: tuple[SmSample, ...] = ()  # oldest first

    @property
    def sm_util_pct(self) -> int:
        """The busiest SM percent among the new samples; 0 when the driver gave none since."""
        return max((s.sm_pct for s in self.sm), default=0)


LOOKBACK_US = 1_000_000  # how far behind the newest timestamp taken each poll asks again


@dataclass
class _Card:
    handle: Any
    since_us: int = 0  # newest driver timestamp taken so far
    taken: dict[int, int] = field(default_factory=dict)  # pid -> its newest timestamp taken
    log: tuple[tuple[int, int, SmSample], ...] = ()  # (sequence, pid, sample) not yet seen by every reader
    next_seq: int = 1
    memory: tuple[tuple[int, int], ...] = ()  # (pid, MiB) from the last poll


class ProcessSampler:
    """Per-process sampling of some cards of one NVML session; safe to read from several threads."""

    def __init__(self, nv: Any, indices: Sequence[int]) -> None:
        """``nv`` is the loaded pynvml module (gpu/nvml_lib.py ``load_nvml``) or a fake of it."""
        self._nv = nv
        self._cards = {i: _Card(nv.nvmlDeviceGetHandleByIndex(i)) for i in indices}
        self._cursors: list[dict[int, int]] = []
        self._lock = threading.Lock()

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(self._cards)

    def reader(self) -> "ProcessReader":
        """A new consumer; it will see every driver sample taken from now on (and those still logged)."""
        cursor = {i: 0 for i in self._cards}
        with self._lock:
            self._cursors.append(cursor)
        return ProcessReader(self, cursor)

    def _poll(self, index: int, card: _Card) -> None:
        nv = self._nv
        call = "nvmlDeviceGetComputeRunningProcesses"
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(card.handle)
            call = "nvmlDeviceGetProcessUtilization"
            try:
                got = nv.nvmlDeviceGetProcessUtilization(card.handle, max(0, card.since_us - LOOKBACK_US))
            except nv.NVMLError_NotFound:
                got = []  # no process has a sample newer than since_us
        except nv.NVMLError as err:
            raise BackendError(f"card {index}: {call}: {err}") from err
        memory: dict[int, int] = {}
        for p in procs:  # a process may hold more than one context on a card
            memory[int(p.pid)] = memory.get(int(p.pid), 0) + int(p.usedGpuMemory or 0) // MIB
        card.memory = tuple(sorted(memory.items()))
        new = sorted(((int(s.pid), SmSample(int(s.timeStamp), int(s.smUtil))) for s in got
                      if int(s.timeStamp) > card.taken.get(int(s.pid), 0)), key=lambda e: e[1].ts_us)
        for pid, sample in new:
            if sample.ts_us > card.taken.get(pid, 0):  # one process's samples twice in one answer: once
                card.taken[pid] = sample.ts_us
                card.log += ((card.next_seq, pid, sample),)
                card.next_seq += 1
                card.since_us = max(card.since_us, sample.ts_us)
        # a process is forgotten once it has no context and its last sample is behind the lookback
        card.taken = {pid: ts for pid, ts in card.taken.items()
                      if pid in memory or ts > card.since_us - LOOKBACK_US}

    def _read(self, index: int, cursor: dict[int, int]) -> tuple[ProcessSample, ...]:
        card = self._cards[index]
        with self._lock:
            self._poll(index, card)
            seen = cursor[index]
            fresh: dict[int, list[SmSample]] = {}
            for seq, pid, s in card.log:
                if seq > seen:
                    fresh.setdefault(pid, []).append(s)
            cursor[index] = card.next_seq - 1
            oldest = min(c[index] for c in self._cursors)
            card.log = tuple(e for e in card.log if e[0] > oldest)
            memory = dict(card.memory)
        return tuple(ProcessSample(pid, memory.get(pid, 0), tuple(fresh.get(pid, ())))
                     for pid in sorted(set(memory) | set(fresh)))


class ProcessReader:
    """One consumer's view of a :class:`ProcessSampler` (made by ``ProcessSampler.reader``)."""

    def __init__(self, sampler: ProcessSampler, cursor: dict[int, int]) -> None:
        self._sampler = sampler
        self._cursor = cursor

    @property
    def indices(self) -> tuple[int, ...]:
        return self._sampler.indices

    def card(self, index: int) -> tuple[ProcessSample, ...]:
        """Polls the card: every process with a context or a new sample, by pid.

        Raises :class:`BackendError` naming the card and the NVML call that failed."""
        return self._sampler._read(index, self._cursor)
