"""Who holds the store's shares on this node: the isolation engine's tenants, whichever door booked.

The store holds shares booked through two front doors: the device plugin books them per
(pod UID, container) and the DRA kubelet plugin per ResourceClaim (workload_id = the claim's UID,
container = the request). The isolation engine enforces per tenant, and a tenant is whatever set
of containers must share one set of quotas. This module turns both kinds of rows into tenants, so
that the engine and the process attribution (node/containers.py) never ask which door booked:

- a device-plugin row belongs to the container it was booked for;
- a claim's rows belong to every container that references the claim: a container of a live pod
  in the claim's namespace whose ``resources.claims[].name`` names an entry of the pod's
  ``spec.resourceClaims`` that resolves to the claim's name (``resourceClaimName``, or for a
  template the pod's ``status.resourceClaimStatuses``); a ``resources.claims[].request`` narrows
  it to that request's rows. A pod the claim was reserved for at prepare (store ``claim_pods``)
  whose entries cannot be resolved (status not written) links its containers that reference an
  unresolved entry.

A pod kept oversized (kube/podslim.py: past ``MAX_KEPT_POD_ENTRIES``, kept without its containers,
claims and statuses) is one member, :data:`WHOLE_POD`: every row booked for the pod and every row of
a claim reserved for it are its, and every process of the pod is attributed to it (node/containers.py).
That is its containers' rows together: a container sees only the devices of its own claims, so
each card's quota still bounds what runs on that card.

Rows reached through one container are one tenant; a row reached through several containers
(a claim shared by two containers or two pods) joins them into one tenant, so the claim's share is
enforced once over all of its processes, never once per container. So the tenants are the
connected components of "container references row". Quotas on one card add up (two claims of one
container on one card are one tenant's quota there). A tenant's class is the most favoured of its
rows (online, then normal, then offline): a container is held as offline work only if everything
it holds is offline.

Pure: pod JSON and store rows in, tenants out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from qgpu_runtime.isolation.engine import CardQuota, Workload
from qgpu_runtime.kube.podslim import oversized
from qgpu_runtime.model import AppClass
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD
from qgpu_runtime.node.store import PreparedClaim, Share

_CLASS_RANK = {AppClass.ONLINE.value: 0, AppClass.NORMAL.value: 1, AppClass.OFFLINE.value: 2}
_REPEATED = re.compile(r"^(.*)\[[0-9]+\]$")

RowId = tuple[str, str, int]  # the shares table's key: (workload_id, container, card_index)
WHOLE_POD = "*"
"""The container of the one member of a pod kept oversized: all of its containers (a container's
name is a DNS label, never this)."""


def dominant_class(classes: Iterable[str]) -> str:
    """The class a tenant of rows with these classes is enforced with: online before normal before
    offline (offline work yields to everyone, so it must be all the tenant holds)."""
    found = sorted(set(classes), key=lambda c: _CLASS_RANK.get(c, 1))
    return found[0] if found else AppClass.NORMAL.value


@dataclass(frozen=True)
class Member:
    """One container of a tenant."""

    pod_uid: str
    namespace: str
    pod: str
    container: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


@dataclass(frozen=True)
class TenantRef:
    """A tenant as the isolation loop knows it: its containers, and the pod its events go to.

    ``key`` is ``namespace/pod/container`` for one container (what a device-plugin container was
    always keyed by), the members' keys joined by ``+`` for several."""

    members: tuple[Member, ...]

    @property
    def key(self) -> str:
        return "+".join(m.key for m in self.members)

    @property
    def pod_uid(self) -> str:
        return self.members[0].pod_uid

    @property
    def namespace(self) -> str:
        return self.members[0].namespace

    @property
    def pod(self) -> str:
        return "+".join(dict.fromkeys(m.pod for m in self.members))

    @property
    def container(self) -> str:
        return "+".join(dict.fromkeys(m.container for m in self.members))


def _request_of(label: str) -> str:
    """The request a claim row was booked for (draplugin writes ``req`` or ``req[i]``)."""
    m = _REPEATED.match(label)
    return m.group(1) if m else label


def _request_matches(wanted: str | None, request: str) -> bool:
    return not wanted or request == wanted or request.startswith(f"{wanted}/")


def _claim_name_of(pod: Mapping[str, Any], entry_name: str) -> str | None:
    """The ResourceClaim a pod's ``spec.resourceClaims`` entry stands for, None if not known yet."""
    for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
        if entry.get("name") == entry_name and entry.get("resourceClaimName"):
            return str(entry["resourceClaimName"])
    for st in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if st.get("name") == entry_name and st.get("resourceClaimName"):
            return str(st["resourceClaimName"])
    return None


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def tenants_of(shares: Iterable[Share], claims: Sequence[PreparedClaim],
               live_pods: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[TenantRef, Workload]]:
    """The engine's workloads by key, from the store's rows and the node's live pods (by UID).

    Rows no live container references (a pod gone, a claim whose pods ended) make no tenant: they
    stay booked until released, and a tenant that leaves is resumed by the engine."""
    rows = list(shares)
    by_claim = {c.claim_uid: c for c in claims}
    claim_rows: dict[str, list[Share]] = {}
    pod_rows: dict[tuple[str, str], list[Share]] = {}
    for s in rows:
        if s.workload_id in by_claim:
            claim_rows.setdefault(s.workload_id, []).append(s)
        else:
            pod_rows.setdefault((s.workload_id, s.container), []).append(s)
    claims_by_name = {(c.namespace, c.name): c for c in claims}
    reserved: dict[str, list[PreparedClaim]] = {}
    for c in claims:
        for p in c.pods:
            reserved.setdefault(p.uid, []).append(c)

    reached: dict[Member, list[Share]] = {}
    rows_of_pod: dict[str, list[Share]] | None = None
    for uid, pod in live_pods.items():
        meta = pod.get("metadata") or {}
        namespace, name = str(meta.get("namespace", "default")), str(meta.get("name", ""))
        if oversized(pod) is not None:  # its containers are not kept: the pod is one member
            if rows_of_pod is None:
                rows_of_pod = {}
                for (owner, _), booked in pod_rows.items():
                    rows_of_pod.setdefault(owner, []).extend(booked)
            held = [*rows_of_pod.get(uid, ()), *(s for c in reserved.get(uid, []) for s in claim_rows.get(c.claim_uid, []))]
            if held:
                reached.setdefault(Member(uid, namespace, name, WHOLE_POD), []).extend(held)
            continue
        linked_claims: set[str] = set()
        unresolved: list[tuple[Member, str | None]] = []
        for c in _containers(pod):
            member = Member(uid, namespace, name, str(c.get("name", "")))
            held = list(pod_rows.get((uid, member.container), []))
            for ref in (c.get("resources") or {}).get("claims") or []:
                claim_name = _claim_name_of(pod, str(ref.get("name", "")))
                if claim_name is None:
                    unresolved.append((member, ref.get("request")))
                    continue
                claim = claims_by_name.get((namespace, claim_name))
                if claim is None:
                    continue  # another driver's claim, or not prepared on this node
                linked_claims.add(claim.claim_uid)
                held += [s for s in claim_rows.get(claim.claim_uid, []) if _request_matches(ref.get("request"), _request_of(s.container))]
            if held:
                reached.setdefault(member, []).extend(held)
        for claim in reserved.get(uid, []):
            if claim.claim_uid in linked_claims:
                continue
            for member, request in unresolved:
                reached.setdefault(member, []).extend(
                    s for s in claim_rows.get(claim.claim_uid, []) if _request_matches(request, _request_of(s.container)))
    return _components(reached)


def _components(reached: Mapping[Member, list[Share]]) -> dict[str, tuple[TenantRef, Workload]]:
    """Union the containers that reach a common row; one workload per component."""
    parent: dict[RowId, RowId] = {}

    def find(x: RowId) -> RowId:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    row_of: dict[RowId, Share] = {}
    for held in reached.values():
        ids = [(s.workload_id, s.container, s.card_index) for s in held]
        for rid, s in zip(ids, held):
            row_of[rid] = s
            parent[find(rid)] = find(ids[0])
    members: dict[RowId, list[Member]] = {}
    for member, held in reached.items():
        if held:
            members.setdefault(find((held[0].workload_id, held[0].container, held[0].card_index)), []).append(member)
    rows_of: dict[RowId, list[Share]] = {}
    for rid, s in row_of.items():
        rows_of.setdefault(find(rid), []).append(s)

    out: dict[str, tuple[TenantRef, Workload]] = {}
    for root, ms in members.items():
        ref = TenantRef(tuple(sorted(ms, key=lambda m: m.key)))
        core: dict[int, int] = {}
        memory: dict[int, int] = {}
        for s in rows_of[root]:
            core[s.card_index] = core.get(s.card_index, 0) + s.core_milli
            memory[s.card_index] = memory.get(s.card_index, 0) + s.memory_mib
        quotas = tuple(CardQuota(i, min(core[i], CORE_MILLI_PER_CARD), memory[i]) for i in sorted(core))
        klass = AppClass(dominant_class(s.klass for s in rows_of[root]))
        out[ref.key] = (ref, Workload(ref.key, klass, quotas))
    return out
