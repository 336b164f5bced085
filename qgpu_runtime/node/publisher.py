"""What the node tells the cluster and Prometheus about its cards.

``NodePublisher`` writes the GPU labels and the inventory annotation (node/nodeinfo.py) on the
Node, HAMi's share sizes into its capacity and the ``QGPUSharesEnforced`` condition into its status
(with a Warning Event on the Node when shares are not enforced), retrying from the kubelet watcher
until it lands. ``PodCache`` hands the metrics sampler and
the isolation loop the watched pods (node/podwatch.py), or lists them at most once per
``--pod-refresh`` while the watch is not synced (and always with ``--pods-file``).
``MetricsSampler`` builds one snapshot per interval from the backend's sample, the store and the
pods (node/metrics.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from qgpu_runtime.contract.names import SHARES_ENFORCED_CONDITION
from qgpu_runtime.gpu.types import BackendError, CardInfo, GpuBackend
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.model.requests import NVIDIA_GPU
from qgpu_runtime.node.enforcer import Enforcement
from qgpu_runtime.node.health import CardHealth
from qgpu_runtime.node.metrics import ManagerMetrics, build_snapshot
from qgpu_runtime.node.nodeinfo import node_metadata, share_size_capacity
from qgpu_runtime.node.pods import PodSource
from qgpu_runtime.node.podwatch import ListedPods, NodePodCache
from qgpu_runtime.node.store import Store

log = logging.getLogger("qgpu_runtime.node.manager")  # the log lines operators grep for keep their logger

NODE_PUBLISH_RETRY_S = 10.0


class NodePublisher:
    def __init__(self, config, cards: dict[int, CardInfo], health: CardHealth, pods: PodSource,
                 policy: Callable[[], Policy]) -> None:
        self.config = config
        self.cards = cards
        self.health = health
        self.pods = pods
        self.policy = policy
        self.enforcement: Enforcement | None = None  # set by the manager once it knows; None: not reported
        self.due: float | None = None  # monotonic time of the next attempt; None: published
        self._reported: Enforcement | None = None  # what the Node's condition (and Event) already say

    def publish(self) -> None:
        if not self.config.label_node:
            return
        labels, notes = node_metadata(list(self.cards.values()), self.health.unhealthy(), self.policy().value)
        try:
            self.pods.patch_node(self.config.node, labels, notes)
            if self.publishes_share_sizes:
                self.pods.patch_node_capacity(self.config.node, share_size_capacity(list(self.cards.values())))
            self._report_enforcement()
        except Exception as exc:  # retried from the kubelet watcher until it lands
            self.due = time.monotonic() + NODE_PUBLISH_RETRY_S
            log.warning("node %s: could not write GPU labels/annotations/condition (retrying in %.0f s): %s",
                        self.config.node, NODE_PUBLISH_RETRY_S, exc)
            return
        self.due = None

    def _report_enforcement(self) -> None:
        """The Node's QGPUSharesEnforced condition, and a Warning Event once when shares are not
        enforced; written again only when what it says changes."""
        state = self.enforcement
        if state is None or state == self._reported:
            return
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.pods.set_node_condition(self.config.node, {
            "type": SHARES_ENFORCED_CONDITION, "status": "True" if state.enforced else "False",
            "reason": state.reason, "message": state.message, "lastTransitionTime": now, "lastHeartbeatTime": now})
        if not state.enforced:
            self.pods.record_node_event(self.config.node, "Warning", "SharesNotEnforced", f"{state.reason}: {state.message}")
            log.warning("node %s: shares are not enforced (%s): %s", self.config.node, state.reason, state.message)
        self._reported = state

    @property
    def publishes_share_sizes(self) -> bool:
        """HAMi's share sizes go into the node's capacity where HAMi's pods come to this node's
        device plugin: it serves nvidia.com/gpu (on DRA pools the claims carry them)."""
        return not self.config.dra and any(k.name == NVIDIA_GPU for k in self.config.resources)

    def retry_if_due(self) -> None:
        if self.due is not None and time.monotonic() >= self.due:
            self.publish()


class PodCache:
    def __init__(self, config, pods: PodSource, view: NodePodCache[Any] | ListedPods[Any] | None = None) -> None:
        self.config = config
        self.pods = pods
        self.view = view
        self._cache: tuple[float, list[dict]] | None = None
        self._lock = threading.Lock()

    def get(self, max_age_s: float) -> list[dict]:
        """The node's pods: the watched view while it is synced, otherwise listed again when the
        cached list is older than ``max_age_s`` (or ``--pod-refresh``); the metrics sampler and
        the isolation loop share one list."""
        snapshot = self.view.snapshot() if self.view is not None else None
        if snapshot is not None:
            return list(snapshot.pods)
        now = time.monotonic()
        with self._lock:
            cached = self._cache
            if cached is not None and now - cached[0] < min(max_age_s, self.config.pod_refresh_s):
                return cached[1]
            pods = self.pods.pods_on_node(self.config.node)
            self._cache = (now, pods)
            return pods

    def for_metrics(self) -> list[dict]:
        try:
            return self.get(self.config.pod_refresh_s)
        except Exception as exc:
            log.warning("metrics: listing pods failed: %s", exc)
            return self._cache[1] if self._cache else []


class MetricsSampler:
    def __init__(self, config, cards: dict[int, CardInfo], health: CardHealth, backend: GpuBackend, store: Store,
                 pods: PodCache, metrics: ManagerMetrics) -> None:
        self.config = config
        self.cards = cards
        self.health = health
        self.backend = backend
        self.store = store
        self.pods = pods
        self.metrics = metrics

    def sample_once(self) -> None:
        try:
            usage = self.backend.sample()
        except BackendError as exc:
            log.warning("sampling: %s", exc)
            usage = ()
        snap = build_snapshot(self.config.node, list(self.cards.values()), self.health.unhealthy(), usage,
                              self.store.shares(), self.pods.for_metrics())
        self.metrics.collector.update(snap)

    def serve(self, stop: threading.Event) -> None:
        while not stop.wait(self.config.sample_interval_s):
            try:
                self.sample_once()
            except Exception:  # a bad sample must not end sampling for the life of the process
                log.exception("metrics sample failed")
