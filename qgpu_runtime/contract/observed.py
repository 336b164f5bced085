"""How long this process has watched each entry of a shared document: expiry without shared clocks.

The claim-quota ledgers and the node commitments are Lease annotations that several replicas write,
each entry stamped with its writer's wall clock. Two replicas' clocks can disagree by minutes
(docs/security.md; GUIDE "Trust"): judged by the reader's wall clock against the writer's stamp, a
replica 45 s ahead took its peers' fresh reservations for expired, erased them and over-admitted a
quota, and an entry stamped in the future was never pruned. So an entry's age is not read from its
stamp: each replica remembers when *it* first saw the entry, by its own monotonic clock, and an entry
expires for a replica only once that replica itself has watched it for longer than the TTL. A stamp
in the future then is an entry just seen, and a replica that restarts re-counts what it finds for at
most one TTL, which errs on the safe side (an entry counts longer, never shorter).

The stamps stay in the documents, unchanged in format, for readers of earlier releases.

Pure: times come in as arguments. Thread-safe: the extender binds to several nodes at once and the
webhook checks several namespaces at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable, Mapping, TypeVar

K = TypeVar("K", bound=Hashable)

DEFAULT_MAX_DOCUMENTS = 50_000
"""Documents remembered (a node's Lease, a namespace's ledger), least recently read out first: a
forgotten document's entries are new again when next read, which only makes them count longer."""


class FirstSeen:
    """First sighting, by this process's clock, of each (document, entry, stamp)."""

    def __init__(self, max_documents: int = DEFAULT_MAX_DOCUMENTS) -> None:
        if max_documents < 1:
            raise ValueError(f"max_documents={max_documents}: must be >= 1")
        self.max_documents = max_documents
        self._docs: OrderedDict[Hashable, dict[Hashable, tuple[Hashable, float]]] = OrderedDict()
        self._lock = threading.Lock()

    def ages(self, document: Hashable, stamps: Mapping[K, Hashable], now: float) -> dict[K, float]:
        """The age of every entry of ``document`` as read now: ``stamps`` maps each entry's key to
        what identifies this version of it (its writer's stamp, its content). A key not seen before,
        or seen with another stamp (the entry was written again), is new: age 0 from ``now``.
        Entries no longer in the document are forgotten, so memory follows the documents."""
        with self._lock:
            before = self._docs.pop(document, {})
            seen: dict[Hashable, tuple[Hashable, float]] = {}
            for key, stamp in stamps.items():
                known = before.get(key)
                seen[key] = known if known is not None and known[0] == stamp else (stamp, now)
            if seen:
                self._docs[document] = seen
                while len(self._docs) > self.max_documents:
                    self._docs.popitem(last=False)
            return {key: max(0.0, now - seen[key][1]) for key in stamps}

    def __len__(self) -> int:
        with self._lock:
            return len(self._docs)
