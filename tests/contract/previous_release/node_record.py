"""FROZEN COPY, for version-skew tests only: the readers of qgpu 0.1.0 (commit 959444c).

The node manager of that release read allocation records with node/record.py (below, verbatim
apart from this docstring) and the extender read node inventories with kube/nodes.py
parse_cards. A rolling upgrade runs them beside the current writers, so the tests feed them what
the current code writes. Never import this from qgpu_runtime; never "fix" it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

ALLOCATION = "qgpu.io/allocation"
BIND_TIME = "qgpu.io/bind-time"
ASSIGNED = "qgpu.io/assigned"
KNOWN_VERSIONS = (1,)


@dataclass(frozen=True)
class CardShareRecord:
    index: int
    uuid: str
    core_milli: int
    memory_mib: int


@dataclass(frozen=True)
class ContainerRecord:
    name: str
    cards: tuple[CardShareRecord, ...]


@dataclass(frozen=True)
class AllocationRecord:
    node: str
    policy: str
    klass: str
    containers: tuple[ContainerRecord, ...]

    def container(self, name: str) -> ContainerRecord | None:
        return next((c for c in self.containers if c.name == name), None)


class RecordError(ValueError):
    """The record is missing a field or has one of the wrong type; the message names it."""


def parse_record(raw: str) -> AllocationRecord:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RecordError(f"{ALLOCATION}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise RecordError(f"{ALLOCATION}: must be a JSON object, got {type(data).__name__}")
    if data.get("version") not in KNOWN_VERSIONS:
        raise RecordError(f"{ALLOCATION}: version {data.get('version')!r} is unknown; this qgpu reads {KNOWN_VERSIONS}")
    try:
        containers = tuple(
            ContainerRecord(str(c["name"]), tuple(
                CardShareRecord(int(s["index"]), str(s["uuid"]), int(s["core_milli"]), int(s["memory_mib"]))
                for s in c["cards"]))
            for c in data["containers"])
        return AllocationRecord(str(data["node"]), str(data.get("policy", "")), str(data.get("class", "normal")), containers)
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"{ALLOCATION}: field {exc} missing or malformed") from exc


def annotations(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def assigned(pod: Mapping[str, Any]) -> list[str]:
    """Container names the device plugin already served (annotation ``qgpu.io/assigned``)."""
    raw = annotations(pod).get(ASSIGNED)
    if not raw:
        return []
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def bind_time(pod: Mapping[str, Any]) -> int | None:
    raw = annotations(pod).get(BIND_TIME)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None
