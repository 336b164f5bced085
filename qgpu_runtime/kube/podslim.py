"""What qgpu keeps of a pod it holds on to past one call: the fields it reads, nothing else.

The extender keeps every unbound pod, the pods kube-scheduler asked it about and, per live pod,
what preemption and the bookings read; a node manager keeps every pod of its node. A pod's owner (a
tenant with ``edit``) decides its size: a pod near etcd's 1.5 MiB object limit, in tens of
thousands of ``env`` entries, tolerations, host aliases, labels or extended resource names,
decodes to about 7 times its JSON (0.9 MiB to 6.4 MiB, tests/kube/test_podslim.py), and a few dozen
such pods, which ask no GPU and which nothing of qgpu judges, held whole, were enough to run the
extender (800 Mi) or a node manager (300 Mi) out of memory.

:func:`kept` keeps, by name (docs/security.md, "What qgpu keeps of a pod"):

- metadata: identity, version, deletion, the labels and the annotations qgpu reads, and the
  ``Node`` entries of ``ownerReferences`` (with ``kubernetes.io/config.mirror``, what marks a
  mirror pod);
- spec: node, scheduler, priority, claims, pod-level resources and overhead, and of each container
  and init container its name, resources and restart policy (a sidecar's);
- status: phase, nominated node and the container and claim statuses (the kubelet writes those).

Of every ``resources`` (a container's, an init container's, the pod's) and of ``overhead`` only the
names a reader reads are kept: ``cpu`` and ``memory`` (node fit) and the GPU names of every dialect
the request parser knows (``model/requests.py`` ``GPU_RESOURCES`` and the qGPU prefix). A name of
the qGPU prefix the parser does not know is an error it reports: the first
:data:`MAX_KEPT_UNKNOWN_QGPU_NAMES` of a container's, in the parser's (sorted) order, are kept, so a
pod that asks for one is refused from the kept form as from the whole. Any other resource name (a
tenant's ``1a/r`` of tens of thousands, ``ephemeral-storage``, hugepages) asks nothing qgpu
places or charges and is read by none of its readers. A container's ``resources.claims`` keeps
``name`` and ``request`` of each entry, up to :data:`MAX_KEPT_CLAIM_REFS` entries; past that one
entry per claim name without its request (the whole claim: a reader links the container to every
row of the claim, never to fewer). Of each entry of ``spec.resourceClaims``, of the claim and
container statuses, only the fields read are kept.

Labels are kept whole up to :data:`MAX_KEPT_LABELS` entries and :data:`MAX_KEPT_LABEL_CHARS`
characters, since a PodDisruptionBudget's selector may name any key (extender preemption); past
either bound only the label qgpu reads by name (T9k's group) is kept, and budgets see the pod as
carrying that label alone. The annotations kept are those qgpu reads (:data:`KEPT_ANNOTATIONS`).

Each part is reduced by a function that returns its argument itself when it carries nothing to
drop, so a pod kept already is returned as it is (compared, not copied, on every call).

That bounds each entry of a pod, not how many there are: kube-apiserver (v1.37.2) bounds the
number of containers, init containers and ``spec.resourceClaims`` entries only by the object's size
(it took 40,000 claim entries, 2.1 MB of JSON, kept whole as 11.7 MiB, and 10,000 containers asking
``cpu: 1m``, 6.4 MiB), and each of them is read. So the kept form has a budget,
:data:`MAX_KEPT_POD_ENTRIES` entries of the spec (each container, init container and claim entry,
and each resource name and claim reference kept of a container) and as many of the status (each
container and claim status). A pod past either is kept *oversized*: metadata as above; of the spec
its node, scheduler and priority and, in place of everything counted, its node-fit CPU and memory
as pod-level ``resources.requests`` (:func:`~qgpu_runtime.model.requests.pod_compute` reads the
same); of the status its phase and nominated node; and under :data:`OVERSIZED` (a top-level key no
Pod of the apiserver carries) the list that weighs most, its length, the part's entries and the GPU
resource names its containers list. :func:`oversized` reads it, of a kept pod or a whole one.
Every reader treats such a pod as one it cannot see into (docs/security.md, "What qgpu keeps of a
pod"): the extender places none (filter refuses it, naming the pod, the list, its length and the
budget) and has no opinion on it (prioritize, preempt, dra-prioritize), while a bound one's signed
record still books its cards with that CPU and memory; the node manager grants it no device
(Allocate refuses it, and one that lists a GPU resource without a record is a stranger to every
call of that resource), and enforces the shares of the claims reserved for it on all of its
containers together (node/tenants.py ``WHOLE_POD``).
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass
from typing import Any, Callable, Final, Mapping

from qgpu_runtime.contract.names import (
    ALLOCATION,
    ALLOCATION_SIGNATURE,
    ASSIGNED,
    BIND_TIME,
    GROUP_LABEL,
    GROUP_MIN_MEMBER,
    MIRROR_POD,
)
from qgpu_runtime.model.requests import GPU_RESOURCES, QGPU_PREFIX, REQUEST_ANNOTATIONS, pod_compute

OVERSIZED: Final = "qgpu.io/oversized"
"""The top-level key of a pod kept oversized (past :data:`MAX_KEPT_POD_ENTRIES`): no Pod the
apiserver returns carries it (its fields are ``apiVersion``, ``kind``, ``metadata``, ``spec`` and
``status``), and :func:`kept` honours it only on a pod that lists nothing it counts."""
TOP_FIELDS: Final = frozenset({"apiVersion", "kind", "metadata", "spec", "status", OVERSIZED})
METADATA_FIELDS: Final = frozenset({
    "name", "namespace", "uid", "generateName", "resourceVersion", "creationTimestamp", "deletionTimestamp",
    "labels", "annotations", "ownerReferences",
})
SPEC_FIELDS: Final = frozenset({
    "nodeName", "schedulerName", "priority", "resourceClaims", "resources", "overhead", "containers", "initContainers",
})
CONTAINER_FIELDS: Final = frozenset({"name", "resources", "restartPolicy"})
CONTAINER_LISTS: Final = ("containers", "initContainers")
STATUS_FIELDS: Final = frozenset({
    "phase", "nominatedNodeName", "containerStatuses", "initContainerStatuses", "resourceClaimStatuses",
})
MIRROR_ANNOTATION: Final = MIRROR_POD
"""What the kubelet writes on the mirror pod of a static pod (the pod's config hash)."""
KEPT_ANNOTATIONS: Final = frozenset({
    *REQUEST_ANNOTATIONS, ALLOCATION, ALLOCATION_SIGNATURE, BIND_TIME, ASSIGNED, GROUP_MIN_MEMBER, MIRROR_ANNOTATION,
})
"""Every pod annotation a component that keeps pods reads: the request's (model/requests.py), the
allocation record with its signature and bind time, the containers served, a group's size, and
whether the pod is a static pod's mirror."""
MAX_MIRROR_VALUE_CHARS: Final = 64
"""The kubelet's mirror annotation is a 32-digit hash; a longer value (a tenant's, up to the
apiserver's 256 KiB) is kept as "": the annotation is read by its presence."""
MAX_KEPT_LABELS: Final = 128
MAX_KEPT_LABEL_CHARS: Final = 32 * 1024

COMPUTE_RESOURCES: Final = frozenset({"cpu", "memory"})
"""The resources node fit reads (model/requests.py ``_pod_compute``), of containers, the pod and its
overhead; the pod's own ``resources`` and ``overhead`` name no others qgpu reads."""
READ_RESOURCES: Final = COMPUTE_RESOURCES | GPU_RESOURCES
"""Every resource name a reader of a kept pod reads (besides unknown ones of the qGPU prefix)."""
RESOURCES_FIELDS: Final = frozenset({"limits", "requests", "claims"})
POD_RESOURCES_FIELDS: Final = frozenset({"limits", "requests"})
MAX_KEPT_UNKNOWN_QGPU_NAMES: Final = 8
CLAIM_REF_FIELDS: Final = frozenset({"name", "request"})
MAX_KEPT_CLAIM_REFS: Final = 32
MAX_CLAIM_NAME_CHARS: Final = 63
"""A claim entry's name and a request's name are DNS labels (the apiserver refuses longer)."""
POD_CLAIM_FIELDS: Final = frozenset({"name", "resourceClaimName", "resourceClaimTemplateName"})
CLAIM_STATUS_FIELDS: Final = frozenset({"name", "resourceClaimName"})
CONTAINER_STATUS_FIELDS: Final = frozenset({"name", "containerID"})
"""What node/metrics.py and node/containers.py read of a container's status: which container a
runtime ID is (not its state, image, resources or termination message)."""
COUNTED_SPEC: Final = ("containers", "initContainers", "resourceClaims")
COUNTED_STATUS: Final = ("containerStatuses", "initContainerStatuses", "resourceClaimStatuses")
MAX_KEPT_POD_ENTRIES: Final = 512
"""The entries of one pod's spec kept (each container, init container and ``spec.resourceClaims``
entry, and of each container every resource name and claim reference kept), and as many of its
status (each container, init container and claim status). A container asking CPU, memory and a
GPU in limits and requests weighs 7: a pod of 70 such containers fits, where real pods have a few
(a Tekton task's steps a few dozen). Past it the pod is kept oversized (module docstring): at the
budget a pod's kept form is at most ~300 KiB of spec (512 claim entries of the longest names the
apiserver accepts) and ~220 KiB of status, against 8.8 MiB for 30,000 claim entries kept whole.
A pod's status has no more entries than its spec (the kubelet writes one per container, the
resourceclaim controller one per claim), so a pod kept whole at creation stays so."""
_COUNTED_FIELDS: Final = frozenset({*(f"spec.{n}" for n in COUNTED_SPEC), *(f"status.{n}" for n in COUNTED_STATUS)})
OWNER_FIELDS: Final = frozenset({"apiVersion", "kind", "name", "uid", "controller", "blockOwnerDeletion"})
MAX_KEPT_NODE_OWNERS: Final = 2
"""A mirror pod has exactly one owner, its Node: two are kept, so "more than one" stays visible."""
MAX_OWNER_FIELD_CHARS: Final = 253  # a Node's name is a DNS subdomain


def _only(obj: Mapping[str, Any], names: frozenset[str]) -> Any:
    """``obj`` itself when it carries no key but ``names``, else a new dict of those keys."""
    if obj.keys() <= names:
        return obj
    return {k: v for k, v in obj.items() if k in names}


def _same(out: list[Any], items: list[Any]) -> list[Any]:
    """``items`` itself when ``out`` holds exactly its elements, else ``out``."""
    return items if len(out) == len(items) and all(map(operator.is_, out, items)) else out


def _each(items: Any, reduce: Callable[[Any], Any]) -> Any:
    """``items`` with each dict reduced, or ``items`` itself when no dict changed (or not a list)."""
    if not isinstance(items, list):
        return items
    return _same([reduce(i) if isinstance(i, dict) else i for i in items], items)


def _parts(obj: dict[str, Any], fields: frozenset[str], parts: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    """``obj`` of ``fields``, each of ``parts`` reduced; ``obj`` itself when nothing changed."""
    out = _only(obj, fields)
    changed = {name: value for name, reduce in parts.items() if name in out
               for value in [reduce(out[name])] if value is not out[name]}
    return {**out, **changed} if changed else out


def _labels(labels: Any) -> Any:
    if not isinstance(labels, dict) or len(labels) <= MAX_KEPT_LABELS and \
            sum(len(k) + len(v) for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)) <= MAX_KEPT_LABEL_CHARS:
        return labels
    return {GROUP_LABEL: labels[GROUP_LABEL]} if GROUP_LABEL in labels else {}


def _annotations(notes: Any) -> Any:
    if not isinstance(notes, dict):
        return notes
    out = _only(notes, KEPT_ANNOTATIONS)
    mirror = out.get(MIRROR_ANNOTATION)
    if isinstance(mirror, str) and len(mirror) > MAX_MIRROR_VALUE_CHARS:
        out = {**out, MIRROR_ANNOTATION: ""}
    return out


def _is_node_owner(ref: Any) -> bool:
    return isinstance(ref, dict) and ref.get("kind") == "Node" and all(
        not isinstance(v, str) or len(v) <= MAX_OWNER_FIELD_CHARS for k, v in ref.items() if k in OWNER_FIELDS)


def _owners(refs: Any) -> Any:
    """The ``Node`` entries of ``ownerReferences`` (at most :data:`MAX_KEPT_NODE_OWNERS`), each of
    the reference's own fields; ``None`` when there is none."""
    if not isinstance(refs, list):
        return refs
    nodes = [r for r in refs if _is_node_owner(r)][:MAX_KEPT_NODE_OWNERS]
    if not nodes:
        return None
    return _same(_each(nodes, lambda r: _only(r, OWNER_FIELDS)), refs)


_METADATA_PARTS: Final[dict[str, Callable[[Any], Any]]] = {
    "labels": _labels, "annotations": _annotations, "ownerReferences": _owners,
}


def _metadata(meta: dict[str, Any]) -> dict[str, Any]:
    out = _parts(meta, METADATA_FIELDS, _METADATA_PARTS)
    if out.get("ownerReferences", ()) is None:  # no Node among them: none kept
        out = {k: v for k, v in out.items() if k != "ownerReferences"}
    return out


def _resource_names(*sides: Any) -> Callable[[Any], bool]:
    """Which names of these ``limits``/``requests`` maps are kept: those read, and the first
    :data:`MAX_KEPT_UNKNOWN_QGPU_NAMES` unknown qGPU names of both sides together, in sorted
    order (the order the parser reports them in)."""
    unknown = {k for side in sides if isinstance(side, dict) for k in side
               if isinstance(k, str) and k.startswith(QGPU_PREFIX) and k not in GPU_RESOURCES}
    if len(unknown) > MAX_KEPT_UNKNOWN_QGPU_NAMES:
        unknown = set(heapq.nsmallest(MAX_KEPT_UNKNOWN_QGPU_NAMES, unknown))
    return lambda name: name in READ_RESOURCES or name in unknown


def _named(values: Any, keep: Callable[[Any], bool]) -> Any:
    if not isinstance(values, dict) or all(map(keep, values)):
        return values
    return {k: v for k, v in values.items() if keep(k)}


def _claim_refs(refs: Any) -> Any:
    """A container's ``resources.claims``: each entry's ``name`` and ``request`` (an entry naming
    more than a DNS label names nothing the apiserver accepts, and is dropped); past
    :data:`MAX_KEPT_CLAIM_REFS` entries, one per claim name, without its request."""
    if not isinstance(refs, list):
        return refs

    def fits(ref: Any) -> bool:
        return not isinstance(ref, dict) or all(
            not isinstance(ref.get(k), str) or len(ref[k]) <= MAX_CLAIM_NAME_CHARS for k in CLAIM_REF_FIELDS)

    kept_refs = [r for r in refs if fits(r)]
    if len(kept_refs) > MAX_KEPT_CLAIM_REFS:  # the whole of each claim named (an entry of another type dropped)
        whole = [{"name": n} for n in dict.fromkeys(r["name"] for r in kept_refs if isinstance(r, dict) and isinstance(r.get("name"), str))]
        return refs if whole == refs else whole
    return _same(_each(kept_refs, lambda r: _only(r, CLAIM_REF_FIELDS)), refs)


def _container_resources(resources: Any) -> Any:
    if not isinstance(resources, dict):
        return resources
    limits, requests = resources.get("limits"), resources.get("requests")
    parts: dict[str, Callable[[Any], Any]] = {"claims": _claim_refs}
    if not all(not isinstance(side, dict) or side.keys() <= READ_RESOURCES for side in (limits, requests)):
        keep = _resource_names(limits, requests)
        parts.update(limits=lambda v: _named(v, keep), requests=lambda v: _named(v, keep))
    return _parts(resources, RESOURCES_FIELDS, parts)


def _compute_only(values: Any) -> Any:
    return _named(values, COMPUTE_RESOURCES.__contains__)


def _pod_resources(resources: Any) -> Any:
    if not isinstance(resources, dict):
        return resources
    return _parts(resources, POD_RESOURCES_FIELDS, {"limits": _compute_only, "requests": _compute_only})


def _container(container: dict[str, Any]) -> dict[str, Any]:
    return _parts(container, CONTAINER_FIELDS, {"resources": _container_resources})


_SPEC_PARTS: Final[dict[str, Callable[[Any], Any]]] = {
    **{field: lambda v: _each(v, _container) for field in CONTAINER_LISTS},
    "resources": _pod_resources,
    "overhead": _compute_only,
    "resourceClaims": lambda v: _each(v, lambda c: _only(c, POD_CLAIM_FIELDS)),
}
_STATUS_PARTS: Final[dict[str, Callable[[Any], Any]]] = {
    "containerStatuses": lambda v: _each(v, lambda s: _only(s, CONTAINER_STATUS_FIELDS)),
    "initContainerStatuses": lambda v: _each(v, lambda s: _only(s, CONTAINER_STATUS_FIELDS)),
    "resourceClaimStatuses": lambda v: _each(v, lambda s: _only(s, CLAIM_STATUS_FIELDS)),
}


def _spec(spec: dict[str, Any]) -> dict[str, Any]:
    return _parts(spec, SPEC_FIELDS, _SPEC_PARTS)


def _status(status: dict[str, Any]) -> dict[str, Any]:
    return _parts(status, STATUS_FIELDS, _STATUS_PARTS)


@dataclass(frozen=True)
class Oversize:
    """Why a pod is kept oversized: ``field`` (``spec.resourceClaims``, ``status.containerStatuses``
    ...) is the list of the part past the budget that weighs most, ``count`` its length,
    ``entries`` the part's entries in all; ``gpu_resources`` the GPU resource names (of
    ``GPU_RESOURCES``) its containers and init containers list, in limits or requests."""

    field: str
    count: int
    entries: int
    gpu_resources: tuple[str, ...] = ()

    @property
    def part(self) -> str:
        return self.field.split(".", 1)[0]

    def describe(self) -> str:
        """The facts, for a refusal that names the pod before them and says what follows."""
        return (f"{self.count} {self.field} ({self.entries} entries of its {self.part} in all, counting each "
                f"container's resource names and claim references), past the {MAX_KEPT_POD_ENTRIES} entries qgpu "
                f"keeps of one pod's {self.part} (kube/podslim.py MAX_KEPT_POD_ENTRIES)")

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "count": self.count, "entries": self.entries, "gpuResources": list(self.gpu_resources)}

    @classmethod
    def of_json(cls, doc: Any) -> "Oversize | None":
        """The marker as :meth:`to_json` writes it; None for anything else (not ours)."""
        if not isinstance(doc, dict) or doc.keys() != {"field", "count", "entries", "gpuResources"}:
            return None
        field, count, entries, names = doc["field"], doc["count"], doc["entries"], doc["gpuResources"]
        if not (field in _COUNTED_FIELDS and type(count) is int and type(entries) is int and isinstance(names, list)
                and all(isinstance(n, str) and n in GPU_RESOURCES for n in names)):
            return None
        return cls(field, count, entries, tuple(names))


def _weight(item: Any) -> int:
    """A kept container's entries: itself, each resource name of its limits and requests, and each
    claim reference (of a claim or status entry, or a value of the wrong type: 1)."""
    resources = item.get("resources") if type(item) is dict else None
    if type(resources) is not dict:
        return 1
    weight = 1
    for side in ("limits", "requests", "claims"):
        value = resources.get(side)
        if type(value) is dict or type(value) is list:
            weight += len(value)
    return weight


def _weights(part: Any, lists: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Each counted list of the part by name: (its entries, its length)."""
    out = {}
    if type(part) is dict:
        for name in lists:
            items = part.get(name)
            if type(items) is list:
                out[name] = (sum(map(_weight, items)) if name in CONTAINER_LISTS else len(items), len(items))
    return out


def _gpu_names(spec: Mapping[str, Any]) -> tuple[str, ...]:
    names: set[str] = set()
    for field in CONTAINER_LISTS:
        items = spec.get(field)
        for c in items if isinstance(items, list) else ():
            resources = c.get("resources") if isinstance(c, dict) else None
            if isinstance(resources, dict):
                for side in ("limits", "requests"):
                    values = resources.get(side)
                    if isinstance(values, dict):
                        names.update(k for k in values if k in GPU_RESOURCES)
    return tuple(sorted(names))


def _oversize(slim: Mapping[str, Any]) -> Oversize | None:
    spec, status = slim.get("spec"), slim.get("status")
    for part, lists, prefix in ((spec, COUNTED_SPEC, "spec"), (status, COUNTED_STATUS, "status")):
        weights = _weights(part, lists)
        total = sum(w for w, _ in weights.values())
        if total > MAX_KEPT_POD_ENTRIES:
            heaviest = max(weights, key=lambda name: weights[name][0])  # the first of equals, in the lists' order
            return Oversize(f"{prefix}.{heaviest}", weights[heaviest][1], total,
                            _gpu_names(spec) if isinstance(spec, dict) else ())
    return None


def _lists_any(slim: Mapping[str, Any]) -> bool:
    """Whether the pod lists anything :data:`MAX_KEPT_POD_ENTRIES` counts (or an ``overhead``,
    which an oversized form folds into its pod-level requests)."""
    spec, status = slim.get("spec"), slim.get("status")
    return (isinstance(spec, dict) and any(k in spec for k in (*COUNTED_SPEC, "overhead"))) or \
        (isinstance(status, dict) and any(k in status for k in COUNTED_STATUS))


_OVERSIZED_SPEC: Final = ("nodeName", "schedulerName", "priority")
_OVERSIZED_STATUS: Final = ("phase", "nominatedNodeName")


def _reduced(slim: dict[str, Any], over: Oversize) -> dict[str, Any]:
    """The oversized form of a kept pod (module docstring)."""
    spec, status = slim.get("spec"), slim.get("status")
    milli, mib = pod_compute(slim)
    out: dict[str, Any] = {k: v for k, v in slim.items() if k in ("apiVersion", "kind", "metadata")}
    out["spec"] = {**{k: spec[k] for k in _OVERSIZED_SPEC if isinstance(spec, dict) and k in spec},
                   "resources": {"requests": {"cpu": f"{milli}m", "memory": f"{mib}Mi"}}}
    if isinstance(status, dict):
        out["status"] = {k: status[k] for k in _OVERSIZED_STATUS if k in status}
    out[OVERSIZED] = over.to_json()
    return out


def kept(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What qgpu keeps of ``pod`` (see the module docstring): a new dict, or ``pod`` itself when it
    carries nothing else (a pod kept already, compared again on every call). ``pod`` is never
    changed, and what is returned is not to be changed either: it shares with ``pod`` every part
    that had nothing to drop. Fields of the wrong type are kept as they are, for the readers' own
    checks to refuse. A pod past :data:`MAX_KEPT_POD_ENTRIES` is kept oversized."""
    out: dict[str, Any] = _only(pod, TOP_FIELDS)
    changed = {}
    for name, slim in (("metadata", _metadata), ("spec", _spec), ("status", _status)):
        value = out.get(name)
        if isinstance(value, dict):
            reduced = slim(value)
            if reduced is not value:
                changed[name] = reduced
    if changed:
        out = {**out, **changed}
    if OVERSIZED in out and (_lists_any(out) or Oversize.of_json(out[OVERSIZED]) is None):
        out = {k: v for k, v in out.items() if k != OVERSIZED}  # not an oversized form of ours
    over = _oversize(out)
    if over is not None:
        return _reduced(out, over)
    return out if isinstance(out, dict) else dict(out)


def oversized(pod: Mapping[str, Any]) -> Oversize | None:
    """Why ``pod`` (kept or whole) is kept oversized, or None when it is kept whole."""
    return Oversize.of_json(kept(pod).get(OVERSIZED))
