"""A stand-in for the pynvml module: the calls qgpu_runtime/gpu makes, with scripted answers.

Per-process utilisation behaves as NVML's does: only samples newer than ``since`` come back, and
NVML_ERROR_NOT_FOUND when there is none. Used by tests/node/test_node_nvml.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

MIB = 1024 * 1024


class NVMLError(Exception):
    pass


class NVMLError_NotFound(NVMLError):  # noqa: N801 (pynvml's name)
    pass


class NVMLError_Timeout(NVMLError):  # noqa: N801
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    pass


@dataclass
class FakeCard:
    uuid: str
    name: str
    memory_mib: int
    minor: int
    util_pct: int = 0
    used_mib: int = 0
    procs: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes or None)
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (pid, timestamp µs, SM %)
    fail: str | None = None  # name of a call that fails on this card
    retirement_pending: bool | None = False  # None: the card has no page retirement (NOT_SUPPORTED)
    remap_pending: bool | None = False  # None: the card has no row remapping (NOT_SUPPORTED)


class FakeNvml:
    NVMLError = NVMLError
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_NotSupported = NVMLError_NotSupported
    nvmlEventTypeSingleBitEccError = 1
    nvmlEventTypeDoubleBitEccError = 2
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, cards: list[FakeCard]) -> None:
        self.cards = cards
        self.events: list[SimpleNamespace] = []
        self.utilization_calls: list[tuple[int, int]] = []  # (card, since)
        self.shut_down = False

    def _check(self, index: int, call: str) -> FakeCard:
        card = self.cards[index]
        if card.fail == call:
            raise NVMLError(f"{call}: GPU is lost")
        return card

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return self.cards[h].uuid.encode()  # older nvidia-ml-py releases answer bytes

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.cards[h].name

    def nvmlDeviceGetMinorNumber(self, h: int) -> int:
        return self._check(h, "nvmlDeviceGetMinorNumber").minor

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        card = self._check(h, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=card.memory_mib * MIB, used=card.used_mib * MIB)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self.cards[h].util_pct)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        card = self._check(h, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in card.procs]

    def nvmlDeviceGetProcessUtilization(self, h: int, since: int) -> list[SimpleNamespace]:
        card = self._check(h, "nvmlDeviceGetProcessUtilization")
        self.utilization_calls.append((h, since))
        fresh = [SimpleNamespace(pid=pid, timeStamp=ts, smUtil=sm) for pid, ts, sm in card.samples if ts > since]
        if not fresh:
            raise NVMLError_NotFound("Not Found")
        return fresh

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return 13000

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass

    def nvmlDeviceGetSupportedEventTypes(self, h: int) -> int:
        return 0xFF

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: str) -> None:
        pass

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        if not self.events:
            raise NVMLError_Timeout("Timeout")
        return self.events.pop(0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        card = self._check(h, "nvmlDeviceGetRetiredPagesPendingStatus")
        if card.retirement_pending is None:
            raise NVMLError_NotSupported("Not Supported")
        return int(card.retirement_pending)

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        card = self._check(h, "nvmlDeviceGetRemappedRows")
        if card.remap_pending is None:
            raise NVMLError_NotSupported("Not Supported")
        return (0, 1 if card.remap_pending else 0, int(card.remap_pending), 0)

    def xid(self, index: int, xid: int) -> None:
        self.events.append(SimpleNamespace(eventType=self.nvmlEventTypeXidCriticalError, eventData=xid, device=index))


def two_cards() -> FakeNvml:
    return FakeNvml([FakeCard("GPU-aaaa", "NVIDIA H100 80GB HBM3", 81559, 0),
                     FakeCard("GPU-bbbb", "NVIDIA H100 80GB HBM3", 81559, 3)])
