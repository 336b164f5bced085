"""NVML backend of the node manager: discovery, metrics samples and XID health events.

NVML failing at start is an error that stops the manager: a GPU node that cannot see its GPUs
must not advertise simulated ones. Runtime sampling errors on one card are reported for that
card and do not stop the others.

The per-process part of a sample (which processes use a card, their memory and SM percent) comes
from :attr:`NvmlBackend.processes`, the node's one :class:`ProcessSampler`; the isolation loop
reads the same sampler (node/enforcer.py), so metrics and isolation see the same numbers
(gpu/nvml_processes.py says why). Loading NVML and card discovery are gpu/nvml_lib.py's.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from qgpu_runtime.gpu.nvml_lib import MIB, NvmlUnavailable, list_cards, load_nvml, text
from qgpu_runtime.gpu.nvml_processes import ProcessSampler
from qgpu_runtime.gpu.types import BackendError, CardInfo, CardUsage, HealthEvent, ProcessUsage

log = logging.getLogger(__name__)

# XIDs caused by applications rather than the card (the NVIDIA device plugin skips the same set):
# 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing,
# 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


def read_cgroup(pid: int, proc: Path = Path("/proc")) -> str:
    try:
        return (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return ""  # the process ended between the NVML call and now


class NvmlBackend:
    """Talks to the driver through NVML. One instance per manager; close() shuts NVML down."""

    name = "nvml"

    def __init__(self, skip_xids: frozenset[int] = APPLICATION_XIDS, nv: Any = None,
                 proc_root: Path = Path("/proc"), recheck_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``nv``: an initialised pynvml module or a fake of it (tests); loaded here when None.
        ``proc_root``: where processes' cgroup files are read. ``recheck_s``: how long a card stays
        out after its last health event before it is checked again (see :meth:`_fit`)."""
        self._nv = nv if nv is not None else load_nvml()
        self._skip_xids = skip_xids
        self._proc_root = proc_root
        self._recheck_s = recheck_s
        self._clock = clock
        self._out: dict[int, float] = {}  # card index -> when it was last reported or found unfit
        try:
            self._cards = list_cards(self._nv)
            if not self._cards:
                raise BackendError("NVML reports no GPUs on this host; nothing to serve")
            self._handles = [self._nv.nvmlDeviceGetHandleByIndex(c.index) for c in self._cards]
            self.processes = ProcessSampler(self._nv, [c.index for c in self._cards])
        except BackendError:
            self._nv.nvmlShutdown()
            raise
        except self._nv.NVMLError as exc:
            self._nv.nvmlShutdown()
            raise NvmlUnavailable(f"NVML discovery failed: {exc}") from exc
        self._metrics = self.processes.reader()
        self._events = self._register_events()

    def _register_events(self) -> Any:
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
        return self._cards

    def sample(self) -> tuple[CardUsage, ...]:
        """Whole-card utilisation and memory, and the processes as the shared sampler sees them."""
        nv = self._nv
        out = []
        for card, handle in zip(self._cards, self._handles):
            try:
                util = nv.nvmlDeviceGetUtilizationRates(handle)
                memory = nv.nvmlDeviceGetMemoryInfo(handle)
                procs = self._metrics.card(card.index)
            except (nv.NVMLError, BackendError) as exc:
                log.warning("card %d: sampling failed: %s", card.index, exc)
                continue
            out.append(CardUsage(
                index=card.index,
                util_pct=int(util.gpu),
                memory_used_mib=int(memory.used) // MIB,
                processes=tuple(ProcessUsage(pid=p.pid, card_index=card.index, memory_mib=p.memory_mib,
                                             sm_util_pct=p.sm_util_pct, cgroup=read_cgroup(p.pid, self._proc_root))
                                for p in procs),
            ))
        return tuple(out)

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]:
        back = self._returned()
        if back:
            return back
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
        uuid = text(nv.nvmlDeviceGetUUID(data.device))
        for card in self._cards:
            if card.uuid == uuid:
                kind = "XID" if data.eventType == nv.nvmlEventTypeXidCriticalError else f"event type {data.eventType}"
                self._out[card.index] = self._clock()
                return [HealthEvent(card.index, f"{kind} {xid}")]
        return []

    def _returned(self) -> list[HealthEvent]:
        """Cards reported unhealthy that are fit again, each checked at most every ``recheck_s``
        and only once that long has passed without a new event for it."""
        now = self._clock()
        back = []
        for index, since in sorted(self._out.items()):
            if now - since < self._recheck_s:
                continue
            if self._fit(self._handles[index]):
                del self._out[index]
                back.append(HealthEvent(index, "answers NVML again with no page retirement or row remapping pending",
                                        healthy=True))
            else:
                self._out[index] = now
        return back

    def _fit(self, handle: Any) -> bool:
        """The card answers NVML and needs no reset: a card fallen off the bus fails the memory
        query; ECC damage leaves page retirement or row remapping pending until the card is reset."""
        nv = self._nv
        try:
            nv.nvmlDeviceGetMemoryInfo(handle)
        except nv.NVMLError:
            return False
        for check in (lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(handle) != 0,
                      lambda: bool(nv.nvmlDeviceGetRemappedRows(handle)[2])):
            try:
                if check():
                    return False
            except nv.NVMLError_NotSupported:
                continue  # this card has no such feature (no ECC, or too old for row remapping)
            except nv.NVMLError:
                return False
        return True

    def close(self) -> None:
        try:
            self._nv.nvmlEventSetFree(self._events)
        finally:
            self._nv.nvmlShutdown()
