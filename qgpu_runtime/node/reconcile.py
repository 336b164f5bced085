"""Start-up reconciliation: make the store agree with the pods that really exist on the node.

Pure: takes the store's rows, the pods on the node (API) and, where kubelet serves it, the
pod-resources listing, and returns a :class:`Plan`. The manager applies the plan.

Rules (each one a line of the plan, so a log says why a row went):
1. A grant or share whose pod UID is not on the node any more: released (pod deleted).
2. A pod in phase Succeeded or Failed: released (its containers will never run again; a pod whose
   Allocate failed ends in Failed with UnexpectedAdmissionError).
3. With pod-resources: a grant whose pod kubelet lists but whose device IDs kubelet does not hold
   for that container and resource is released (Allocate was recorded but kubelet never took it).
   A grant whose device IDs kubelet lists under another pod/container is moved to that owner.
4. Pods whose served containers are missing from ``qgpu.io/assigned`` get it patched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from qgpu_runtime.contract.names import ASSIGNED, FINISHED_PHASES, phase
from qgpu_runtime.contract.record import assigned
from qgpu_runtime.node.podresources import HeldDevices
from qgpu_runtime.node.store import Grant, Share


@dataclass(frozen=True)
class Plan:
    release_pods: dict[str, str] = field(default_factory=dict)  # pod uid -> reason
    release_grants: dict[tuple[str, str, str], str] = field(default_factory=dict)  # (uid, container, resource) -> reason
    reassign: dict[tuple[str, str, str], tuple[str, str, str]] = field(default_factory=dict)  # grant key -> (ns, pod, container)
    annotate: dict[tuple[str, str], str] = field(default_factory=dict)  # (ns, pod) -> qgpu.io/assigned JSON


def plan(
    grants: Iterable[Grant],
    shares: Iterable[Share],
    pods: Iterable[Mapping[str, Any]],
    held: list[HeldDevices] | None,
) -> Plan:
    by_uid = {str((p.get("metadata") or {}).get("uid", "")): p for p in pods}
    result = Plan()
    grants = list(grants)
    owners = {uid for uid in (g.pod_uid for g in grants)} | {s.workload_id for s in shares}
    for uid in sorted(owners):
        pod = by_uid.get(uid)
        if pod is None:
            result.release_pods[uid] = "pod no longer exists on this node"
            continue
        if phase(pod) in FINISHED_PHASES:
            result.release_pods[uid] = f"pod phase is {phase(pod)}"
    if held is not None:
        listed = {(h.namespace, h.pod) for h in held}
        by_devices = {(h.resource, d): h for h in held for d in h.device_ids}
        for g in grants:
            if g.pod_uid in result.release_pods:
                continue
            key = (g.pod_uid, g.container, g.resource)
            holders = {by_devices.get((g.resource, d)) for d in g.device_ids}
            if None in holders:
                if (g.namespace, g.pod) in listed:
                    result.release_grants[key] = "kubelet holds none or only part of these device IDs for the pod"
                continue
            if len(holders) == 1:
                (h,) = holders
                if (h.namespace, h.pod, h.container) != (g.namespace, g.pod, g.container):
                    result.reassign[key] = (h.namespace, h.pod, h.container)
    served: dict[str, set[str]] = {}
    for g in grants:
        if g.pod_uid not in result.release_pods and (g.pod_uid, g.container, g.resource) not in result.release_grants:
            served.setdefault(g.pod_uid, set()).add(g.container)
    for uid, containers in served.items():
        pod = by_uid[uid]
        have = assigned(pod)
        if not containers <= set(have):
            meta = pod.get("metadata") or {}
            result.annotate[(meta.get("namespace", "default"), meta.get("name", ""))] = json.dumps(sorted(set(have) | containers))
    return result


__all__ = ["ASSIGNED", "Plan", "plan"]
