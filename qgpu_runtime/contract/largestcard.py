"""The largest card of the cluster: one operator setting every parser of a GPU request obeys.

A request for more GPU memory per card than any card could hold is refused where it is parsed
(``CardLimits.max_card_memory_mib``, 80 GiB by default), so it is refused at admission instead of
pending for ever. The webhook admits a pod, the extender and the node manager read it again, and
``qgpu run`` parses a job the same way: all of them must admit and refuse alike, so each takes
``--largest-card-memory-mib`` and builds its limits here (one rule, one bound), and the roles
render every component's flag from one variable, ``qgpu_largest_card_memory_mib``.

The setting only raises the bound (an H200's 143771 MiB): below 80 GiB the default stays, so no
cluster refuses what a cluster without the setting admits.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from qgpu_runtime.contract.inventory import MAX_MEMORY_MIB
from qgpu_runtime.model.requests import DEFAULT_LIMITS, MIB_PER_GIB, CardLimits

FLAG = "--largest-card-memory-mib"
MIN_LARGEST_CARD_MIB = MIB_PER_GIB
"""A card of 1 GiB: anything smaller is a unit mistake (GiB given as MiB)."""
MAX_LARGEST_CARD_MIB = MAX_MEMORY_MIB
"""1 TiB, the bound the node inventory puts on any card (contract/inventory.py)."""


def largest_card_problem(memory_mib: Any) -> str | None:
    """Why a value of ``--largest-card-memory-mib`` is refused (the flag, the value and the rule),
    or None."""
    if isinstance(memory_mib, bool) or not isinstance(memory_mib, int) \
            or not MIN_LARGEST_CARD_MIB <= memory_mib <= MAX_LARGEST_CARD_MIB:
        return (f"{FLAG} {memory_mib}: must be within {MIN_LARGEST_CARD_MIB}..{MAX_LARGEST_CARD_MIB} "
                "(MiB, a card of 1 GiB to 1 TiB)")
    return None


def card_limits(largest_card_memory_mib: int | None) -> CardLimits:
    """The default limits, whose largest card is the operator's when that is larger (None: the
    default's 80 GiB). Raises ValueError naming the flag, the value and the rule out of bounds."""
    if largest_card_memory_mib is None:
        return DEFAULT_LIMITS
    problem = largest_card_problem(largest_card_memory_mib)
    if problem:
        raise ValueError(problem)
    return replace(DEFAULT_LIMITS, max_card_memory_mib=max(DEFAULT_LIMITS.max_card_memory_mib, largest_card_memory_mib))


def add_largest_card_argument(parser: Any, also: str = "") -> None:
    """Add ``--largest-card-memory-mib`` to ``parser`` (anything with argparse's ``add_argument``),
    with the help every component shares and ``also``, what it means beside that here."""
    parser.add_argument(
        FLAG, type=int, default=None, metavar="MIB",
        help=f"the memory (MiB) of the largest card of the cluster: a request for more GPU memory per card is refused "
             f"(default {DEFAULT_LIMITS.max_card_memory_mib}, 80 GiB; a smaller value keeps it; set it where cards are "
             f"larger, an H200's 143771, and the same on every component: webhook, extender, node manager, qgpu run; "
             f"{MIN_LARGEST_CARD_MIB}..{MAX_LARGEST_CARD_MIB})" + (f"; {also}" if also else ""))
