"""NVML backend (nvidia-ml-py): discovery, per-process usage and XID health events.

NVML failing at start is an error that stops the manager: a GPU node that cannot see its GPUs
must not advertise simulated ones. Runtime sampling errors on one card are reported for that
card and do not stop the others.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from qgpu_runtime.gpu.types import BackendError, CardInfo, CardUsage, HealthEvent, ProcessUsage

log = logging.getLogger(__name__)

# XIDs caused by applications rather than the card (the NVIDIA device plugin skips the same set):
# 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing,
# 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
MIB = 1024 * 1024


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_cgroup(pid: int, proc: Path = Path("/proc")) -> str:
    try:
        return (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return ""  # the process ended between the NVML call and now


class NvmlBackend:
    """Talks to the driver through NVML. One instance per manager; close() shuts NVML down."""

    name = "nvml"

    def __init__(self, skip_xids: frozenset[int] = APPLICATION_XIDS) -> None:
        import pynvml

        self._nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise BackendError(f"NVML init failed: {exc}; is the NVIDIA driver loaded and /dev/nvidia* visible? "
                               "(use --gpu-backend simulated only on purpose, for hosts without GPUs)") from exc
        self._skip_xids = skip_xids
        self._handles = []
        self._cards: list[CardInfo] = []
        self._last_sample_us: dict[int, int] = {}
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise BackendError("NVML reports no GPUs on this host; nothing to serve")
            for index in range(count):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                self._handles.append(handle)
                self._cards.append(CardInfo(
                    index=index,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    model=_text(pynvml.nvmlDeviceGetName(handle)),
                    memory_mib=int(memory.total) // MIB,
                    minor=int(pynvml.nvmlDeviceGetMinorNumber(handle)),
                ))
        except BackendError:
            pynvml.nvmlShutdown()
            raise
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            raise BackendError(f"NVML discovery failed at card {len(self._handles)}: {exc}") from exc
        self._events = self._register_events()

    def _register_events(self):
        nv = self._nv
        event_set = nv.nvmlEventSetCreate()
        wanted = nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypeDoubleBitEccError | nv.nvmlEventTypeSingleBitEccError
        for card, handle in zip(self._cards, self._handles):
            try:
                supported = nv.nvmlDeviceGetSupportedEventTypes(handle)
                nv.nvmlDeviceRegisterEvents(handle, wanted & supported, event_set)
            except nv.NVMLError as exc:
                # Without events we cannot see XIDs on this card; that is worth a loud line, not a stop.
                log.warning("card %d (%s): health events unavailable: %s", card.index, card.uuid, exc)
        return event_set

    def cards(self) -> tuple[CardInfo, ...]:
        return tuple(self._cards)

    def sample(self) -> tuple[CardUsage, ...]:
        nv = self._nv
        out = []
        for card, handle in zip(self._cards, self._handles):
            try:
                util = nv.nvmlDeviceGetUtilizationRates(handle)
                memory = nv.nvmlDeviceGetMemoryInfo(handle)
                procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
            except nv.NVMLError as exc:
                log.warning("card %d: sampling failed: %s", card.index, exc)
                continue
            sm = self._process_sm_util(card.index, handle)
            out.append(CardUsage(
                index=card.index,
                util_pct=int(util.gpu),
                memory_used_mib=int(memory.used) // MIB,
                processes=tuple(
                    ProcessUsage(pid=int(p.pid), card_index=card.index,
                                 memory_mib=int(p.usedGpuMemory or 0) // MIB,
                                 sm_util_pct=sm.get(int(p.pid), 0), cgroup=read_cgroup(int(p.pid)))
                    for p in procs
                ),
            ))
        return tuple(out)

    def _process_sm_util(self, index: int, handle) -> dict[int, int]:
        """SM utilisation per pid since the previous sample (NVML keeps a short ring buffer)."""
        nv = self._nv
        since = self._last_sample_us.get(index, 0)
        self._last_sample_us[index] = int(time.time() * 1e6)
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(handle, since)
        except nv.NVMLError:
            return {}  # NVML_ERROR_NOT_FOUND: no process ran since `since`
        result: dict[int, int] = {}
        for s in samples:
            result[int(s.pid)] = max(result.get(int(s.pid), 0), int(s.smUtil))
        return result

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        nv = self._nv
        try:
            data = nv.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except nv.NVMLError_Timeout:
            return []
        except nv.NVMLError as exc:
            log.warning("NVML event wait failed: %s", exc)
            time.sleep(timeout_s)
            return []
        xid = int(data.eventData)
        if data.eventType == nv.nvmlEventTypeXidCriticalError and xid in self._skip_xids:
            return []
        uuid = _text(nv.nvmlDeviceGetUUID(data.device))
        for card in self._cards:
            if card.uuid == uuid:
                kind = "XID" if data.eventType == nv.nvmlEventTypeXidCriticalError else f"event type {data.eventType}"
                return [HealthEvent(card.index, f"{kind} {xid}")]
        return []

    def close(self) -> None:
        try:
            self._nv.nvmlEventSetFree(self._events)
        finally:
            self._nv.nvmlShutdown()
