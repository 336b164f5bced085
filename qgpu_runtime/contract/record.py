"""The allocation record (annotation ``qgpu.io/allocation``): encode a placement, decode it back.

docs/annotations.md is normative; this module is its only implementation, so the extender (writer),
the cache rebuild, the device plugin and `qgpu status` (readers) cannot drift apart. Before it was,
the node read records with a laxer parser than the extender's and served records the extender
refused (a core share of 1.5 cards, a string where a number belongs).

Rolling upgrades (docs/annotations.md, "Versions"): during an upgrade an old extender may bind for
a new node manager and the reverse. So a writer writes ``WRITE_VERSION``, the oldest version that
every release in the supported skew reads; a reader accepts every version in ``READ_VERSIONS`` and
ignores fields it does not know (later releases may add optional fields without a new version); a
change that an old reader would misread gets a new version, which writers start writing only one
release after readers learnt it. ``tests/contract/test_rolling_upgrade.py`` holds both directions.

Pure: the caller supplies the time; nothing here talks to the API.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from qgpu_runtime.contract.names import ALLOCATION, ASSIGNED, BIND_TIME
from qgpu_runtime.jsondoc import load_json
from qgpu_runtime.model.quantity import show_value
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, AppClass, ContainerRequest

WRITE_VERSION = 1
READ_VERSIONS = (1,)

__all__ = ["ALLOCATION", "ASSIGNED", "BIND_TIME", "AllocationRecord", "CardShare", "ContainerDialect",
           "ContainerPlacement", "RecordError", "parse_record", "record_annotations", "assigned", "bind_time", "annotations"]


class RecordError(ValueError):
    """An allocation record that cannot be read; the message names the field, value and rule."""


@dataclass(frozen=True)
class CardShare:
    """The part of one card granted to one container."""

    index: int
    uuid: str
    core_milli: int
    memory_mib: int


@dataclass(frozen=True)
class ContainerDialect:
    """How one container asked for its cards: the request dialect (``model.requests.Dialect``'s
    values: qgpu, vcuda, t9k, nvidia, hami, kai) and, for T9k, which of its three requests. Optional
    in the record (docs/annotations.md): the node builds the peers' environment (T9k, HAMi, KAI) from
    it without reading the pod spec again; records of releases before it carry none."""

    dialect: str
    # The percent of each card's memory asked: T9k nvidia-gpu-percent, HAMi gpumem-percentage,
    # KAI gpu-fraction (rounded up to whole percent).
    memory_pct: int | None = None
    whole_node: bool = False  # T9k nvidia-gpu-node

    @classmethod
    def of_request(cls, request: ContainerRequest) -> ContainerDialect:
        return cls(request.dialect.value, request.memory_pct, request.whole_node)

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"dialect": self.dialect}
        if self.memory_pct is not None:
            doc["memory_pct"] = self.memory_pct
        if self.whole_node:
            doc["whole_node"] = True
        return doc


@dataclass(frozen=True)
class ContainerPlacement:
    """One container's cards; ``exclusive`` when it holds every card it names whole.

    ``dialect`` says how the container asked; it is no part of the booking, so two placements of
    the same cards are equal whether or not one of them carries it."""

    name: str
    shares: tuple[CardShare, ...]
    exclusive: bool = False
    dialect: ContainerDialect | None = field(default=None, compare=False)


@dataclass(frozen=True)
class AllocationRecord:
    """What the extender decided for one pod, as stored on the pod."""

    node: str
    policy: str
    klass: AppClass
    time: str
    containers: tuple[ContainerPlacement, ...]

    def to_json(self) -> str:
        doc = {
            "version": WRITE_VERSION,
            "node": self.node,
            "policy": self.policy,
            "class": self.klass.value,
            "time": self.time,
            "containers": [
                {"name": c.name, "cards": [
                    {"index": s.index, "uuid": s.uuid, "core_milli": s.core_milli, "memory_mib": s.memory_mib}
                    for s in c.shares], **(c.dialect.to_doc() if c.dialect is not None else {})}
                for c in self.containers
            ],
        }
        return json.dumps(doc, separators=(",", ":"))

    def container(self, name: str) -> ContainerPlacement | None:
        return next((c for c in self.containers if c.name == name), None)


def rfc3339(epoch_ns: int) -> str:
    return datetime.datetime.fromtimestamp(epoch_ns / 1e9, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def record_annotations(record: AllocationRecord, epoch_ns: int) -> dict[str, str]:
    """The annotations one bind writes, in one patch."""
    return {ALLOCATION: record.to_json(), BIND_TIME: str(epoch_ns)}


def _shown(value: Any) -> str:
    """A record's value in a message, as repr, cut to a readable length: the annotation is up to
    256 KiB of whatever a pod's owner wrote, and a refusal is logged on every event of the pod."""
    return show_value(repr(value))


def _field(doc: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in doc:
        raise RecordError(f"{ALLOCATION}: {where}{name} is missing")
    value = doc[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RecordError(f"{ALLOCATION}: {where}{name}={_shown(value)}: wrong type, expected {getattr(kind, '__name__', kind)}")
    return value


def parse_record(raw: str) -> AllocationRecord:
    """Decode the annotation value; refuses unknown versions and malformed fields by name."""
    doc = load_json(raw, dict, ALLOCATION, RecordError)
    version = doc.get("version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise RecordError(f"{ALLOCATION}: version={_shown(version)}: this qgpu reads versions "
                          f"{', '.join(map(str, READ_VERSIONS))}")
    klass_raw = _field(doc, "class", str, "")
    try:
        klass = AppClass(klass_raw)
    except ValueError:
        raise RecordError(f"{ALLOCATION}: class={_shown(klass_raw)}: must be online, offline or normal") from None
    containers = []
    for i, c in enumerate(_field(doc, "containers", list, "")):
        if not isinstance(c, dict):
            raise RecordError(f"{ALLOCATION}: containers[{i}]={_shown(c)}: must be an object")
        shares = []
        for j, card in enumerate(_field(c, "cards", list, f"containers[{i}].")):
            where = f"containers[{i}].cards[{j}]."
            if not isinstance(card, dict):
                raise RecordError(f"{ALLOCATION}: {where[:-1]}={_shown(card)}: must be an object")
            index = _field(card, "index", int, where)
            core = _field(card, "core_milli", int, where)
            memory = _field(card, "memory_mib", int, where)
            if index < 0 or not 0 <= core <= CORE_MILLI_PER_CARD or memory < 0:
                raise RecordError(f"{ALLOCATION}: {where}index={index}, core_milli={core}, memory_mib={memory}: "
                                  f"index and memory must be >= 0, core_milli within 0..{CORE_MILLI_PER_CARD}")
            shares.append(CardShare(index, str(_field(card, "uuid", str, where)), core, memory))
        exclusive = bool(shares) and all(s.core_milli == CORE_MILLI_PER_CARD for s in shares)
        containers.append(ContainerPlacement(str(_field(c, "name", str, f"containers[{i}].")), tuple(shares), exclusive,
                                             _dialect(c, f"containers[{i}].")))
    return AllocationRecord(
        node=_field(doc, "node", str, ""),
        policy=_field(doc, "policy", str, ""),
        klass=klass,
        time=_field(doc, "time", str, ""),
        containers=tuple(containers),
    )


def _dialect(doc: Mapping[str, Any], where: str) -> ContainerDialect | None:
    """A container's optional ``dialect`` (with ``memory_pct`` and ``whole_node``); None when an
    older extender wrote the record. Present but mistyped is refused like any other field."""
    if "dialect" not in doc:
        return None
    dialect = _field(doc, "dialect", str, where)
    pct = _field(doc, "memory_pct", int, where) if "memory_pct" in doc else None
    if pct is not None and not 0 <= pct <= 100:
        raise RecordError(f"{ALLOCATION}: {where}memory_pct={pct}: must be within 0..100")
    whole = doc.get("whole_node", False)
    if not isinstance(whole, bool):
        raise RecordError(f"{ALLOCATION}: {where}whole_node={_shown(whole)}: wrong type, expected bool")
    return ContainerDialect(dialect, pct, whole)


def annotations(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def assigned(pod: Mapping[str, Any]) -> list[str]:
    """Container names the device plugin already served (annotation ``qgpu.io/assigned``).

    Tolerant on purpose: the annotation is a hint the node manager writes after the fact for
    people and reconciliation, never the source of a grant (the store is), so an unreadable value
    reads as "none served yet" rather than blocking the pod.
    """
    raw = annotations(pod).get(ASSIGNED)
    if not raw:
        return []
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # the pod's owner can write it: '[[[[…' too
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def bind_time(pod: Mapping[str, Any]) -> int | None:
    """Epoch ns of the bind; None when missing or unreadable (such pods are served last)."""
    raw = annotations(pod).get(BIND_TIME)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None
