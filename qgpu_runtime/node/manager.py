"""The node manager: GPUs, device plugins, allocation store, health, metrics — wired together.

Each job has its own component, built here with its dependencies passed in:
- ``Allocator`` (node/deviceplugin/allocator.py): Allocate, GetPreferredAllocation, PreStartContainer;
- ``CardHealth`` (node/health.py): unhealthy cards and the device-list version ListAndWatch waits on;
- ``KubeletRegistration`` (node/deviceplugin/registration.py): the gRPC servers and their registration; with
  ``dra``, ``DraKubeletPlugin`` (node/dra/plugin.py) in its place, the DRA kubelet plugin;
- ``Reconciler`` (node/reconciler.py): the store against the node's pods, at start and while running;
- ``NodePublisher``, ``PodCache``, ``MetricsSampler`` (node/publisher.py): node labels and metrics;
- ``NodeIsolation`` (node/enforcer.py): the node's policy enforced on its containers every tick.

The device-plugin servicer talks to the manager through the ``DeviceService`` Protocol
(node/deviceplugin/devices.py), which the manager satisfies by handing each call to its health or allocator
component; one object to hand out keeps the plugin servers unaware of how the node is split.

Threads: the pod watch (node/podwatch.py: the node's pods for every reader), the annotation writer
(node/annotationwriter.py: ``qgpu.io/assigned`` off the admission path), one gRPC server per
resource (kubelet calls in), a health watcher (NVML/XID events), a
kubelet watcher (re-registers when kubelet restarts and re-creates its socket; retries the node
labels; releases the shares of gone pods), a sampler (metrics, once per interval) and, when given
an isolation backend, the isolation loop.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from qgpu_runtime.contract.signature import RecordVerifier
from qgpu_runtime.gpu.types import BackendError, CardInfo, GpuBackend
from qgpu_runtime.isolation.policy import POLICY_LABEL, Policy, parse_policy
from qgpu_runtime.model.requests import DEFAULT_LIMITS, CardLimits
from qgpu_runtime.node.annotationwriter import AnnotationWriter
from qgpu_runtime.node.containers import ContainerResolver
from qgpu_runtime.node.deviceplugin.allocator import Allocator
from qgpu_runtime.node.deviceplugin.devices import wait_devices
from qgpu_runtime.node.deviceplugin.matching import Examined, examine
from qgpu_runtime.node.deviceplugin.registration import KubeletRegistration
from qgpu_runtime.node.deviceplugin.resources import ResourceKind
from qgpu_runtime.node.deviceplugin.response import ContainerGrant
from qgpu_runtime.node.dra.slices import SliceApi, SlicePublisher, check_unhealthy_effect
from qgpu_runtime.node.enforcer import IsolationBackend, NodeIsolation, enforcement, resolve_policy
from qgpu_runtime.node.health import UNHEALTHY_EVENT, CardHealth, pods_on_card
from qgpu_runtime.node.metrics import ManagerMetrics
from qgpu_runtime.node.podresources import DEFAULT_SOCKET
from qgpu_runtime.node.pods import PodSource, PodSourceError
from qgpu_runtime.node.podwatch import node_pods
from qgpu_runtime.node.publisher import MetricsSampler, NodePublisher, PodCache
from qgpu_runtime.node.reconcile import Plan
from qgpu_runtime.node.reconciler import Reconciler
from qgpu_runtime.node.store import Store

log = logging.getLogger(__name__)

MAX_SAMPLE_INTERVAL_S = 3600.0
"""--sample-interval: an hour between GPU samples is already no monitoring; inf or 1e18 overflowed
the sampler's timed wait."""


@dataclass(frozen=True)
class ManagerConfig:
    node: str
    resources: tuple[ResourceKind, ...]
    plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    pod_resources_socket: Path = DEFAULT_SOCKET
    state_dir: Path = Path("/var/lib/qgpu")
    isolation_policy: str | None = None  # override of the node label; None: the label decides
    pass_device_specs: bool = True
    sample_interval_s: float = 1.0
    watch_interval_s: float = 1.0
    pod_refresh_s: float = 10.0
    release_interval_s: float = 10.0  # how often shares of deleted or finished pods are released while running
    label_node: bool = True
    proc_root: Path = Path("/proc")
    isolation_tick_s: float = 0.05
    isolation_refresh_s: float = 1.0
    memory_tolerance_mib: int = 0
    api_retry_max_s: float = 30.0  # longest wait between attempts to reach an unavailable apiserver
    dra: bool = False  # serve the DRA kubelet plugin (node/dra/plugin.py) instead of device plugins
    dra_unhealthy_effect: str = "NoSchedule"  # the unhealthy card's device taint; NoExecute evicts its pods
    cdi_dir: Path = Path("/var/run/cdi")
    kubelet_plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    plugins_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    # The extender's public key (--record-verify-key): Allocate believes only records it signed.
    # None only with --pods-file (the host's operator writes that file) or --dra (no records).
    record_verifier: RecordVerifier | None = None
    # What the cluster's parsers admit (--largest-card-memory-mib): the DRA slices' request policies,
    # and the largest card whose size the start-up check compares this node's cards with.
    limits: CardLimits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        if self.isolation_policy is not None:
            parse_policy(self.isolation_policy, field="--isolation-policy")
        if not 0 < self.sample_interval_s <= MAX_SAMPLE_INTERVAL_S:  # NaN too: no comparison holds for it
            raise ValueError(f"--sample-interval: {self.sample_interval_s} must be positive and at most "
                             f"{MAX_SAMPLE_INTERVAL_S:g} seconds")
        if not 0.005 <= self.isolation_tick_s <= 5:
            raise ValueError(f"--tick: {self.isolation_tick_s!r} is not allowed: must be 0.005..5 seconds")
        if self.memory_tolerance_mib < 0:
            raise ValueError(f"--memory-tolerance: {self.memory_tolerance_mib!r} is not allowed: must be >= 0")
        check_unhealthy_effect(self.dra_unhealthy_effect)

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / "kubelet.sock"


def larger_cards_warning(cards: Iterable[CardInfo], limits: CardLimits) -> str | None:
    """The warning for this node's cards larger than the largest card the cluster's parsers admit,
    or None. Not an error: the cards serve, but a pod asking more memory per card than the limit is
    refused at admission, so part of each such card can only go to whole-card pods."""
    larger = [c for c in sorted(cards, key=lambda c: c.index) if c.memory_mib > limits.max_card_memory_mib]
    if not larger:
        return None
    named = ", ".join(f"card {c.index} ({c.model}, {c.uuid}) has {c.memory_mib} MiB" for c in larger)
    return (f"{named}: above the largest card the cluster admits, {limits.max_card_memory_mib} MiB "
            f"(--largest-card-memory-mib): pods asking more memory per card than that are refused at admission; "
            f"set --largest-card-memory-mib {max(c.memory_mib for c in larger)} on every component (the roles' "
            "qgpu_largest_card_memory_mib)")


class NodeUnreadable(RuntimeError):
    """The node object (its policy label) could not be read at start."""


class NodeManager:
    def __init__(self, config: ManagerConfig, backend: GpuBackend, store: Store, pods: PodSource,
                 clock_ns: Callable[[], int] = time.time_ns, isolation: IsolationBackend | None = None,
                 slice_api: SliceApi | None = None) -> None:
        """``isolation`` None: device plugin, store and metrics only (nothing is throttled);
        ``slice_api``: where ``config.dra`` publishes the node's ResourceSlice (node/dra/slices.py)."""
        self.config = config
        self.backend = backend
        self.store = store
        self.pods = pods
        self.cards: dict[int, CardInfo] = {c.index: c for c in backend.cards()}
        self.metrics = ManagerMetrics.create(config.node)
        self.policy = Policy.BEST_EFFORT
        self.health = CardHealth(self.cards)
        self.writer = AnnotationWriter(pods.patch_pod_annotations, retry_max_s=config.api_retry_max_s)
        # One watch of the node's pods for every reader (node/podwatch.py); the device plugin's
        # matcher examines each version of a pod once, there (the DRA door reads no pod records).
        self.node_pods = node_pods(pods, config.node, self._examine, retry_max_s=config.api_retry_max_s)
        self.allocator = Allocator(config, self.cards, self.health, store, pods, self.metrics, lambda: self.policy, clock_ns,
                                   view=self.node_pods, writer=self.writer)
        self.reconciler = Reconciler(config, store, pods, self.allocator.lock, view=self.node_pods, writer=self.writer)
        self.publisher = NodePublisher(config, self.cards, self.health, pods, lambda: self.policy)
        self.pod_cache = PodCache(config, pods, self.node_pods)
        self.sampler = MetricsSampler(config, self.cards, self.health, backend, store, self.pod_cache, self.metrics)
        if config.dra:
            from qgpu_runtime.node.dra.plugin import dra_plugin

            self.registration = dra_plugin(config, self.cards, store, pods, lambda: self.policy.value, self.health,
                                           node_labels=lambda: pods.node_labels(config.node))
        else:
            self.registration = KubeletRegistration(config.resources, self, config.plugin_dir)
        self.plugins = self.registration.plugins
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._isolation_backend = isolation
        self.isolation: NodeIsolation | None = None
        self.slices: SlicePublisher | None = None
        if config.dra:
            if slice_api is None:
                raise ValueError("--dra: the ResourceSlice is written through the Kubernetes API, "
                                 "which this manager was given none of (--pods-file?)")
            self.slices = SlicePublisher(slice_api, config.node, self.cards, self.health, lambda: self.policy, config.limits,
                                         retry_max_s=config.api_retry_max_s, unhealthy_effect=config.dra_unhealthy_effect)
        larger = larger_cards_warning(self.cards.values(), config.limits)
        if larger:
            log.warning("%s", larger)

    def _examine(self, pod: dict) -> Examined | None:
        if self.config.dra:
            return None
        return examine(pod, self.config.node, self.config.record_verifier, cards=self.cards)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, until: threading.Event | None = None) -> bool:
        """Reconcile, publish, serve kubelet. While the pods cannot be read (apiserver down) it waits
        and retries; it returns False, having served nothing, if ``until`` is set meanwhile.

        Raises :class:`PodSourceError` when retrying cannot help (forbidden, not found); ValueError
        when the node's policy label (or --isolation-policy) is not a policy, NodeUnreadable when
        the label cannot be read. Nothing is served then."""
        self.store.sync_cards(list(self.cards.values()))
        for name, target in (("pod-watch", lambda: self.node_pods.serve(self._stop)),
                             ("annotations", lambda: self.writer.serve(self._stop))):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        if not self._reconcile_when_ready(until or self._stop):
            return False
        self.policy = resolve_policy(self.config.isolation_policy, self._node_labels())
        if self._isolation_backend is not None:
            self.isolation = NodeIsolation(
                self.policy, self.store, self.pod_cache.get, ContainerResolver(self.config.proc_root),
                self._isolation_backend, self.metrics, self.pods, self.config.isolation_tick_s,
                self.config.isolation_refresh_s, self.config.memory_tolerance_mib)
        self.store.set_meta({"node": self.config.node, "policy": self.policy.value, "kind": "node"})
        self.publisher.enforcement = enforcement(self.policy, self.isolation is not None, self.backend.name,
                                                 self.config.isolation_tick_s)
        self.publisher.publish()
        self.registration.serve()
        self.sample_once()
        loops: list[tuple[str, Callable[[], None]]] = [
            ("health", self._health_loop), ("kubelet-watch", self._watch_loop), ("sampler", lambda: self.sampler.serve(self._stop))]
        if self.slices is not None:
            slices = self.slices
            loops.append(("dra-slices", lambda: slices.serve(self._stop)))
        if self.isolation is not None:
            isolation = self.isolation
            loops.append(("isolation", lambda: isolation.serve(self._stop)))
            log.info("isolation: policy %s, tick %.3f s, processes read from %s", self.policy.value,
                     self.config.isolation_tick_s, self.config.proc_root)
        else:
            log.info("isolation: off (policy %s is advertised but not enforced)", self.policy.value)
        for name, target in loops:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return True

    def _reconcile_when_ready(self, until: threading.Event) -> bool:
        """Kubelet is served only after reconciliation: Allocate answered from a store that still
        holds deleted pods' shares would refuse or double-book cards."""
        delay = 1.0
        while True:
            try:
                self.reconcile()
                return True
            except PodSourceError as exc:
                if not exc.transient:
                    raise
                log.warning("start-up reconciliation: %s; kubelet is not served until the pods of node %s can be "
                            "read; retrying in %.0f s", exc, self.config.node, delay)
            deadline = time.monotonic() + delay
            while (left := deadline - time.monotonic()) > 0:
                if until.wait(min(left, 0.5)):  # short slices: SIGTERM may land on another thread
                    return False
            delay = min(delay * 2, self.config.api_retry_max_s)

    def _node_labels(self) -> dict[str, str]:
        """The node's labels for its policy; unreadable is fatal only when no override is given."""
        try:
            return self.pods.node_labels(self.config.node)
        except Exception as exc:
            if self.config.isolation_policy is not None:
                log.warning("node %s: cannot read its labels (%s); --isolation-policy decides", self.config.node, exc)
                return {}
            raise NodeUnreadable(f"node {self.config.node}: cannot read its label {POLICY_LABEL} for the isolation "
                                 f"policy: {exc} (give --isolation-policy to start without it)") from exc

    def stop(self) -> None:
        self._stop.set()
        self.health.close()
        self.backend.close()
        self.registration.stop()
        if self.slices is not None:
            self.slices.close()
        close = getattr(self.pods, "close", None)
        if close is not None:
            close()  # cuts the pod watch
        for t in self._threads:
            t.join(timeout=5)

    # ---- the loops --------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        released_at = time.monotonic()
        while not self._stop.wait(self.config.watch_interval_s):
            try:
                self.check_kubelet()
            except Exception:  # keep watching: the next tick retries
                log.exception("kubelet watch failed")
            self.publisher.retry_if_due()
            if time.monotonic() - released_at >= self.config.release_interval_s:
                released_at = time.monotonic()
                try:
                    self.release_gone()
                except Exception as exc:  # apiserver away: the next interval retries
                    log.warning("releasing the shares of deleted pods: %s", exc)

    def _health_loop(self) -> None:
        while not self._stop.is_set():
            try:
                events = self.backend.wait_health_events(timeout_s=1.0)
            except BackendError as exc:
                log.warning("health events: %s", exc)
                events = []
            for event in events:
                if event.healthy:
                    self.mark_healthy(event.card_index, event.reason)
                else:
                    self.mark_unhealthy(event.card_index, event.reason)

    def mark_healthy(self, index: int, reason: str) -> None:
        """The backend found the card fit again: back in the pool on both doors, no restart."""
        if not self.health.clear(index):
            return
        log.warning("card %d (%s) healthy again: %s", index, self.cards[index].uuid, reason)
        self.store.set_card_health(index, True, "")
        self.publisher.publish()
        if self.slices is not None:
            self.slices.publish()

    def mark_unhealthy(self, index: int, reason: str) -> None:
        """Until the backend reports the card fit again (a card that raised a fatal XID needs a
        reset first) or the manager restarts."""
        if not self.health.mark(index, reason):
            return
        uuid = self.cards[index].uuid
        log.warning("card %d (%s) unhealthy: %s", index, uuid, reason)
        self.store.set_card_health(index, False, reason)
        self.publisher.publish()
        if self.slices is not None:
            self.slices.publish()
        message = (f"card {index} ({uuid}) of node {self.config.node} is unhealthy ({reason}): no new share is placed on it "
                   "and this pod's share on it may fail; delete the pod to have it placed on a healthy card")
        for namespace, pod, uid in pods_on_card(index, self.store.shares(), self.store.prepared_claims()):
            try:
                self.pods.record_event(namespace, pod, uid, UNHEALTHY_EVENT, message)
            except Exception as exc:  # noqa: BLE001 - the card is out of the pool either way; say so in the log
                log.warning("pod %s/%s on unhealthy card %d: could not record the Event: %s", namespace, pod, index, exc)

    # ---- DeviceService (node/deviceplugin/devices.py), and what tests and benchmarks drive directly ---------
    def wait_devices(self, kind: ResourceKind, seen: int, timeout_s: float) -> tuple[int, list[tuple[str, bool]]]:
        return wait_devices(self.health, kind, seen, timeout_s)

    def allocate(self, kind: ResourceKind, device_ids: tuple[str, ...]) -> ContainerGrant:
        return self.allocator.allocate(kind, device_ids)

    def preferred(self, kind: ResourceKind, available: list[str], must: list[str], size: int) -> list[str]:
        return self.allocator.preferred(kind, available, must, size)

    def prestart(self, kind: ResourceKind, device_ids: tuple[str, ...]) -> None:
        self.allocator.prestart(kind, device_ids)

    def unhealthy(self) -> dict[int, str]:
        return self.health.unhealthy()

    def reconcile(self) -> Plan:
        return self.reconciler.reconcile()

    def release_gone(self) -> dict[str, str]:
        return self.reconciler.release_gone()

    def check_kubelet(self) -> None:
        if self.registration.check_kubelet() and self.publisher.publishes_share_sizes:
            self.publisher.publish()  # a Node the kubelet registered anew lost the share sizes in its status

    def sample_once(self) -> None:
        self.sampler.sample_once()
