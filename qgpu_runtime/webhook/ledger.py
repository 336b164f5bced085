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
written, as the writer's wall clock sees it, for webhooks of earlier releases. The document and its
codec are the contract room's (:mod:`qgpu_runtime.contract.leases`); this module holds the rules
of counting its entries. Pure.
"""

from __future__ import annotations

from typing import Collection, Final, Mapping

from qgpu_runtime.contract.leases import Reservation
from qgpu_runtime.webhook.claimquota import Usage

MAX_ENTRIES: Final = 1000  # ~80 bytes each: well inside the 256 KiB of a Lease's annotations


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
        total += Usage(r.core_milli, r.memory_mib)
    return total
