"""What qgpu keeps of a pod it holds on to past one call: the fields it reads, nothing else.

The extender keeps every unbound pod, the pods kube-scheduler asked it about and, per live pod,
what preemption and the bookings read; a node manager keeps every pod of its node. A pod's owner (a
tenant with ``edit``) decides its size: a pod near etcd's 1.5 MiB object limit, in tens of
thousands of ``env`` entries, tolerations, host aliases or labels, decodes to about 7 times its JSON
(0.9 MiB to 6.4 MiB, tests/kube/test_podslim.py), and a few dozen such pods, which ask no GPU and
which nothing of qgpu judges, held whole, were enough to run the extender (800 Mi) or a node
manager (300 Mi) out of memory.

:func:`kept` keeps, by name (docs/security.md, "What qgpu keeps of a pod"):

- metadata: identity, version, deletion, the labels and the annotations qgpu reads;
- spec: node, scheduler, priority, claims, pod-level resources and overhead, and of each container
  and init container its name, resources and restart policy (a sidecar's);
- status: phase, nominated node and the container and claim statuses (the kubelet writes those).

Labels are kept whole up to :data:`MAX_KEPT_LABELS` entries and :data:`MAX_KEPT_LABEL_CHARS`
characters, since a PodDisruptionBudget's selector may name any key (extender preemption); past
either bound only the label qgpu reads by name (T9k's group) is kept, and budgets see the pod as
carrying that label alone. The annotations kept are those qgpu reads (:data:`KEPT_ANNOTATIONS`).
"""

from __future__ import annotations

from typing import Any, Final, Mapping

from qgpu_runtime.contract.names import ALLOCATION, ALLOCATION_SIGNATURE, ASSIGNED, BIND_TIME, GROUP_LABEL, GROUP_MIN_MEMBER
from qgpu_runtime.model.requests import REQUEST_ANNOTATIONS

TOP_FIELDS: Final = frozenset({"apiVersion", "kind", "metadata", "spec", "status"})
METADATA_FIELDS: Final = frozenset({
    "name", "namespace", "uid", "generateName", "resourceVersion", "creationTimestamp", "deletionTimestamp",
    "labels", "annotations",
})
SPEC_FIELDS: Final = frozenset({
    "nodeName", "schedulerName", "priority", "resourceClaims", "resources", "overhead", "containers", "initContainers",
})
CONTAINER_FIELDS: Final = frozenset({"name", "resources", "restartPolicy"})
CONTAINER_LISTS: Final = ("containers", "initContainers")
STATUS_FIELDS: Final = frozenset({
    "phase", "nominatedNodeName", "containerStatuses", "initContainerStatuses", "resourceClaimStatuses",
})
KEPT_ANNOTATIONS: Final = frozenset({
    *REQUEST_ANNOTATIONS, ALLOCATION, ALLOCATION_SIGNATURE, BIND_TIME, ASSIGNED, GROUP_MIN_MEMBER,
})
"""Every pod annotation a component that keeps pods reads: the request's (model/requests.py), the
allocation record with its signature and bind time, the containers served, a group's size."""
MAX_KEPT_LABELS: Final = 128
MAX_KEPT_LABEL_CHARS: Final = 32 * 1024


def _only(obj: Mapping[str, Any], names: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k in names}


def _labels(labels: Any) -> Any:
    if not isinstance(labels, dict) or len(labels) <= MAX_KEPT_LABELS and \
            sum(len(k) + len(v) for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)) <= MAX_KEPT_LABEL_CHARS:
        return labels
    return {GROUP_LABEL: labels[GROUP_LABEL]} if GROUP_LABEL in labels else {}


def _metadata(meta: dict[str, Any]) -> dict[str, Any]:
    out = _only(meta, METADATA_FIELDS)
    if "labels" in out:
        out["labels"] = _labels(out["labels"])
    notes = out.get("annotations")
    if isinstance(notes, dict):
        out["annotations"] = _only(notes, KEPT_ANNOTATIONS)
    return out


def _spec(spec: dict[str, Any]) -> dict[str, Any]:
    out = _only(spec, SPEC_FIELDS)
    for field in CONTAINER_LISTS:
        containers = out.get(field)
        if isinstance(containers, list):
            out[field] = [_only(c, CONTAINER_FIELDS) if isinstance(c, dict) else c for c in containers]
    return out


def _is_kept(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod`` carries nothing :func:`kept` would drop (a pod kept already)."""
    if pod.keys() - TOP_FIELDS:
        return False
    meta, spec, status = pod.get("metadata"), pod.get("spec"), pod.get("status")
    if isinstance(meta, dict):
        if meta.keys() - METADATA_FIELDS or _labels(meta.get("labels")) is not meta.get("labels"):
            return False
        notes = meta.get("annotations")
        if isinstance(notes, dict) and notes.keys() - KEPT_ANNOTATIONS:
            return False
    if isinstance(status, dict) and status.keys() - STATUS_FIELDS:
        return False
    if isinstance(spec, dict):
        if spec.keys() - SPEC_FIELDS:
            return False
        for field in CONTAINER_LISTS:
            containers = spec.get(field)
            if isinstance(containers, list) and any(isinstance(c, dict) and c.keys() - CONTAINER_FIELDS for c in containers):
                return False
    return True


def kept(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What qgpu keeps of ``pod`` (see the module docstring): a new dict, or ``pod`` itself when it
    carries nothing else (a pod kept already, compared again on every call). ``pod`` is never
    changed, and what is returned is not to be changed either. Fields of the wrong type are kept
    as they are, for the readers' own checks to refuse."""
    if _is_kept(pod):
        return pod if isinstance(pod, dict) else dict(pod)
    out: dict[str, Any] = {k: pod[k] for k in ("apiVersion", "kind") if k in pod}  # the rest of TOP_FIELDS below
    for name, slim in (("metadata", _metadata), ("spec", _spec), ("status", lambda s: _only(s, STATUS_FIELDS))):
        value = pod.get(name)
        if value is not None:
            out[name] = slim(value) if isinstance(value, dict) else value
    return out
