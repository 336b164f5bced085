"""Keeping the store equal to what the node really runs.

At start (``reconcile``, before kubelet is served) the store is compared with the pods of the node
and kubelet's pod-resources; while running (``release_gone``, every ``--release-interval``) the
shares of pods deleted or finished are released. The rules themselves are node/reconcile.py's
pure ``plan``; this module applies it and removes the quota folders of gone pods.
"""

from __future__ import annotations

import logging
import shutil
import threading
from typing import Any

from qgpu_runtime.contract.names import ASSIGNED, finished
from qgpu_runtime.node.annotationwriter import AnnotationWriter
from qgpu_runtime.node.podresources import list_held
from qgpu_runtime.node.pods import PodSource
from qgpu_runtime.node.podwatch import ListedPods, NodePodCache
from qgpu_runtime.node.reconcile import Plan, plan
from qgpu_runtime.node.store import Store

log = logging.getLogger("qgpu_runtime.node.manager")  # the log lines operators grep for keep their logger


class Reconciler:
    def __init__(self, config, store: Store, pods: PodSource, lock: threading.Lock, *,
                 view: NodePodCache[Any] | ListedPods[Any] | None = None, writer: AnnotationWriter | None = None) -> None:
        """``lock``: the allocator's; held while releasing so a pod admitted meanwhile stays.
        ``view``: the node's watched pods (a LIST per read without); ``writer``: where missing
        ``qgpu.io/assigned`` values are re-issued while running (start-up writes them directly)."""
        self.config = config
        self.store = store
        self.pods = pods
        self.lock = lock
        self.view = view if view is not None else ListedPods(pods.pods_on_node, config.node, lambda _: None)
        self.writer = writer

    def _node_pods(self) -> list[dict]:
        snapshot = self.view.snapshot()
        return list(snapshot.pods) if snapshot is not None else list(self.view.fresh().pods)

    def reconcile(self) -> Plan:
        pods = self.pods.pods_on_node(self.config.node)
        try:
            held = list_held(self.config.pod_resources_socket)
        except Exception as exc:
            log.warning("pod-resources unavailable, reconciling with the API only: %s", exc)
            held = None
        p = plan(self.store.grants(), self._pod_shares(), pods, held)
        for uid, why in p.release_pods.items():
            log.info("release pod %s: %s", uid, why)
        self.store.release_pods(p.release_pods)
        for (uid, container, resource), why in p.release_grants.items():
            log.info("release grant %s/%s/%s: %s", uid, container, resource, why)
            self.store.release_grant(uid, container, resource)
        if p.reassign:
            uid_of = {((q.get("metadata") or {}).get("namespace", "default"), (q.get("metadata") or {}).get("name")):
                      str((q.get("metadata") or {}).get("uid", "")) for q in pods}
            moves = {k: (uid_of.get((ns, pod), ""), ns, pod, c) for k, (ns, pod, c) in p.reassign.items()}
            self.store.reassign({k: v for k, v in moves.items() if v[0]})
        self._remove_stale_container_dirs(pods)
        for (ns, name), value in p.annotate.items():
            try:
                self.pods.patch_pod_annotations(ns, name, {ASSIGNED: value})
            except Exception as exc:
                log.warning("pod %s/%s: could not write %s: %s", ns, name, ASSIGNED, exc)
        return p

    def release_gone(self) -> dict[str, str]:
        """Release the shares of pods deleted or finished while the manager runs (not only at the
        next start), so metrics, `qgpu status` and the isolation loop stop counting them.

        Only the API's view decides (rules 1-2 of node/reconcile.py): pod-resources lags an
        Allocate kubelet has not finished, so its rules stay at start-up. Holding the Allocate lock
        across the read and the release keeps a pod created meanwhile from being released.

        The pods are the watched view (no LIST while it is synced). A grant whose pod the view
        does not show yet (Allocate found it by a LIST, ahead of the watch) must not be released:
        a release the view asks for is confirmed on a LIST first (rare: pods come and go in
        batches). The ``qgpu.io/assigned`` values the view shows missing are re-issued through the
        writer (a write dropped or lost in a crash lands here)."""
        with self.lock:
            pods = self._node_pods()
            result = plan(self.store.grants(), self._pod_shares(), pods, None)
            if result.release_pods and self.view.snapshot() is not None:
                pods = list(self.view.fresh().pods)
                result = plan(self.store.grants(), self._pod_shares(), pods, None)
            gone = result.release_pods
            if gone:
                self.store.release_pods(gone)
        if self.writer is not None:
            for (ns, name), value in result.annotate.items():
                self.writer.submit(ns, name, {ASSIGNED: value})
        for uid, why in gone.items():
            log.info("release pod %s: %s", uid, why)
        if gone:
            self._remove_stale_container_dirs(pods)
        return gone

    def _pod_shares(self):
        """Shares booked for pods; a prepared ResourceClaim's (keyed by the claim's UID, not a
        pod's) is kubelet's to release through NodeUnprepareResources. One read of the store: a
        claim the DRA plugin books meanwhile (under its own lock) is either wholly in or wholly out."""
        return self.store.pod_shares()

    def _remove_stale_container_dirs(self, pods: list[dict]) -> None:
        """Quota folders of pods that are gone or finished (also ones written just before a crash)."""
        root = self.config.state_dir / "containers"
        if not root.is_dir():
            return
        live = {str((q.get("metadata") or {}).get("uid", "")) for q in pods
                if not finished(q)}
        for entry in root.iterdir():
            if entry.is_dir() and entry.name not in live:
                shutil.rmtree(entry, ignore_errors=True)
