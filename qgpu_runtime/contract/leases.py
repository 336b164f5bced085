"""The two Lease documents: a node's commitments and a namespace's claim-quota ledger; their names and codecs.

Both are compact JSON in one annotation of a coordination.k8s.io/v1 Lease in qgpu's namespace,
read and written on a resourceVersion (kube/leasedoc.py), by several processes and, during a
rolling upgrade, by two releases at once. The rules of the other formats hold
(contract/record.py): readers ignore fields they do not know and refuse a missing or mistyped
required one, naming it; a change an old reader would misread gets a new version. What a binder or
a webhook does with the entries (fit, pruning, expiry) is theirs: placement/commitments.py,
webhook/ledger.py. Pure: text in, values out.

**Node commitments** (annotation ``qgpu.io/commitments`` of Lease ``qgpu-node.<node>``), written by
every extender that binds onto the node: what each pod bound or being bound there takes of each
card. ``since_ns`` is the writer's wall clock, for people and earlier releases::

    {"version": 1, "node": "gpu-1",
     "pods": {"<pod uid>": {"pod": "ns/name", "since_ns": 1700000000000000000,
                            "cards": [{"index": 0, "core_milli": 300, "memory_mib": 5120, "exclusive": false}]}}}

**Binders** (annotation ``qgpu.io/binders`` of Lease ``qgpu-binders``), written by every extender
that publishes its presence (extender/presence.py): each binder's heartbeat count (any change
of an entry is a heartbeat; readers time entries by their own clock, never by a stamp), the
duration after which its writer counts it gone, and whether it commits its binds now::

    {"version": 1, "binders": {"<identity>": {"beat": 12, "committing": false, "duration_s": 15}}}

**Claim-quota ledger** (annotation ``qgpu.io/claim-reservations`` of Lease
``qgpu-claim-quota.<namespace>``), written by every webhook replica admitting a ResourceClaim there:
what each claim admitted a moment ago asks, until the claim is visible. ``expires`` is the writer's
wall clock plus its TTL, in Unix seconds, for earlier releases::

    {"version": 1, "reservations": {"<claim name>": {"core": 600, "memory": 1024, "expires": 1732000030.5}}}
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Final, Iterable, Mapping, Protocol, Sequence

from qgpu_runtime.contract.inventory import MAX_CARDS, MAX_INDEX, MAX_MEMORY_MIB
from qgpu_runtime.contract.names import BINDERS, CLAIM_QUOTA_LEASE_PREFIX, COMMITMENTS, COMMITMENTS_LEASE_PREFIX
from qgpu_runtime.contract.record import ContainerPlacement
from qgpu_runtime.jsondoc import load_json
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD

# --- Lease names ----------------------------------------------------------------------------------

MAX_NAME: Final = 253


def lease_name(node: str) -> str:
    """``qgpu-node.<node>``; a node name too long for the prefix is replaced by its digest."""
    name = COMMITMENTS_LEASE_PREFIX + node
    if len(name) <= MAX_NAME:
        return name
    return COMMITMENTS_LEASE_PREFIX + hashlib.sha256(node.encode()).hexdigest()


def ledger_name(namespace: str) -> str:
    """``qgpu-claim-quota.<namespace>`` (a namespace name has at most 63 characters)."""
    return CLAIM_QUOTA_LEASE_PREFIX + namespace


# --- node commitments -----------------------------------------------------------------------------

DOCUMENT_VERSION: Final = 1


class CommitmentError(ValueError):
    """A commitment document that cannot be read; the message names the field, value and rule."""


class Containers(Protocol):
    """What a commitment is made of: a placement's containers (placement.state.Placement)."""

    @property
    def containers(self) -> Sequence[ContainerPlacement]: ...


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

    @classmethod
    def of(cls, uid: str, pod: str, placement: Containers, now_ns: int) -> "Commitment":
        """The commitment a placement makes: its shares summed per card."""
        core: dict[int, int] = {}
        memory: dict[int, int] = {}
        exclusive: set[int] = set()
        for container in placement.containers:
            for share in container.shares:
                core[share.index] = core.get(share.index, 0) + share.core_milli
                memory[share.index] = memory.get(share.index, 0) + share.memory_mib
                if container.exclusive:
                    exclusive.add(share.index)
        return cls(uid, pod, now_ns, tuple(CardUse(i, core[i], memory[i], i in exclusive) for i in sorted(core)))


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


# --- binders --------------------------------------------------------------------------------------

BINDERS_VERSION: Final = 1
MAX_BINDERS: Final = 64  # more entries than replicas anyone runs: a document past it is refused, not trusted
MAX_IDENTITY: Final = 253


class BindersError(ValueError):
    """The binders' document cannot be read; the message names the field, value and rule."""


@dataclass(frozen=True)
class BinderEntry:
    """One binder's presence: its heartbeat count, whether it commits its binds, and after how many
    seconds without a change its readers count it gone."""

    beat: int
    committing: bool
    duration_s: int


def parse_binders(raw: str | None) -> dict[str, BinderEntry]:
    """The entries of a binders' document (None or empty: no binder published yet)."""
    if not raw:
        return {}
    doc = load_json(raw, dict, BINDERS, BindersError)
    if doc.get("version") != BINDERS_VERSION:
        raise BindersError(f"{BINDERS}: version={doc.get('version')!r}: only version {BINDERS_VERSION} is known")
    entries = doc.get("binders")
    if not isinstance(entries, dict):
        raise BindersError(f"{BINDERS}: binders={entries!r:.{_SHOWN}}: must be an object keyed by binder identity")
    if len(entries) > MAX_BINDERS:
        raise BindersError(f"{BINDERS}: binders: {len(entries)} entries: at most {MAX_BINDERS}")
    out: dict[str, BinderEntry] = {}
    for identity, entry in entries.items():
        where = f"{BINDERS}: binders[{identity!r:.{_SHOWN}}]"
        if not identity or len(identity) > MAX_IDENTITY or not isinstance(entry, dict):
            raise BindersError(f"{where}={entry!r:.{_SHOWN}}: must be an object under an identity of 1..{MAX_IDENTITY} characters")
        beat, committing, duration = entry.get("beat"), entry.get("committing"), entry.get("duration_s")
        if isinstance(beat, bool) or not isinstance(beat, int) or not 0 <= beat < 2**63:
            raise BindersError(f"{where}.beat={beat!r:.{_SHOWN}}: must be an integer within 0..2^63-1")
        if not isinstance(committing, bool):
            raise BindersError(f"{where}.committing={committing!r:.{_SHOWN}}: must be true or false")
        if isinstance(duration, bool) or not isinstance(duration, int) or not 1 <= duration <= 3600:
            raise BindersError(f"{where}.duration_s={duration!r:.{_SHOWN}}: must be an integer within 1..3600")
        out[identity] = BinderEntry(beat, committing, duration)
    return out


def encode_binders(entries: Mapping[str, BinderEntry]) -> str:
    return json.dumps({"version": BINDERS_VERSION, "binders": {
        identity: {"beat": e.beat, "committing": e.committing, "duration_s": e.duration_s}
        for identity, e in sorted(entries.items())}}, separators=(",", ":"))


# --- claim-quota ledger ---------------------------------------------------------------------------

LEDGER_VERSION: Final = 1
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
    except (ValueError, RecursionError) as exc:
        raise LedgerError(f"ledger {raw!r:.{_SHOWN}} is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("version") != LEDGER_VERSION or not isinstance(doc.get("reservations"), dict):
        raise LedgerError(f"ledger {raw!r:.{_SHOWN}}: must be an object with version {LEDGER_VERSION} and a 'reservations' object")
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
    return json.dumps({"version": LEDGER_VERSION, "reservations": {
        claim: {"core": r.core_milli, "memory": r.memory_mib, "expires": round(r.expires, 3)} for claim, r in sorted(entries.items())}},
        separators=(",", ":"))
