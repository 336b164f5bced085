"""The node's over-booking guard, one rule for both doors: a new grant must not push a card past its capacity.

The node is the last line of defence: the extender's commitments keep binders from promising a
card twice, and this refuses a booking that does so anyway (an older extender, a binder running
without commitments, a record written by hand, a scheduler that lost count of DRA claims). The
device plugin's Allocate and the DRA plugin's NodePrepareResources both ask it, with the store's
rows that still hold their cards, before they book; the rule itself is the placement engine's
``over_commitment``, so node and extender count a card the same way.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from qgpu_runtime.contract.leases import CardUse, Commitment
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD
from qgpu_runtime.node.store import Share
from qgpu_runtime.placement.commitments import over_commitment


def card_use(index: int, core_milli: int, memory_mib: int) -> CardUse:
    """One card's part of a booking; a full core share holds the card whole."""
    return CardUse(index, core_milli, memory_mib, core_milli >= CORE_MILLI_PER_CARD)


def over_booking(cards: Mapping[int, CardInfo], held: Iterable[Share], key: str, name: str,
                 uses: Sequence[CardUse]) -> list[str]:
    """Why booking ``uses`` (for ``key``, named ``name`` in the messages) on top of the ``held``
    store rows would put a card over its capacity; empty when it fits."""
    # One commitment per holder with all of its cards: the rule counts a holder once (it
    # deduplicates by holder), so one commitment per row counted a multi-card holder's first card only.
    rows: dict[str, list[Share]] = {}
    for s in held:
        rows.setdefault(f"{s.workload_id}/{s.container}", []).append(s)
    booked = [Commitment(holder, f"{mine[0].namespace}/{mine[0].workload}", 0,
                         tuple(card_use(s.card_index, s.core_milli, s.memory_mib) for s in mine))
              for holder, mine in rows.items()]
    return over_commitment({i: c.memory_mib for i, c in cards.items()}, booked, Commitment(key, name, 0, tuple(uses)))
