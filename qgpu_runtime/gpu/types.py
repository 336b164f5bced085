"""What the node manager needs to know about GPUs, independent of where it comes from.

Two backends produce these values: NVML on real hosts and a simulated backend for machines
without GPUs. The manager only ever sees this module's types, so both are driven the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class CardInfo:
    """One physical GPU as discovered at start."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    minor: int  # /dev/nvidia<minor>
    healthy: bool = True


@dataclass(frozen=True)
class ProcessUsage:
    """A process using a card: memory in MiB, SM utilisation in percent of the card.

    ``cgroup`` is the text of /proc/<pid>/cgroup (the simulated backend supplies it directly); the
    manager maps it to a pod and container.
    """

    pid: int
    card_index: int
    memory_mib: int
    sm_util_pct: int
    cgroup: str = ""


@dataclass(frozen=True)
class CardUsage:
    """One sample of a card: whole-card utilisation and memory in use, and its processes."""

    index: int
    util_pct: int
    memory_used_mib: int
    processes: tuple[ProcessUsage, ...] = field(default=())


@dataclass(frozen=True)
class HealthEvent:
    """A card turned unhealthy (XID error, lost from the bus, ECC), or, with ``healthy``, is fit
    to use again (the backend checked it). ``reason`` is for people."""

    card_index: int
    reason: str
    healthy: bool = False


class BackendError(RuntimeError):
    """A GPU backend failed; the message says which call, on which card, and NVML's own words."""


class GpuBackend(Protocol):
    """The manager's view of a GPU library. Implementations: NvmlBackend, SimulatedBackend."""

    name: str

    def cards(self) -> tuple[CardInfo, ...]: ...

    def sample(self) -> tuple[CardUsage, ...]: ...

    def wait_health_events(self, timeout_s: float) -> list[HealthEvent]: ...

    def close(self) -> None: ...
