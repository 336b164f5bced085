"""A standalone host's cards and jobs as the shared status view (:mod:`qgpu_runtime.status`).

Reading reaps first, so a job whose supervisor was killed never shows as holding a share.
"""

from __future__ import annotations

import os

from qgpu_runtime.standalone.store import Store
from qgpu_runtime.status import CardStatus, NodeStatus, WorkloadShare


def host_status(store: Store) -> NodeStatus:
    jobs = store.jobs()
    per_card: dict[int, list[WorkloadShare]] = {}
    for job in jobs:
        for share in job.shares:
            per_card.setdefault(share.index, []).append(WorkloadShare(job.id, share.core_milli, share.memory_mib, job.klass))
    cards = []
    for card in store.cards():
        work = tuple(per_card.get(card.index, ()))
        cards.append(CardStatus(card.index, card.uuid, card.model, card.memory_mib,
                                sum(w.core_milli for w in work), sum(w.memory_mib for w in work), work))
    return NodeStatus(store.get_meta("node") or os.uname().nodename, store.get_meta("policy") or "best-effort", tuple(cards))
