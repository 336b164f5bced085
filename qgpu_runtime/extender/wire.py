"""The kube-scheduler extender wire format (k8s.io/kube-scheduler extender/v1), as plain values.

The Go types carry no JSON tags, so keys are the Go field names (``Pod``, ``NodeNames``,
``FailedNodes``...). Go's decoder matches keys case-insensitively; so does :func:`_get`, so a
hand-written client sending ``nodenames`` is understood the same way the Go side would.
Decoding refuses wrong shapes with a :class:`WireError` naming the field: a client's mistake is a
400, never a 500.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from functools import lru_cache
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any, Mapping, Sequence

import numpy as np

from qgpu_runtime.jsondoc import load_json
from qgpu_runtime.model.podshape import check_pod
from qgpu_runtime.model.quantity import show_value

MIN_PRIORITY = 0
MAX_PRIORITY = 10


class WireError(ValueError):
    """A request body that does not match extender/v1."""


def _get(doc: Mapping[str, Any], name: str) -> Any:
    if name in doc:
        return doc[name]
    lowered = name.lower()
    for key, value in doc.items():
        if isinstance(key, str) and key.lower() == lowered:
            return value
    return None


def _object(raw: bytes | str, what: str) -> dict[str, Any]:
    return load_json(raw, dict, f"{what}: body", WireError)


@dataclass(frozen=True)
class ExtenderArgs:
    """Filter and prioritize input. Exactly one of ``nodes`` (full Node objects, when the
    extender is not nodeCacheCapable) and ``node_names`` (when it is) is set."""

    pod: dict[str, Any]
    nodes: list[dict[str, Any]] | None
    node_names: list[str] | None

    @property
    def names(self) -> list[str]:
        if self.node_names is not None:
            return list(self.node_names)
        return [str((n.get("metadata") or {}).get("name") or "") for n in self.nodes or []]

    @classmethod
    def decode(cls, raw: bytes | str) -> "ExtenderArgs":
        doc = _object(raw, "ExtenderArgs")
        pod = check_pod(_get(doc, "Pod"), "ExtenderArgs.Pod", WireError)
        node_list = _get(doc, "Nodes")
        names = _get(doc, "NodeNames")
        nodes: list[dict[str, Any]] | None = None
        if node_list is not None:
            if not isinstance(node_list, dict):
                raise WireError(f"ExtenderArgs.Nodes: {type(node_list).__name__}: must be a NodeList object")
            items = node_list.get("items") or []
            if not isinstance(items, list) or not all(isinstance(n, dict) and isinstance(n.get("metadata"), dict) for n in items):
                raise WireError("ExtenderArgs.Nodes.items: must be a list of Node objects with metadata")
            for i, item in enumerate(items):
                if not isinstance(item["metadata"].get("name"), str):
                    raise WireError(f"ExtenderArgs.Nodes.items[{i}].metadata.name={show_value(item['metadata'].get('name'))}: must be a string")
            nodes = items
        if names is not None:
            if not isinstance(names, list) or not set(map(type, names)) <= {str}:
                raise WireError("ExtenderArgs.NodeNames: must be a list of strings")
        if nodes is None and names is None:
            raise WireError("ExtenderArgs: neither Nodes nor NodeNames given")
        return cls(pod, nodes, names if nodes is None else None)


@dataclass(frozen=True)
class FilterResult:
    """ExtenderFilterResult: echoes the input form (Nodes or NodeNames) for the passing nodes."""

    passed: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    error: str = ""

    def encode(self, args: ExtenderArgs | None) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "Nodes": None,
            "NodeNames": None,
            "FailedNodes": dict(self.failed),
            "FailedAndUnresolvableNodes": dict(self.unresolvable),
            "Error": self.error,
        }
        if args is not None and args.nodes is not None:
            keep = set(self.passed)
            doc["Nodes"] = {"metadata": {}, "items": [n for n in args.nodes if n["metadata"].get("name") in keep]}
        elif not self.error:
            doc["NodeNames"] = list(self.passed)
        return doc


@lru_cache(maxsize=1 << 16)
def _priority_head(host: str) -> str:
    """``{"Host":"<host>","Score":`` — escaped by the json module's own C encoder, so any name
    comes out exactly as ``json.dumps`` writes it; cached, since the same nodes recur every call."""
    return '{"Host":' + encode_basestring_ascii(host) + ',"Score":'


_PRIORITY_TAIL = tuple(f"{score}}}" for score in range(MIN_PRIORITY, MAX_PRIORITY + 1))


def encode_priorities_json(names: Sequence[str], scores: Sequence[int] | np.ndarray) -> bytes:
    """HostPriorityList (a bare array of {Host, Score}, scores clamped to 0..10) for scores
    aligned with ``names``, straight to JSON bytes; hosts scoring 0 are left out.

    Leaving them out is the same answer: kube-scheduler adds each listed host's score (times the
    extender's weight) to that node's total and adds nothing for a node the list does not name
    (pkg/scheduler/schedule_one.go, prioritizeNodes). With binpack most of a large cluster scores
    0 for any one pod, so the answer for 5,000 names shrinks from 165 kB to the few nodes that
    matter, which kube-scheduler no longer has to decode either (issue 14 §2).

    No per-host dict and no per-host Python frame: cached heads joined with one of eleven
    precomputed tails in C-level maps (5,000 hosts: about 0.6 ms on the dev machine).
    """
    values = np.clip(np.asarray(scores, dtype=np.int64), MIN_PRIORITY, MAX_PRIORITY) - MIN_PRIORITY
    keep = np.flatnonzero(values)
    if len(keep) < len(values):
        names = [names[i] for i in keep.tolist()]
        values = values[keep]
    parts = map(operator.add, map(_priority_head, names), map(_PRIORITY_TAIL.__getitem__, values.tolist()))
    return ("[" + ",".join(parts) + "]").encode()


@dataclass(frozen=True)
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str

    @classmethod
    def decode(cls, raw: bytes | str) -> "BindingArgs":
        doc = _object(raw, "ExtenderBindingArgs")
        values = {}
        for go_name in ("PodName", "PodNamespace", "PodUID", "Node"):
            value = _get(doc, go_name)
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise WireError(f"ExtenderBindingArgs.{go_name}={value!r}: must be a string")
            values[go_name] = value
        for required in ("PodName", "Node"):
            if not values[required]:
                raise WireError(f"ExtenderBindingArgs.{required} is empty")
        return cls(values["PodName"], values["PodNamespace"] or "default", values["PodUID"], values["Node"])


def encode_binding_result(error: str = "") -> dict[str, Any]:
    return {"Error": error}


# Bounds of a preempt body (issue 25): kube-scheduler sends at most its candidate nodes (10 % of the
# cluster, at least 100, by default) and the lower-priority pods of each; a node holds at most a
# few hundred pods (kubelet's maxPods).
MAX_PREEMPT_NODES = 5000
MAX_VICTIMS_PER_NODE = 1000


@dataclass(frozen=True)
class NodeVictims:
    """One node's victims as pod UIDs (extender/v1 MetaVictims), with kube-scheduler's count of the
    PodDisruptionBudgets their eviction would violate."""

    uids: tuple[str, ...]
    pdb_violations: int = 0

    def encode(self) -> dict[str, Any]:
        return {"Pods": [{"UID": uid} for uid in self.uids], "NumPDBViolations": self.pdb_violations}


def _victims(node: str, value: Any, where: str, meta: bool) -> NodeVictims:
    if value is None:
        return NodeVictims(())
    if not isinstance(value, dict):
        raise WireError(f"{where}[{node!r}]: {type(value).__name__}: must be an object with Pods and NumPDBViolations")
    pods = _get(value, "Pods") or []
    if not isinstance(pods, list):
        raise WireError(f"{where}[{node!r}].Pods: {type(pods).__name__}: must be a list")
    if len(pods) > MAX_VICTIMS_PER_NODE:
        raise WireError(f"{where}[{node!r}].Pods: {len(pods)} pods: at most {MAX_VICTIMS_PER_NODE} per node")
    uids = []
    for i, item in enumerate(pods):
        if meta:
            uid = _get(item, "UID") if isinstance(item, dict) else None
        else:
            metadata = item.get("metadata") if isinstance(item, dict) else None
            uid = metadata.get("uid") if isinstance(metadata, dict) else None
        if not isinstance(uid, str) or not uid:
            field_name = "UID" if meta else "metadata.uid"
            raise WireError(f"{where}[{node!r}].Pods[{i}].{field_name}={show_value(uid)}: must be a non-empty string")
        uids.append(uid)
    violations = _get(value, "NumPDBViolations")
    if violations is None:
        violations = 0
    if not isinstance(violations, int) or isinstance(violations, bool) or not 0 <= violations <= len(pods):
        raise WireError(f"{where}[{node!r}].NumPDBViolations={show_value(violations)}: "
                        f"must be an integer from 0 to the number of pods ({len(pods)})")
    return NodeVictims(tuple(uids), violations)


@dataclass(frozen=True)
class PreemptionArgs:
    """ExtenderPreemptionArgs: the preemptor and, per candidate node, the victims kube-scheduler's
    own dry run chose there; full pods (``NodeNameToVictims``) or UIDs (``NodeNameToMetaVictims``,
    sent to a nodeCacheCapable extender) are both understood, as UIDs."""

    pod: dict[str, Any]
    victims: dict[str, NodeVictims]

    @classmethod
    def decode(cls, raw: bytes | str) -> "PreemptionArgs":
        doc = _object(raw, "ExtenderPreemptionArgs")
        pod = check_pod(_get(doc, "Pod"), "ExtenderPreemptionArgs.Pod", WireError)
        meta = _get(doc, "NodeNameToMetaVictims")
        full = _get(doc, "NodeNameToVictims")
        if meta is None and full is None:
            raise WireError("ExtenderPreemptionArgs: neither NodeNameToVictims nor NodeNameToMetaVictims given")
        where = "ExtenderPreemptionArgs.NodeNameToMetaVictims" if meta is not None else "ExtenderPreemptionArgs.NodeNameToVictims"
        by_node = meta if meta is not None else full
        if not isinstance(by_node, dict):
            raise WireError(f"{where}: {type(by_node).__name__}: must be an object keyed by node name")
        if len(by_node) > MAX_PREEMPT_NODES:
            raise WireError(f"{where}: {len(by_node)} nodes: at most {MAX_PREEMPT_NODES}")
        return cls(pod, {str(node): _victims(str(node), value, where, meta is not None) for node, value in by_node.items()})


def encode_preemption_result(victims: Mapping[str, NodeVictims]) -> dict[str, Any]:
    """ExtenderPreemptionResult: the extender always answers in the meta (UID) form."""
    return {"NodeNameToMetaVictims": {node: v.encode() for node, v in victims.items()}}
