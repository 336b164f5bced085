"""FROZEN COPY, for version-skew tests only: the Lease documents' readers before issue 21 §6.

The webhook's claim-quota ledger (webhook/ledger.py) and the extender's node commitments
(placement/commitments.py) as of commit 6b3d1c4, when expiry compared the writer's stamp with the
reader's wall clock: verbatim apart from this docstring, imports inlined (load_json a stand-in with the
same result for readable documents) and the parts that need
other modules (Usage, Placement) left out. A rolling upgrade runs them beside the current writers.
Never import this from qgpu_runtime; never "fix" it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Collection, Final, Iterable, Mapping

COMMITMENTS = "qgpu.io/commitments"
CORE_MILLI_PER_CARD = 1000


def load_json(raw: str, kind: type, name: str, error: type) -> Any:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise error(f"{name}: not JSON ({exc})") from None
    if not isinstance(doc, kind):
        raise error(f"{name}: must be a JSON {kind.__name__}")
    return doc


# --- webhook/ledger.py -------------------------------------------------------------------------

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


def pending(entries: Mapping[str, Reservation], now: float, visible: Collection[str]) -> dict[str, Reservation]:
    """The reservations that still count: not expired, and their claim not yet among ``visible``
    (once it is, the claim itself counts; keeping the entry would count it twice)."""
    return {claim: r for claim, r in entries.items() if r.expires > now and claim not in visible}


# --- placement/commitments.py --------------------------------------------------------------------

DOCUMENT_VERSION = 1


class CommitmentError(ValueError):
    """A commitment document that cannot be read; the message names the field, value and rule."""


@dataclass(frozen=True)
class CardUse:
    """One pod's total use of one card (all its containers on that card)."""

    index: int
    core_milli: int
    memory_mib: int
    exclusive: bool = False


@dataclass(frozen=True)
class Commitment:
    """One pod's promise on one node."""

    uid: str
    pod: str  # namespace/name, for people reading the Lease
    since_ns: int
    cards: tuple[CardUse, ...]


@dataclass(frozen=True)
class NodeCommitments:
    node: str
    pods: Mapping[str, Commitment] = field(default_factory=dict)

    def to_json(self) -> str:
        doc = {"version": DOCUMENT_VERSION, "node": self.node, "pods": {
            uid: {"pod": c.pod, "since_ns": c.since_ns,
                  "cards": [{"index": u.index, "core_milli": u.core_milli, "memory_mib": u.memory_mib,
                             "exclusive": u.exclusive} for u in c.cards]}
            for uid, c in sorted(self.pods.items())}}
        return json.dumps(doc, separators=(",", ":"))

    def with_pod(self, commitment: Commitment) -> "NodeCommitments":
        return NodeCommitments(self.node, {**self.pods, commitment.uid: commitment})

    def without(self, uids: Iterable[str]) -> "NodeCommitments":
        drop = set(uids)
        return NodeCommitments(self.node, {u: c for u, c in self.pods.items() if u not in drop})


def _int(doc: Mapping[str, Any], name: str, where: str, minimum: int = 0, maximum: int | None = None) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CommitmentError(f"{COMMITMENTS}: {where}{name}={value!r}: must be an integer")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"within {minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise CommitmentError(f"{COMMITMENTS}: {where}{name}={value}: must be {bound}")
    return value


def parse_commitments(raw: str | None, node: str) -> NodeCommitments:
    """Decode the annotation (None or empty: nothing committed yet). Refuses a document written for
    another node, an unknown version and malformed fields, naming them."""
    if not raw:
        return NodeCommitments(node)
    doc = load_json(raw, dict, COMMITMENTS, CommitmentError)
    if doc.get("version") != DOCUMENT_VERSION:
        raise CommitmentError(f"{COMMITMENTS}: version={doc.get('version')!r}: only version {DOCUMENT_VERSION} is known")
    if doc.get("node") != node:
        raise CommitmentError(f"{COMMITMENTS}: node={doc.get('node')!r}: the document of node {node!r} must name it")
    pods_doc = doc.get("pods")
    if not isinstance(pods_doc, dict):
        raise CommitmentError(f"{COMMITMENTS}: pods={pods_doc!r}: must be an object keyed by pod UID")
    pods: dict[str, Commitment] = {}
    for uid, entry in pods_doc.items():
        where = f"pods[{uid!r}]."
        if not uid or not isinstance(entry, dict):
            raise CommitmentError(f"{COMMITMENTS}: pods[{uid!r}]={entry!r}: must be an object under a non-empty UID")
        pod = entry.get("pod")
        if not isinstance(pod, str):
            raise CommitmentError(f"{COMMITMENTS}: {where}pod={pod!r}: must be a string namespace/name")
        cards_doc = entry.get("cards")
        if not isinstance(cards_doc, list):
            raise CommitmentError(f"{COMMITMENTS}: {where}cards={cards_doc!r}: must be a list")
        cards = []
        for j, card in enumerate(cards_doc):
            at = f"{where}cards[{j}]."
            if not isinstance(card, dict):
                raise CommitmentError(f"{COMMITMENTS}: {at[:-1]}={card!r}: must be an object")
            exclusive = card.get("exclusive", False)
            if not isinstance(exclusive, bool):
                raise CommitmentError(f"{COMMITMENTS}: {at}exclusive={exclusive!r}: must be true or false")
            cards.append(CardUse(_int(card, "index", at), _int(card, "core_milli", at, 0, CORE_MILLI_PER_CARD),
                                 _int(card, "memory_mib", at), exclusive))
        pods[uid] = Commitment(uid, pod, _int(entry, "since_ns", where), tuple(cards))
    return NodeCommitments(node, pods)


class PodFate(Enum):
    """What the pruning binder knows about a committed pod."""

    BOUND_HERE = "bound to this node"
    BOUND_ELSEWHERE = "bound to another node"
    GONE = "deleted or finished"
    PENDING = "not bound yet"
    UNKNOWN = "not seen"


def stale(commitments: NodeCommitments, fates: Mapping[str, PodFate], now_ns: int, grace_ns: int) -> list[str]:
    """UIDs whose entries can go when the document is rewritten.

    A pod deleted, finished or bound to another node no longer holds these cards. A pod not bound
    here (yet) keeps its entry for ``grace_ns``: its binder may be between the Lease write and the
    Binding, or this binder's watch may lag the other's. After that the bind failed or the record
    on the bound pod (which every binder's cache counts) has taken over.
    """
    out = []
    for uid, c in commitments.pods.items():
        fate = fates.get(uid, PodFate.UNKNOWN)
        if fate in (PodFate.GONE, PodFate.BOUND_ELSEWHERE):
            out.append(uid)
        elif fate is not PodFate.BOUND_HERE and now_ns - c.since_ns >= grace_ns:
            out.append(uid)
    return sorted(out)
