"""FROZEN COPY, for version-skew tests only: the Lease documents' codecs as qgpu wrote and read them
before issue 24 moved them into contract/leases.py.

Node commitments (placement/commitments.py: the document, its decoder with the inventory's bounds,
pruning by the pruning binder's own clock), the claim-quota ledger (webhook/ledger.py: the document
and expiry by the reader's own clock) and the two Lease names (extender/commitments.py,
webhook/quota.py), as of commit 0ec0e40: verbatim apart from this docstring, imports inlined and the
parts that need other modules (Placement, Usage, the fit check) left out. A rolling upgrade runs them
beside the current codecs. Never import this from qgpu_runtime; never "fix" it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Collection, Final, Iterable, Mapping

COMMITMENTS = "qgpu.io/commitments"
COMMITMENTS_LEASE_PREFIX = "qgpu-node."
CLAIM_QUOTA_LEASE_PREFIX = "qgpu-claim-quota."
CORE_MILLI_PER_CARD = 1000
MAX_CARDS = 16
MAX_INDEX = 255
MAX_MEMORY_MIB = 1 << 20
LEASE_PREFIX = COMMITMENTS_LEASE_PREFIX
MAX_NAME = 253
_KIND = {dict: "object", list: "list"}


def load_json(raw: bytes | str, kind: type, what: str, error: Callable[[str], Exception]) -> Any:
    try:
        doc = json.loads(raw)
    except (TypeError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise error(f"{what} is not JSON ({exc})") from exc
    if not isinstance(doc, kind):
        raise error(f"{what} is a JSON {_KIND.get(type(doc), type(doc).__name__)}: must be a JSON {_KIND[kind]}")
    return doc


# --- extender/commitments.py, webhook/quota.py: the Lease names ----------------------------------

def lease_name(node: str) -> str:
    """``qgpu-node.<node>``; a node name too long for the prefix is replaced by its digest."""
    name = LEASE_PREFIX + node
    if len(name) <= MAX_NAME:
        return name
    return LEASE_PREFIX + hashlib.sha256(node.encode()).hexdigest()


def ledger_name(namespace: str) -> str:
    return CLAIM_QUOTA_LEASE_PREFIX + namespace  # a namespace name has at most 63 characters


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
            # the inventory's bounds: a number past them would overflow the engine's int64 arrays
            cards.append(CardUse(_int(card, "index", at, 0, MAX_INDEX), _int(card, "core_milli", at, 0, CORE_MILLI_PER_CARD),
                                 _int(card, "memory_mib", at, 0, MAX_MEMORY_MIB), exclusive))
        if len(cards) > MAX_CARDS:
            raise CommitmentError(f"{COMMITMENTS}: {where}cards: {len(cards)} entries: at most {MAX_CARDS}, a node's cards")
        pods[uid] = Commitment(uid, pod, _int(entry, "since_ns", where, 0, 2**63 - 1), tuple(cards))
    return NodeCommitments(node, pods)


class PodFate(Enum):
    """What the pruning binder knows about a committed pod."""

    BOUND_HERE = "bound to this node"
    BOUND_ELSEWHERE = "bound to another node"
    GONE = "deleted or finished"
    PENDING = "not bound yet"
    UNKNOWN = "not seen"


def observed(commitments: NodeCommitments) -> dict[str, tuple[int, tuple[CardUse, ...]]]:
    """What identifies each version of an entry, for :class:`~qgpu_runtime.contract.observed.FirstSeen`:
    an entry written again (new cards, a new stamp) is a new entry."""
    return {uid: (c.since_ns, c.cards) for uid, c in commitments.pods.items()}


def stale(commitments: NodeCommitments, fates: Mapping[str, PodFate], ages_ns: Mapping[str, int | float],
          grace_ns: int) -> list[str]:
    """UIDs whose entries can go when the document is rewritten.

    A pod deleted, finished or bound to another node no longer holds these cards. A pod not bound
    here (yet) keeps its entry until this binder has itself watched the entry for ``grace_ns``
    (``ages_ns``, by its own monotonic clock; an entry with no age was just seen): its binder may be
    between the Lease write and the Binding, or this binder's watch may lag the other's. After that
    the bind failed or the record on the bound pod (which every binder's cache counts) has taken over.
    The entry's ``since_ns`` is its writer's wall clock and decides nothing here: a writer whose clock
    runs ahead would stamp entries nobody ever prunes, one behind entries pruned on sight.
    """
    out = []
    for uid in commitments.pods:
        fate = fates.get(uid, PodFate.UNKNOWN)
        if fate in (PodFate.GONE, PodFate.BOUND_ELSEWHERE):
            out.append(uid)
        elif fate is not PodFate.BOUND_HERE and ages_ns.get(uid, 0) >= grace_ns:
            out.append(uid)
    return sorted(out)


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
