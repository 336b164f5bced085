"""The allocation record (annotation ``qgpu.io/allocation``): encode a placement, decode it back.

docs/annotations.md is normative; this module is its only implementation, so the extender (writer),
the cache rebuild, the device plugin and `qgpu status` (readers) cannot drift apart.
Pure: the caller supplies the time; nothing here talks to the API.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any, Mapping

from qgpu_runtime.jsondoc import load_json
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, AppClass
from qgpu_runtime.placement.state import CardShare, ContainerPlacement, Placement

ALLOCATION = "qgpu.io/allocation"
BIND_TIME = "qgpu.io/bind-time"
ASSIGNED = "qgpu.io/assigned"
RECORD_VERSION = 1


class RecordError(ValueError):
    """An allocation record that cannot be read; the message names the field, value and rule."""


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
            "version": RECORD_VERSION,
            "node": self.node,
            "policy": self.policy,
            "class": self.klass.value,
            "time": self.time,
            "containers": [
                {"name": c.name, "cards": [
                    {"index": s.index, "uuid": s.uuid, "core_milli": s.core_milli, "memory_mib": s.memory_mib}
                    for s in c.shares]}
                for c in self.containers
            ],
        }
        return json.dumps(doc, separators=(",", ":"))

    def placement(self, cpu_milli: int = 0, memory_mib: int = 0) -> Placement:
        """The engine's view of this record, to book it into a ClusterState."""
        return Placement(self.node, self.containers, self.klass, cpu_milli, memory_mib)


def rfc3339(epoch_ns: int) -> str:
    return datetime.datetime.fromtimestamp(epoch_ns / 1e9, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def record_of(placement: Placement, policy: str, epoch_ns: int) -> AllocationRecord:
    return AllocationRecord(placement.node, policy, placement.klass, rfc3339(epoch_ns), placement.containers)


def record_annotations(record: AllocationRecord, epoch_ns: int) -> dict[str, str]:
    """The annotations one bind writes, in one patch."""
    return {ALLOCATION: record.to_json(), BIND_TIME: str(epoch_ns)}


def _field(doc: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in doc:
        raise RecordError(f"{ALLOCATION}: {where}{name} is missing")
    value = doc[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RecordError(f"{ALLOCATION}: {where}{name}={value!r}: wrong type, expected {getattr(kind, '__name__', kind)}")
    return value


def parse_record(raw: str) -> AllocationRecord:
    """Decode the annotation value; refuses unknown versions and malformed fields by name."""
    doc = load_json(raw, dict, ALLOCATION, RecordError)
    version = doc.get("version")
    if version != RECORD_VERSION:
        raise RecordError(f"{ALLOCATION}: version={version!r}: only version {RECORD_VERSION} is known")
    klass_raw = _field(doc, "class", str, "")
    try:
        klass = AppClass(klass_raw)
    except ValueError:
        raise RecordError(f"{ALLOCATION}: class={klass_raw!r}: must be online, offline or normal") from None
    containers = []
    for i, c in enumerate(_field(doc, "containers", list, "")):
        if not isinstance(c, dict):
            raise RecordError(f"{ALLOCATION}: containers[{i}]={c!r}: must be an object")
        shares = []
        for j, card in enumerate(_field(c, "cards", list, f"containers[{i}].")):
            where = f"containers[{i}].cards[{j}]."
            if not isinstance(card, dict):
                raise RecordError(f"{ALLOCATION}: {where[:-1]}={card!r}: must be an object")
            index = _field(card, "index", int, where)
            core = _field(card, "core_milli", int, where)
            memory = _field(card, "memory_mib", int, where)
            if index < 0 or not 0 <= core <= CORE_MILLI_PER_CARD or memory < 0:
                raise RecordError(f"{ALLOCATION}: {where}index={index}, core_milli={core}, memory_mib={memory}: "
                                  f"index and memory must be >= 0, core_milli within 0..{CORE_MILLI_PER_CARD}")
            shares.append(CardShare(index, str(_field(card, "uuid", str, where)), core, memory))
        exclusive = bool(shares) and all(s.core_milli == CORE_MILLI_PER_CARD for s in shares)
        containers.append(ContainerPlacement(str(_field(c, "name", str, f"containers[{i}].")), tuple(shares), exclusive))
    return AllocationRecord(
        node=_field(doc, "node", str, ""),
        policy=_field(doc, "policy", str, ""),
        klass=klass,
        time=_field(doc, "time", str, ""),
        containers=tuple(containers),
    )
