"""The memory rule: a tenant may not hold more GPU memory than its quota.

With MPS pinned-memory limits (CUDA >= 11.5) the driver refuses the allocation itself and the
application sees an out-of-memory error; this module is the rule the NVML watchdog applies where
no such limit exists (or as a second line behind it). Pure: it judges samples, the watchdog acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from qgpu_runtime.isolation.control import Tenant, Usage


@dataclass(frozen=True)
class MemoryViolation:
    """A tenant seen holding more memory than its quota (plus the configured tolerance)."""

    key: str
    used_mib: int
    quota_mib: int
    tolerance_mib: int

    def message(self) -> str:
        return (
            f"tenant {self.key!r} holds {self.used_mib} MiB of GPU memory, over its quota of "
            f"{self.quota_mib} MiB (tolerance {self.tolerance_mib} MiB): stopped by the qgpu memory watchdog"
        )


def memory_violations(
    tenants: Sequence[Tenant], usage: Mapping[str, Usage], tolerance_mib: int = 0
) -> tuple[MemoryViolation, ...]:
    """Tenants over their memory quota. A quota of 0 means no memory was booked: not judged."""
    if tolerance_mib < 0:
        raise ValueError(f"tolerance_mib: {tolerance_mib} is not allowed: must be >= 0")
    found = []
    for t in tenants:
        seen = usage.get(t.key)
        if t.memory_mib and seen is not None and seen.memory_mib > t.memory_mib + tolerance_mib:
            found.append(MemoryViolation(t.key, seen.memory_mib, t.memory_mib, tolerance_mib))
    return tuple(found)
