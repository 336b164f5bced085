"""Which pod and container an Allocate call is for — the rule, in one pure function.

Kubelet's Allocate names devices, never the pod. Kubelet admits one pod at a time and, inside a
pod, allocates containers in spec order and one resource after another for each container. So:

1. Candidates are pods bound to this node (``spec.nodeName``), not terminating, in phase Pending,
   whose ``qgpu.io/allocation`` record names this node, carries the extender's signature for this
   pod (contract/signature.py) and grants no more than the pod's own resources ask for
   (node/deviceplugin/recordcheck.py). A pod's annotations are its owner's to write: a record that fails either
   check grants nothing, and the refusal is reported (``Match.untrusted``, ``NoMatch.untrusted``).
2. A pod's *next* container for resource R is its first container, in spec order, that lists R
   in its limits (or requests) and that the store has not yet served R for. The pod is a candidate
   only if that container asks for exactly as many units of R as kubelet sent device IDs.
3. A container already served another resource (qgpu-memory after qgpu-core) is *in flight*: it is
   the container kubelet is admitting right now, so it wins outright.
4. Otherwise the oldest ``qgpu.io/bind-time`` wins (kubelet receives pods in bind order), then
   namespace/name as a stable tiebreak. Pods without a bind-time sort last.

With several pending pods whose next containers have the same size, rule 4 picks the one bound
first. That is kubelet's admission order unless kubelet received both in one batch and they were
created in the opposite order; PreStartContainer then checks the choice against kubelet's
pod-resources API and corrects the store's owner (see node/deviceplugin/plugin.py).

No candidate → :class:`NoMatch` whose message lists every pod considered and why it was refused;
kubelet shows it to the user as UnexpectedAdmissionError.

5. A pending pod of this node that asks for GPU resources and carries no record was not placed
   through the extender (created with ``spec.nodeName``, which the qgpu_scheduler role's admission
   policy ``qgpu-pod-placed-by-extender`` refuses where it runs). When its next container asks for
   as many units of R as kubelet sent, the call may be for it: granting the candidate's cards then
   hands them to the stranger, and the candidate is refused at its own admission while the card is
   held unisolated. So the call is refused, naming both: nothing is granted on a guess.

A pod kept oversized (kube/podslim.py: past ``MAX_KEPT_POD_ENTRIES``, kept without its
containers) can be matched to no call: with a record it is refused, naming the list, its length and
the budget (the extender places no such pod, so its record is an older release's); without one, a
pod that lists a GPU resource R is, for rule 5, a stranger that may be the subject of every call of
R (its containers' sizes are not kept).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Collection, Iterable, Mapping, Sequence

from qgpu_runtime.contract.names import ALLOCATION, PENDING, phase
from qgpu_runtime.contract.record import (
    AllocationRecord,
    ContainerPlacement,
    RecordError,
    annotations,
    bind_time,
    parse_record,
)
from qgpu_runtime.contract.signature import RecordVerifier, UntrustedRecord, trusted_record
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.kube.podslim import Oversize, oversized
from qgpu_runtime.model.requests import RequestError, asks_gpu_resource, parse_pod, parse_quantity
from qgpu_runtime.node.deviceplugin.recordcheck import SHAPE_LIMITS, record_refusal


@dataclass(frozen=True)
class Match:
    """The container an Allocate is for, with the cards its record grants."""

    namespace: str
    pod: str
    pod_uid: str
    container: str
    record: AllocationRecord
    share: ContainerPlacement
    in_flight: bool
    pod_obj: Mapping[str, Any]
    untrusted: tuple[str, ...] = ()  # other pods' records refused as not qgpu's (signature, shape)

    @property
    def key(self) -> tuple[str, str]:
        return (self.pod_uid, self.container)


class NoMatch(LookupError):
    """No pending pod fits the call; ``str()`` explains, pod by pod."""

    def __init__(self, message: str, untrusted: tuple[str, ...] = (), strangers: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.untrusted = untrusted
        self.strangers = strangers  # UIDs of the pods with no record this refusal was made for (rule 5)


# A plain count of at most this many ASCII digits is read directly; anything else (full-width
# digits, thousands of digits, suffixes) goes through the bounded quantity parser, which refuses
# what the apiserver refuses and never builds a huge integer.
MAX_PLAIN_DIGITS = 18


def container_quantity(container: Mapping[str, Any], resource: str) -> int | None:
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        values = resources.get(section) or {}
        if resource in values:
            raw = values[resource]
            if isinstance(raw, int) and not isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= MAX_PLAIN_DIGITS:
                return int(raw)  # the usual case; skips the general parser on kubelet's hot path
            try:
                q = parse_quantity(raw)
            except ValueError:
                return None
            return int(q) if q == q.to_integral_value() else None
    return None


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return pod.get("metadata") or {}


def _label(pod: Mapping[str, Any]) -> str:
    m = _meta(pod)
    return f"{m.get('namespace', 'default')}/{m.get('name', '?')}"


@dataclass(frozen=True)
class Examined:
    """What one pod is to the matcher, worked out once per version of the pod (node/podwatch.py
    keeps it beside the pod): its record parsed and checked (signature, shape), or why it was refused.

    ``record`` set: a candidate; ``refused``/``untrusted`` set: reported when nothing matches (and
    ``untrusted`` on every Allocate, as the log and the metric want); neither: not a candidate."""

    pod: Mapping[str, Any]
    uid: str
    label: str
    record: AllocationRecord | None = None
    refused: str | None = None
    untrusted: str | None = None
    bind_time: int | None = None
    unrecorded: bool = False  # asks for GPU resources and carries no record (rule 5)
    oversize: Oversize | None = None  # kept without its containers (kube/podslim.py)


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The pod's containers and init containers (kubelet allocates devices for both)."""
    spec = pod.get("spec") or {}
    return [c for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])] if isinstance(c, Mapping)]


def _asks_unserved(e: "Examined", resource: str, device_count: int, served: set[tuple[str, str, str]]) -> bool:
    """Whether a container of the unrecorded pod ``e``, not yet served ``resource``, asks for
    exactly ``device_count`` of it (kubelet allocates init containers as well); of a pod kept
    oversized, whether any of them lists it (their sizes are not kept)."""
    if e.oversize is not None:
        return resource in e.oversize.gpu_resources
    for c in _containers(e.pod):
        if (e.uid, str(c.get("name", "")), resource) not in served \
                and container_quantity(c, resource) == device_count:
            return True
    return False


def examine(pod: Mapping[str, Any], node: str, verifier: RecordVerifier | None, *, cards: Mapping[int, CardInfo]) -> Examined | None:
    """Rule 1 for one pod: None when the pod can never be a candidate (another node, terminating,
    no record, not Pending); otherwise its parsed, verified record or the reason it is refused.

    ``verifier``: the extender's public key. None only where the pods come from a file the host's
    operator writes (``--pods-file``): there no tenant writes annotations and records are not signed.
    ``cards``: this node's cards by index (the node manager's inventory): a percent-of-memory share
    is bounded by the named card's own memory (node/deviceplugin/recordcheck.py).
    """
    meta = _meta(pod)
    spec = pod.get("spec") or {}
    if spec.get("nodeName") != node or meta.get("deletionTimestamp"):
        return None
    if phase(pod) != PENDING:
        return None
    label = _label(pod)
    uid = str(meta.get("uid", ""))
    over = oversized(pod)
    if over is not None:
        if annotations(pod).get(ALLOCATION) is None:
            return Examined(pod, uid, label, unrecorded=True, oversize=over) if over.gpu_resources else None
        return Examined(pod, uid, label, refused=f"{label}: it lists {over.describe()}, so its containers are not "
                                                 "kept and none of them can be matched; nothing is granted to it",
                        oversize=over)
    if annotations(pod).get(ALLOCATION) is None:
        return Examined(pod, uid, label, unrecorded=True) if any(asks_gpu_resource(c) for c in _containers(pod)) else None
    try:
        record = parse_record(annotations(pod)[ALLOCATION]) if verifier is None else trusted_record(pod, verifier)
    except UntrustedRecord as exc:
        return Examined(pod, uid, label, untrusted=f"{label}: {exc}")
    except RecordError as exc:
        return Examined(pod, uid, label, refused=f"{label}: {exc}")
    if record is None:
        return None
    if record.node != node:
        return Examined(pod, uid, label, refused=f"{label}: record is for node {record.node!r}")
    why = _shape_refusal(pod, record, node, cards)
    if why:
        return Examined(pod, uid, label, untrusted=f"{label}: {why}")
    return Examined(pod, uid, label, record=record, bind_time=bind_time(pod))


def match(
    node: str,
    resource: str,
    device_count: int,
    pods: Iterable[Mapping[str, Any]],
    served: set[tuple[str, str, str]],
    verifier: RecordVerifier | None,
    *,
    cards: Mapping[int, CardInfo],
) -> Match:
    """Apply the rule above to raw pods. ``served`` holds (pod uid, container, resource) already allocated;
    ``cards``: this node's cards by index (see :func:`examine`)."""
    examined = (examine(p, node, verifier, cards=cards) for p in pods)
    return choose(node, resource, device_count, [e for e in examined if e is not None], served)


def choose(
    node: str,
    resource: str,
    device_count: int,
    pods: Iterable[Examined],
    served: set[tuple[str, str, str]],
    dismissed: Collection[str] = (),
) -> Match:
    """Rules 2-5 over pods already examined (rule 1): the container this Allocate is for.
    ``dismissed``: UIDs of pods with no record that an earlier refusal was made for (rule 5): that
    refusal went to one of them or to the candidate, which kubelet then failed, so they are not
    counted again (the refused pod's Failed status may not be visible yet)."""
    served_containers = {(uid, c) for uid, c, _ in served}
    candidates: list[tuple[tuple, Match]] = []
    refused: list[str] = []
    untrusted: list[str] = []
    strangers: list[str] = []
    for e in pods:
        if e.unrecorded:
            if e.uid not in dismissed and _asks_unserved(e, resource, device_count, served):
                strangers.append(e)
            continue
        if e.untrusted is not None:
            untrusted.append(e.untrusted)
            continue
        if e.refused is not None or e.record is None:
            refused.extend([e.refused] if e.refused else [])
            continue
        nxt = _next_container(e.pod.get("spec") or {}, e.record, resource, e.uid, served)
        if nxt is None:
            continue
        name, quantity, share = nxt
        if share is None:
            refused.append(f"{e.label}: container {name!r} asks for {resource} but the record has no entry for it")
            continue
        if quantity != device_count:
            refused.append(f"{e.label}: next container {name!r} asks for {quantity} {resource}, kubelet sent {device_count}")
            continue
        in_flight = (e.uid, name) in served_containers
        meta = _meta(e.pod)
        rank = (0 if in_flight else 1, e.bind_time is None, e.bind_time or 0, meta.get("namespace", ""), meta.get("name", ""))
        candidates.append((rank, Match(str(meta.get("namespace", "default")), str(meta.get("name", "")), e.uid, name,
                                       e.record, share, in_flight, e.pod)))
    candidates.sort(key=lambda c: c[0])
    if candidates and strangers and not candidates[0][1].in_flight:  # in flight: kubelet is admitting that pod now
        raise NoMatch(f"node {node}: Allocate of {device_count} {resource} may be for "
                      f"{', '.join(sorted(e.label for e in strangers))}, "
                      f"which asks for as much with no qgpu.io/allocation record (not placed through the qgpu "
                      f"extender: created with spec.nodeName); refused rather than grant the cards recorded for "
                      f"{candidates[0][1].namespace}/{candidates[0][1].pod}. Delete that pod, or create it without "
                      f"spec.nodeName", tuple(untrusted), tuple(e.uid for e in strangers))
    if not candidates:
        reasons = [*refused, *(f"{u} (record not trusted, nothing granted)" for u in untrusted),
                   *(f"{e.label} asks for it with no allocation record (not placed through the qgpu extender)" for e in strangers)]
        why = "; ".join(reasons) if reasons else "no pending pod on this node carries a qgpu.io/allocation record asking for it"
        raise NoMatch(f"node {node}: no pod matches Allocate of {device_count} {resource}: {why}", tuple(untrusted))
    return replace(candidates[0][1], untrusted=tuple(untrusted))


def _shape_refusal(pod: Mapping[str, Any], record: AllocationRecord, node: str, cards: Mapping[int, CardInfo]) -> str | None:
    """Why the record grants more than the pod's own resources ask for (node/deviceplugin/recordcheck.py)."""
    try:
        request = parse_pod(pod, SHAPE_LIMITS)
    except RequestError as exc:
        return f"the pod's own GPU requests do not parse ({exc}), so no record can be checked against them"
    return record_refusal(record, request, node, cards)


def _next_container(
    spec: Mapping[str, Any], record: AllocationRecord, resource: str, uid: str, served: set[tuple[str, str, str]]
) -> tuple[str, int | None, ContainerPlacement | None] | None:
    for container in spec.get("containers") or []:
        quantity = container_quantity(container, resource)
        name = str(container.get("name", ""))
        if (quantity is None and not _lists(container, resource)) or quantity == 0:
            continue  # kubelet allocates nothing for a zero request (issue 22: zero means no GPU)
        if (uid, name, resource) in served:
            continue
        return name, quantity, record.container(name)
    return None


def _lists(container: Mapping[str, Any], resource: str) -> bool:
    resources = container.get("resources") or {}
    return any(resource in (resources.get(s) or {}) for s in ("limits", "requests"))


def preferred_devices(
    available: Sequence[str], must_include: Sequence[str], size: int, cards: Sequence[int], card_of
) -> list[str]:
    """Device IDs for GetPreferredAllocation: must-includes, then spread evenly over ``cards``
    (the predicted container's cards), then anything else in a stable order."""
    chosen = list(dict.fromkeys(must_include))[:size]
    taken = set(chosen)
    pool = sorted((d for d in available if d not in taken), key=_natural)
    if cards:
        need = size - len(chosen)
        per_card = [need // len(cards) + (1 if i < need % len(cards) else 0) for i in range(len(cards))]
        on_card: dict[int, list[str]] = {}
        for d in pool:  # one pass: kubelet offers every free unit of the node (hundreds) on each call
            on_card.setdefault(card_of(d), []).append(d)
        for card, n in zip(cards, per_card):
            free = on_card.get(card, [])
            chosen.extend(free[:n])
            taken.update(free[:n])
            del free[:n]
        pool = [d for d in pool if d not in taken]
    chosen.extend(pool[: max(0, size - len(chosen))])
    return chosen[:size]


def _natural(device_id: str) -> tuple:
    """``<kind>-<card>-<unit>`` in numeric order of card, then unit (kubelet sends them unordered)."""
    head, _, unit = device_id.rpartition("-")
    kind, _, card = head.rpartition("-")
    card_n, unit_n = _index(card), _index(unit)
    return (kind, -1 if card_n is None else card_n, card, -1 if unit_n is None else unit_n, unit)


def _index(text: str) -> int | None:
    """Decimal ASCII digits as a number (``int`` refuses ``²``, which ``isdigit`` takes)."""
    return int(text) if text.isascii() and text.isdigit() else None
