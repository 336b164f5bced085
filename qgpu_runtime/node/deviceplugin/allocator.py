"""Allocate, GetPreferredAllocation and PreStartContainer: the device plugin's decisions.

Allocate is serialised by ``lock``: kubelet admits one pod at a time anyway, and the matching rule
(node/deviceplugin/matching.py) needs a consistent view of what was already served. The reconciler takes the
same lock while it releases the shares of deleted pods, so a pod created meanwhile is never
released. The grant is durable in the store before kubelet hears back.

The admission path makes no API call in the steady state (issue 23): pods come from the node's
watch-fed cache (node/podwatch.py) with each record already parsed and verified
(``matching.examine``); only when that view has no answer (no match, or an over-commit the cache's
lag could explain) is the decision taken again on one LIST. Allocate reuses the match
GetPreferredAllocation just made when nothing changed since. ``qgpu.io/assigned`` is written by
node/annotationwriter.py after Allocate returns.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Collection

from qgpu_runtime.contract.environment import quota_json
from qgpu_runtime.contract.names import ASSIGNED, finished
from qgpu_runtime.contract.record import assigned
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.node.annotationwriter import AnnotationWriter
from qgpu_runtime.node.deviceplugin import matching
from qgpu_runtime.node.deviceplugin.devices import AllocateRefused
from qgpu_runtime.node.deviceplugin.resources import ResourceKind, card_of_device
from qgpu_runtime.node.deviceplugin.response import ContainerGrant, GrantError, build_grant, store_rows
from qgpu_runtime.node.health import CardHealth
from qgpu_runtime.node.metrics import ManagerMetrics
from qgpu_runtime.node.overbooking import card_use, over_booking
from qgpu_runtime.node.podresources import list_held
from qgpu_runtime.node.pods import PodSource
from qgpu_runtime.node.podwatch import ListedPods, NodePodCache, NodePods
from qgpu_runtime.node.store import Share, Store

log = logging.getLogger("qgpu_runtime.node.manager")
MAX_DISMISSED = 1024  # the log lines operators grep for keep their logger


class Allocator:
    def __init__(self, config, cards: dict[int, CardInfo], health: CardHealth, store: Store, pods: PodSource,
                 metrics: ManagerMetrics, policy: Callable[[], Policy], clock_ns: Callable[[], int] = time.time_ns,
                 lock: threading.Lock | None = None, *,
                 view: NodePodCache[matching.Examined] | ListedPods[matching.Examined] | None = None,
                 writer: AnnotationWriter | None = None) -> None:
        """``view``: where the node's pods are read (default: a LIST per read); ``writer``: where
        ``qgpu.io/assigned`` goes (its worker is the caller's to run: NodeManager runs it)."""
        self.config = config
        self.cards = cards
        self.health = health
        self.store = store
        self.pods = pods
        self.metrics = metrics
        self.policy = policy
        self.clock_ns = clock_ns
        self.lock = lock or threading.Lock()
        self.view = view if view is not None else ListedPods(pods.pods_on_node, config.node, self.examine)
        self.writer = writer if writer is not None else AnnotationWriter(pods.patch_pod_annotations)
        self._preferred: tuple[str, int, frozenset, int | None, matching.Match] | None = None
        self._advertised: dict[str, dict[str, tuple[int, ...]]] = {}
        # pods with no record an Allocate was refused for (matching.py rule 5), most recent last
        self._dismissed: OrderedDict[str, None] = OrderedDict()

    def examine(self, pod: dict) -> matching.Examined | None:
        """Rule 1 of the matcher for one pod, as the cache runs it once per version of the pod."""
        return matching.examine(pod, self.config.node, self.config.record_verifier, cards=self.cards)

    def _served(self) -> set[tuple[str, str, str]]:
        return {(g.pod_uid, g.container, g.resource) for g in self.store.grants()}

    def _choose(self, pods: NodePods[matching.Examined], resource: str, count: int,
                served: set[tuple[str, str, str]]) -> matching.Match:
        return matching.choose(self.config.node, resource, count, pods.derived, served, self._dismissed)

    def _decide(self, kind: ResourceKind, count: int, served: set[tuple[str, str, str]]
                ) -> tuple[matching.Match, NodePods[matching.Examined], int | None]:
        """The match, the pods it was made on and the cache's generation then (None: not synced).

        On the cache's view; on a LIST when the view has no answer (a pod the watch has not
        delivered yet: kubelet calls only for pods bound here, so a miss is lag) or is not synced.
        GetPreferredAllocation's match is reused while the view has not moved since it was made."""
        pods = self.view.snapshot()
        generation = pods.generation if pods is not None else None
        if pods is not None:
            reused = self._reuse(kind.name, count, served, generation)
            if reused is not None:
                return reused, pods, generation
            try:
                return self._choose(pods, kind.name, count, served), pods, generation
            except matching.NoMatch:
                self.metrics.fallback_lists.labels(kind.name).inc()
        pods = self.view.fresh()
        return self._choose(pods, kind.name, count, served), pods, generation

    def _reuse(self, resource: str, count: int, served: set, generation: int | None) -> matching.Match | None:
        last = self._preferred
        if last is None or generation is None:
            return None
        if (last[0], last[1], last[2], last[3]) != (resource, count, frozenset(served), generation):
            return None
        return last[4]

    def allocate(self, kind: ResourceKind, device_ids: tuple[str, ...]) -> ContainerGrant:
        started = time.perf_counter()
        result = "refused"
        try:
            grant = self._allocate(kind, device_ids)
            result = "ok"
            return grant
        finally:
            self.metrics.allocations.labels(kind.name, result).inc()
            self.metrics.allocate_seconds.labels(kind.name).observe(time.perf_counter() - started)

    def _allocate(self, kind: ResourceKind, device_ids: tuple[str, ...]) -> ContainerGrant:
        if not device_ids:
            raise AllocateRefused(f"kubelet sent no device IDs for {kind.name}")
        try:
            kind.check_request(self.cards, device_ids)
        except ValueError as exc:
            raise AllocateRefused(str(exc)) from exc
        bad = self.health.unhealthy()
        advertised = self._advertised.get(kind.name)
        if advertised is None:  # the cards are fixed for the manager's life
            advertised = self._advertised[kind.name] = kind.advertised(self.cards.values())
        for d in device_ids:
            sick = [c for c in advertised[d] if c in bad]
            if sick:
                raise AllocateRefused(f"device {d!r} is on card {sick[0]}, which is unhealthy ({bad[sick[0]]})")
        with self.lock:
            served = self._served()
            try:
                m, pods, _ = self._decide(kind, len(device_ids), served)
            except matching.NoMatch as exc:
                self._report_untrusted(kind.name, exc.untrusted)
                for uid in exc.strangers:  # refused once for them: kubelet failed that pod or the candidate
                    self._dismissed[uid] = None
                    while len(self._dismissed) > MAX_DISMISSED:
                        self._dismissed.popitem(last=False)
                raise AllocateRefused(str(exc)) from exc
            except Exception as exc:
                raise AllocateRefused(f"cannot read the pods of node {self.config.node}: {exc}") from exc
            self._preferred = None
            self._report_untrusted(kind.name, m.untrusted)
            try:
                grant = build_grant(m, self.cards, self.policy().value, self.config.state_dir,
                                    self.config.pass_device_specs)
            except GrantError as exc:
                raise AllocateRefused(str(exc)) from exc
            sick = [s.index for s in m.share.shares if s.index in bad]
            if sick:
                raise AllocateRefused(f"pod {m.namespace}/{m.pod} container {m.container}: record names card(s) "
                                      f"{sick}, unhealthy ({', '.join(bad[i] for i in sick)})")
            # on the watched view a pod it does not show holds its rows (allocated by a LIST ahead of
            # the watch); a LIST decides: what it does not show is gone
            problems = over_commit(m, self.cards, self.store.shares(), list(pods.pods), self.store.claim_uids(),
                                   unseen_hold=not pods.listed)
            if problems and not pods.listed:  # a deletion the watch has not delivered yet: decide on a LIST
                self.metrics.fallback_lists.labels(kind.name).inc()
                problems = over_commit(m, self.cards, self.store.shares(), list(self.view.fresh().pods),
                                       self.store.claim_uids())
            if problems:
                raise AllocateRefused(f"pod {m.namespace}/{m.pod} container {m.container}: its record would over-commit "
                                      f"this node: {'; '.join(problems)} (live pods of the node already hold it; "
                                      "two binders disagreed — the pod must be scheduled again)")
            _write_atomic(Path(grant.config_host_dir) / "quota.json", quota_json(grant.quota))
            row, shares = store_rows(m, kind.name, device_ids, self.clock_ns())
            self.store.record(row, shares)  # durable before kubelet hears back
            done = assigned(m.pod_obj)
            mine = {c for uid, c, _ in served if uid == m.pod_uid} | {m.container}
            if not mine <= set(done):  # after Allocate returns: the store is the authority, the reconciler re-issues
                self.writer.submit(m.namespace, m.pod, {ASSIGNED: _json_list(done + sorted(mine))})
        log.info("Allocate %s x%d -> %s/%s container %s cards %s", kind.name, len(device_ids), m.namespace, m.pod,
                 m.container, [s.index for s in m.share.shares])
        return grant

    def _report_untrusted(self, resource: str, untrusted: tuple[str, ...]) -> None:
        """Records refused as not qgpu's: a tenant wrote them, or they were edited. Logged and
        counted on every Allocate that saw them; they grant nothing and book nothing."""
        for why in untrusted:
            self.metrics.untrusted_records.labels(resource).inc()
            log.warning("Allocate %s: allocation record refused, nothing granted: %s", resource, why)

    def preferred(self, kind: ResourceKind, available: list[str], must: list[str], size: int) -> list[str]:
        """Steer kubelet to device IDs on the cards the predicted container's record names."""
        cards: list[int] = []
        try:
            with self.lock:
                served = self._served()
                m, _, generation = self._decide(kind, size, served)
                self._preferred = (kind.name, size, frozenset(served), generation, m)
            cards = [s.index for s in m.share.shares]
        except matching.NoMatch:
            pass  # Allocate will refuse with the reason; any devices do for the preference
        except Exception as exc:  # noqa: BLE001 - a preference only: Allocate reports the reason
            log.warning("GetPreferredAllocation %s: cannot read the pods of node %s: %s", kind.name, self.config.node, exc)
        return matching.preferred_devices(available, must, size, cards, card_of_device)

    def prestart(self, kind: ResourceKind, device_ids: tuple[str, ...]) -> None:
        """Check the Allocate guess against kubelet's own record of who holds these devices."""
        try:
            held = list_held(self.config.pod_resources_socket)
        except Exception as exc:
            log.warning("pod-resources unavailable: %s", exc)
            return
        if held is None:
            return
        ids = set(device_ids)
        holder = next((h for h in held if h.resource == kind.name and ids <= h.device_ids), None)
        mine = next((g for g in self.store.grants() if g.resource == kind.name and set(g.device_ids) == ids), None)
        if holder and mine and (holder.namespace, holder.pod, holder.container) != (mine.namespace, mine.pod, mine.container):
            self.metrics.mismatches.labels(kind.name).inc()
            log.error("devices %s of %s: Allocate assumed %s/%s/%s, kubelet gave them to %s/%s/%s; "
                      "the store is corrected at the next start (reconciliation)", sorted(ids), kind.name,
                      mine.namespace, mine.pod, mine.container, holder.namespace, holder.pod, holder.container)


def over_commit(m: matching.Match, cards: dict[int, CardInfo], shares: list[Share], pods: list[dict],
                claims: Collection[str] = (), unseen_hold: bool = False) -> list[str]:
    """Why granting ``m``'s cards would put a card over its capacity (node/overbooking.py), given
    the shares of the node's live pods in the store (deleted and finished pods no longer hold
    theirs) and of the prepared ResourceClaims ``claims`` (UIDs; kubelet releases those); empty
    when it fits. ``unseen_hold``: a pod ``pods`` does not show at all still holds its shares
    (``pods`` is a view that may lag the store, not a LIST)."""
    listed = {str((p.get("metadata") or {}).get("uid", "")): p for p in pods}
    live = {uid for uid, p in listed.items() if not finished(p)} | set(claims)
    held = [s for s in shares if (s.workload_id in live or (unseen_hold and s.workload_id not in listed))
            and (s.workload_id, s.container) != m.key]
    return over_booking(cards, held, f"{m.pod_uid}/{m.container}", f"{m.namespace}/{m.pod}",
                        [card_use(s.index, s.core_milli, s.memory_mib) for s in m.share.shares])


def _json_list(values: list[str]) -> str:
    return json.dumps(sorted(set(values)))


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
