"""List-then-watch loops that keep an :class:`AllocationCache` current.

Each kind (nodes, pods, PodDisruptionBudgets, and DRA's objects where asked) lists everything
once — that rebuilds the bookings from the pods' allocation records after a restart — then
follows a watch from the list's resourceVersion. When the watch breaks or the version expires
(410), the loop relists after a backoff; a relist replaces the kind's contents, so deletions
missed while disconnected are not kept.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.extender.dra import DraView
from qgpu_runtime.kube import apijson
from qgpu_runtime.kube.client import REQUEST_TIMEOUT
from qgpu_runtime.kube.paging import paged_list
from qgpu_runtime.kube.podslim import kept
from qgpu_runtime.placement.disruption import budget_of

log = logging.getLogger(__name__)

# Pods that ended hold no cards; leaving them out keeps big clusters' lists small.
LIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"


def _whole(obj: dict[str, Any]) -> dict[str, Any]:
    return obj


@dataclass
class Kind:
    name: str
    list_call: Callable[..., Any]
    replace: Callable[[Iterable[Any]], None]
    apply: Callable[[str, Mapping[str, Any]], None]
    field_selector: str | None = None
    keep: Callable[[dict[str, Any]], Any] = _whole
    """What a LIST keeps of each object while the rest of its pages are read (all of it by default;
    ``replace`` takes what it keeps). A tenant writes pods, budgets and claims, each up to etcd's
    object limit: each is reduced as its page is read, never held whole with the others."""
    broken: Callable[[], None] | None = None
    """Told when the watch broke, before the relist (the DRA view stops waiting for its claims)."""


class CacheFeeder:
    """Runs one daemon thread per kind; ``ready`` is set once every kind has listed once."""

    def __init__(self, api: client.CoreV1Api, cache: AllocationCache, watch_timeout_s: int = 240,
                 dra: DraView | None = None, resource_api: client.ResourceV1Api | None = None,
                 policy_api: client.PolicyV1Api | None = None):
        self.api = api
        self.cache = cache
        self.watch_timeout_s = watch_timeout_s
        self._stop = threading.Event()
        self._listed: set[str] = set()
        self._lock = threading.Lock()
        self.kinds = [
            Kind("nodes", api.list_node, cache.replace_nodes, cache.apply_node),
            Kind("pods", api.list_pod_for_all_namespaces, cache.replace_pods, cache.apply_pod, LIVE_PODS, kept),
            # preempt's PodDisruptionBudgets (extender/budgets.py)
            Kind("poddisruptionbudgets", (policy_api or client.PolicyV1Api(api.api_client)).list_pod_disruption_budget_for_all_namespaces,
                 cache.budgets.replace, cache.budgets.apply, keep=budget_of),
        ]
        if dra is not None:
            # DRA prioritize: qgpu's slices (cards), claims (demand and usage), templates (demand).
            resource = resource_api or client.ResourceV1Api(api.api_client)
            self.kinds += [
                Kind("resourceslices", resource.list_resource_slice, dra.replace_slices, dra.apply_slice,
                     keep=dra.reduce_slice),
                Kind("resourceclaims", resource.list_resource_claim_for_all_namespaces, dra.replace_claims, dra.apply_claim,
                     keep=dra.reduce_claim, broken=lambda: dra.following("claims", False)),
                Kind("resourceclaimtemplates", resource.list_resource_claim_template_for_all_namespaces,
                     dra.replace_templates, dra.apply_template, keep=dra.reduce_template,
                     broken=lambda: dra.following("templates", False)),
            ]
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        # Nodes first: pods' records can only be booked onto nodes the cache knows.
        first: dict[str, str] = {}
        try:
            first[self.kinds[0].name] = self._list(self.kinds[0])
        except Exception as exc:  # noqa: BLE001 - the thread relists with backoff; /readyz stays 503
            log.warning("first node list failed (%s); retrying in the background", exc)
        for kind in self.kinds:
            t = threading.Thread(target=self._run, args=(kind, first.get(kind.name, "")), name=f"watch-{kind.name}", daemon=True)
            t.start()
            self.threads.append(t)

    def stop(self) -> None:
        self._stop.set()

    def _list(self, kind: Kind) -> str:
        """LIST the kind a page at a time (kube/paging.py: a tenant's pods near etcd's object limit
        are not decoded all at once; a pod is kept without the bulk the cache never reads), then
        replace the cache's copy with it; the list's resourceVersion, where the watch starts."""
        def fetch(limit: int, token: str | None) -> Any:
            kwargs: dict[str, Any] = {"limit": limit, "_continue": token, "_preload_content": False,
                                      "_request_timeout": (REQUEST_TIMEOUT[0], 60)}
            if kind.field_selector:
                kwargs["field_selector"] = kind.field_selector
            return kind.list_call(**kwargs)

        items, version = paged_list(fetch, kind.keep)
        kind.replace(items)
        with self._lock:
            self._listed.add(kind.name)
            if len(self._listed) == len(self.kinds):
                self.cache.synced.set()
        return version

    def _run(self, kind: Kind, version: str) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if not version:
                    version = self._list(kind)
                version = self._follow(kind, version)
                failures = 0
            except Exception as exc:  # noqa: BLE001 - any break of the stream means: relist
                failures += 1
                delay = min(10.0, 0.2 * 2 ** min(failures, 6))
                log.warning("watch %s broke (%s); relisting in %.1fs", kind.name, exc, delay)
                if kind.broken is not None:
                    kind.broken()
                version = ""
                self._stop.wait(delay)

    @staticmethod
    def _apply(kind: Kind, event: str, obj: Mapping[str, Any]) -> None:
        """One event into the cache. One object whose event raises is skipped, the stream goes on:
        breaking it relisted, the relist met the same object, and the kind never synced again (a
        tenant's pod did that to the pods' watch). The cache keeps that object as it had it; each
        event is logged once (a watch delivers each resourceVersion once)."""
        try:
            kind.apply(event, obj)
        except Exception as exc:  # noqa: BLE001 - one object must not stop the watch of its kind
            meta = obj.get("metadata") if isinstance(obj, Mapping) and isinstance(obj.get("metadata"), Mapping) else {}
            log.warning("watch %s: %s event of %s/%s (resourceVersion %s) not applied, skipped: %s", kind.name, event,
                        meta.get("namespace") or "-", meta.get("name"), meta.get("resourceVersion"), str(exc)[:200])

    def _follow(self, kind: Kind, version: str) -> str:
        kwargs: dict[str, Any] = {
            "resource_version": version,
            "allow_watch_bookmarks": True,
            "timeout_seconds": self.watch_timeout_s,
            "_request_timeout": (REQUEST_TIMEOUT[0], self.watch_timeout_s + 30),
        }
        if kind.field_selector:
            kwargs["field_selector"] = kind.field_selector
        # The stream is read here, line by line, rather than through the client's Watch: each event
        # is decoded by apijson.loads (a tenant's ResourceClaim nested past the decoder's reach must
        # not end every watch of claims), and none is deserialised into models.
        response = kind.list_call(watch=True, _preload_content=False, **kwargs)
        try:
            for line in iter_resp_lines(response):
                if self._stop.is_set():
                    break
                if not line.strip():
                    continue
                event = apijson.loads(line)
                kind_of_event = event.get("type")
                obj = event.get("object") or {}
                if kind_of_event == "ERROR":  # an expired version (410) too: the caller relists
                    raise RuntimeError(f"watch error: {obj.get('message') or obj}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind_of_event in ("ADDED", "MODIFIED", "DELETED"):
                    self._apply(kind, kind_of_event, obj)
        finally:
            response.close()
            response.release_conn()
        return version


def expire_loop(cache: AllocationCache, delete: Callable[[Any], None], period_s: float, stop: threading.Event,
                release_groups: Callable[[int], None] | None = None) -> None:
    """Periodically release assumed records whose bind never happened, and delete them; and, with
    ``release_groups``, the held placements of T9k groups past their timeout."""
    while not stop.wait(period_s):
        if release_groups is not None:
            try:
                release_groups(time.time_ns())
            except Exception as exc:  # noqa: BLE001 - retried next period
                log.warning("could not release expired group holds: %s", exc)
        for expired in cache.expire(time.time_ns()):
            try:
                delete(expired)
            except Exception as exc:  # noqa: BLE001 - retried next period
                log.warning("could not delete expired record of %s/%s: %s", expired.namespace, expired.name, exc)
