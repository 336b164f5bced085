"""The claim-quota reservation ledger: what claims admitted a moment ago ask, until they are visible.

Upstream quota closes the race between two CREATEs by writing the ResourceQuota's status on its
resourceVersion; a webhook that only reads the namespace's claims cannot, since a claim it just
admitted is not in the next list until the apiserver stored it. So each admission first writes a
*reservation* of what the claim asks into a per-namespace ledger, conditionally on the ledger's
resourceVersion (webhook/quota.py keeps it in a Lease); a second admission that read the ledger
before it changed loses the write (409), reads again and sees the first.

The real claims stay the source of truth: a reservation counts only while its claim is not yet
among the listed claims and it has not expired, so a claim that never appeared (refused by a later
admission step, or its CREATE failed) stops counting after the TTL. Expiry is measured by each
replica's own clock from when it first saw the entry (contract/observed.py); ``expires`` is still
written, as the writer's wall clock sees it, for webhooks of earlier releases. Pure: text in,
entries out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Collection, Final, Mapping

from qgpu_runtime.webhook.claimquota import Usage

VERSION: Final = 1
MAX_ENTRIES: Final = 1000  # ~80 bytes each: well inside the 256 KiB of a Lease's annotations
_SHOWN = 60


class LedgerError(ValueError):
    """The ledger's text cannot be read; the message names the field and the value."""


@dataclass(frozen=True)
class Reservation:
    """What one admitted claim asks, and until when (Unix seconds) it counts without being visible."""

    core_milli: int
    memory_mib: int
    expires: float

    @property
    def usage(self) -> Usage:
        return Usage(self.core_milli, self.memory_mib)


def _count(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LedgerError(f"{where}={value!r:.{_SHOWN}}: must be a non-negative integer")
    return value


def parse_ledger(raw: str | None) -> dict[str, Reservation]:
    """The reservations of a ledger text (``None``, an absent ledger, has none)."""
    if raw is None:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise LedgerError(f"ledger {raw!r:.{_SHOWN}} is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("reservations"), dict):
        raise LedgerError(f"ledger {raw!r:.{_SHOWN}}: must be an object with version {VERSION} and a 'reservations' object")
    entries = {}
    for claim, entry in doc["reservations"].items():
        where = f"ledger reservations[{claim!r:.{_SHOWN}}]"
        if not isinstance(entry, dict):
            raise LedgerError(f"{where}={entry!r:.{_SHOWN}}: must be an object with core, memory and expires")
        expires = entry.get("expires")
        if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
            raise LedgerError(f"{where}.expires={expires!r:.{_SHOWN}}: must be a finite number (Unix seconds)")
        entries[claim] = Reservation(_count(f"{where}.core", entry.get("core")), _count(f"{where}.memory", entry.get("memory")),
                                     float(expires))
    return entries


def encode_ledger(entries: Mapping[str, Reservation]) -> str:
    return json.dumps({"version": VERSION, "reservations": {
        claim: {"core": r.core_milli, "memory": r.memory_mib, "expires": round(r.expires, 3)} for claim, r in sorted(entries.items())}},
        separators=(",", ":"))


def stamps(entries: Mapping[str, Reservation]) -> dict[str, tuple[int, int, float]]:
    """What identifies each version of an entry, for :class:`~qgpu_runtime.contract.observed.FirstSeen`:
    a claim reserved again (a retried CREATE) is a new entry."""
    return {claim: (r.core_milli, r.memory_mib, r.expires) for claim, r in entries.items()}


def pending(entries: Mapping[str, Reservation], ages: Mapping[str, float], ttl: float,
            visible: Collection[str]) -> dict[str, Reservation]:
    """The reservations that still count: watched by this replica for less than ``ttl`` (``ages``,
    by its own clock: an entry it has no age for was just seen), and their claim not yet among
    ``visible`` (once it is, the claim itself counts; keeping the entry would count it twice).

    The entry's ``expires`` is not compared with this replica's wall clock: the writer's clock may
    run ahead or behind (contract/observed.py), and a fast reader would erase its peers' entries."""
    return {claim: r for claim, r in entries.items() if ages.get(claim, 0.0) < ttl and claim not in visible}


def reserved_usage(entries: Mapping[str, Reservation]) -> Usage:
    total = Usage()
    for r in entries.values():
        total += r.usage
    return total
