"""The node manager: GPUs, device plugins, allocation store, health, metrics — wired together.

Threads: one gRPC server per resource (kubelet calls in), a health watcher (NVML/XID events), a
kubelet watcher (re-registers when kubelet restarts and re-creates its socket), a sampler
(metrics, once per interval) and, when given an isolation backend, the isolation loop
(node/enforcer.py: the node's policy enforced on its containers every tick). Allocate is
serialised by one lock: kubelet admits one pod at a time anyway, and the matching rule needs a
consistent view of what was already served.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from qgpu_runtime.contract.names import ASSIGNED, finished
from qgpu_runtime.contract.record import assigned
from qgpu_runtime.gpu.types import BackendError, CardInfo, GpuBackend
from qgpu_runtime.isolation.policy import POLICY_LABEL, Policy, parse_policy
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD
from qgpu_runtime.node import matching, reconcile
from qgpu_runtime.node.containers import ContainerResolver
from qgpu_runtime.node.devices import AllocateRefused
from qgpu_runtime.node.enforcer import IsolationBackend, NodeIsolation, resolve_policy
from qgpu_runtime.node.metrics import ManagerMetrics, build_snapshot
from qgpu_runtime.node.nodeinfo import node_metadata
from qgpu_runtime.node.plugin import PluginServer
from qgpu_runtime.node.podresources import DEFAULT_SOCKET, list_held
from qgpu_runtime.node.pods import PodSource, PodSourceError
from qgpu_runtime.node.resources import ResourceKind, card_of_device
from qgpu_runtime.node.response import ContainerGrant, GrantError, build_grant, quota_json, store_rows
from qgpu_runtime.node.store import Share, Store
from qgpu_runtime.placement.commitments import CardUse, Commitment, over_commitment

log = logging.getLogger(__name__)

NODE_PUBLISH_RETRY_S = 10.0


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

    def __post_init__(self) -> None:
        if self.isolation_policy is not None:
            parse_policy(self.isolation_policy, field="--isolation-policy")
        if self.sample_interval_s <= 0:
            raise ValueError(f"--sample-interval: {self.sample_interval_s} must be positive")
        if not 0.005 <= self.isolation_tick_s <= 5:
            raise ValueError(f"--tick: {self.isolation_tick_s!r} is not allowed: must be 0.005..5 seconds")
        if self.memory_tolerance_mib < 0:
            raise ValueError(f"--memory-tolerance: {self.memory_tolerance_mib!r} is not allowed: must be >= 0")

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / "kubelet.sock"


class NodeUnreadable(RuntimeError):
    """The node object (its policy label) could not be read at start."""


@dataclass
class _Health:
    unhealthy: dict[int, str] = field(default_factory=dict)
    version: int = 0


class NodeManager:
    def __init__(self, config: ManagerConfig, backend: GpuBackend, store: Store, pods: PodSource,
                 clock_ns: Callable[[], int] = time.time_ns, isolation: IsolationBackend | None = None) -> None:
        """``isolation`` None: device plugin, store and metrics only (nothing is throttled)."""
        self.config = config
        self.backend = backend
        self.store = store
        self.pods = pods
        self.clock_ns = clock_ns
        self.cards: dict[int, CardInfo] = {c.index: c for c in backend.cards()}
        self.metrics = ManagerMetrics.create(config.node)
        self._health = _Health()
        self._health_changed = threading.Condition()
        self._allocate_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.plugins = [PluginServer(k, self, config.plugin_dir) for k in config.resources]
        self._kubelet_inode: int | None = None
        self._pods_cache: tuple[float, list[dict]] | None = None
        self._pods_lock = threading.Lock()
        self._publish_due: float | None = None  # monotonic time of the next node-label attempt; None: published
        self._isolation_backend = isolation
        self.isolation: NodeIsolation | None = None
        self.policy = Policy.BEST_EFFORT

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, until: threading.Event | None = None) -> bool:
        """Reconcile, publish, serve kubelet. While the pods cannot be read (apiserver down) it waits
        and retries; it returns False, having served nothing, if ``until`` is set meanwhile.

        Raises :class:`PodSourceError` when retrying cannot help (forbidden, not found); ValueError
        when the node's policy label (or --isolation-policy) is not a policy, NodeUnreadable when
        the label cannot be read, NvmlUnavailable when isolation needs NVML and cannot have it.
        Nothing is served then."""
        self.store.sync_cards(list(self.cards.values()))
        if not self._reconcile_when_ready(until or self._stop):
            return False
        self.policy = resolve_policy(self.config.isolation_policy, self._node_labels())
        if self._isolation_backend is not None:  # before serving anything: NVML may be missing
            self.isolation = NodeIsolation(
                self.policy, self.store, self._pods_cached, ContainerResolver(self.config.proc_root),
                self._isolation_backend, self.metrics, self.pods, self.config.isolation_tick_s,
                self.config.isolation_refresh_s, self.config.memory_tolerance_mib)
        self.store.set_meta({"node": self.config.node, "policy": self.policy.value, "kind": "node"})
        self._publish_node()
        self.config.plugin_dir.mkdir(parents=True, exist_ok=True)
        for plugin in self.plugins:
            plugin.start()
        self._register_all()
        self.sample_once()
        loops: list[tuple[str, Callable[[], None]]] = [
            ("health", self._health_loop), ("kubelet-watch", self._watch_loop), ("sampler", self._sample_loop)]
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
        with self._health_changed:
            self._health_changed.notify_all()
        self.backend.close()
        for plugin in self.plugins:
            plugin.stop()
        for t in self._threads:
            t.join(timeout=5)

    # ---- kubelet registration ---------------------------------------------------------------
    def _kubelet_identity(self) -> int | None:
        try:
            return os.stat(self.config.kubelet_socket).st_ino
        except FileNotFoundError:
            return None

    def _register_all(self) -> bool:
        inode = self._kubelet_identity()
        if inode is None:
            log.info("kubelet socket %s absent; will register when it appears", self.config.kubelet_socket)
            return False
        try:
            for plugin in self.plugins:
                plugin.register(self.config.kubelet_socket)
        except Exception as exc:  # grpc.RpcError and OSError alike: retry on the next tick
            log.warning("registration with kubelet failed: %s; retrying", exc)
            return False
        self._kubelet_inode = inode
        log.info("registered %s with kubelet", ", ".join(p.kind.name for p in self.plugins))
        return True

    def _watch_loop(self) -> None:
        released_at = time.monotonic()
        while not self._stop.wait(self.config.watch_interval_s):
            try:
                self.check_kubelet()
            except Exception:  # keep watching: the next tick retries
                log.exception("kubelet watch failed")
            if self._publish_due is not None and time.monotonic() >= self._publish_due:
                self._publish_node()
            if time.monotonic() - released_at >= self.config.release_interval_s:
                released_at = time.monotonic()
                try:
                    self.release_gone()
                except Exception as exc:  # apiserver away: the next interval retries
                    log.warning("releasing the shares of deleted pods: %s", exc)

    def check_kubelet(self) -> None:
        """Serve again and re-register when kubelet restarted (new socket) or our sockets vanished."""
        inode = self._kubelet_identity()
        dead = [p for p in self.plugins if not p.alive()]
        if inode is not None and (inode != self._kubelet_inode or dead):
            for plugin in dead:
                plugin.stop()
                plugin.start()
            self._register_all()

    # ---- health -----------------------------------------------------------------------------
    def _health_loop(self) -> None:
        while not self._stop.is_set():
            try:
                events = self.backend.wait_health_events(timeout_s=1.0)
            except BackendError as exc:
                log.warning("health events: %s", exc)
                events = []
            for event in events:
                self.mark_unhealthy(event.card_index, event.reason)

    def mark_unhealthy(self, index: int, reason: str) -> None:
        """Sticky until restart: a card that raised a fatal XID needs a reset before reuse."""
        with self._health_changed:
            if index in self._health.unhealthy or index not in self.cards:
                return
            self._health.unhealthy[index] = reason
            self._health.version += 1
            self._health_changed.notify_all()
        log.warning("card %d (%s) unhealthy: %s", index, self.cards[index].uuid, reason)
        self.store.set_card_health(index, False, reason)
        self._publish_node()

    def unhealthy(self) -> dict[int, str]:
        with self._health_changed:
            return dict(self._health.unhealthy)

    def wait_devices(self, kind: ResourceKind, seen: int, timeout_s: float) -> tuple[int, list[tuple[str, bool]]]:
        """(health version, [(device ID, healthy)]); blocks up to ``timeout_s`` while unchanged."""
        with self._health_changed:
            if seen == self._health.version and not self._stop.is_set():
                self._health_changed.wait(timeout_s)
            version, bad = self._health.version, set(self._health.unhealthy)
        return version, [(d, not bad.intersection(cards)) for d, cards in kind.advertised(self.cards.values()).items()]

    # ---- allocation -------------------------------------------------------------------------
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
        bad = self.unhealthy()
        advertised = kind.advertised(self.cards.values())
        for d in device_ids:
            sick = [c for c in advertised[d] if c in bad]
            if sick:
                raise AllocateRefused(f"device {d!r} is on card {sick[0]}, which is unhealthy ({bad[sick[0]]})")
        with self._allocate_lock:
            try:
                pods = self.pods.pods_on_node(self.config.node)
            except Exception as exc:
                raise AllocateRefused(f"cannot read the pods of node {self.config.node}: {exc}") from exc
            served = {(g.pod_uid, g.container, g.resource) for g in self.store.grants()}
            try:
                m = matching.match(self.config.node, kind.name, len(device_ids), pods, served)
                grant = build_grant(m, self.cards, self.policy.value, self.config.state_dir,
                                    self.config.pass_device_specs)
            except (matching.NoMatch, GrantError) as exc:
                raise AllocateRefused(str(exc)) from exc
            sick = [s.index for s in m.share.shares if s.index in bad]
            if sick:
                raise AllocateRefused(f"pod {m.namespace}/{m.pod} container {m.container}: record names card(s) "
                                      f"{sick}, unhealthy ({', '.join(bad[i] for i in sick)})")
            problems = over_commit(m, self.cards, self.store.shares(), pods)
            if problems:
                raise AllocateRefused(f"pod {m.namespace}/{m.pod} container {m.container}: its record would over-commit "
                                      f"this node: {'; '.join(problems)} (live pods of the node already hold it; "
                                      "two binders disagreed — the pod must be scheduled again)")
            _write_atomic(Path(grant.config_host_dir) / "quota.json", quota_json(grant))
            row, shares = store_rows(m, kind.name, device_ids, self.clock_ns())
            self.store.record(row, shares)  # durable before kubelet hears back
            done = assigned(m.pod_obj)
            if m.container not in done:
                try:
                    self.pods.patch_pod_annotations(m.namespace, m.pod, {ASSIGNED: _json_list(done + [m.container])})
                except Exception as exc:  # the store is authoritative; reconciliation re-patches
                    log.warning("pod %s/%s: could not write %s: %s", m.namespace, m.pod, ASSIGNED, exc)
        log.info("Allocate %s x%d -> %s/%s container %s cards %s", kind.name, len(device_ids), m.namespace, m.pod,
                 m.container, [s.index for s in m.share.shares])
        return grant

    def preferred(self, kind: ResourceKind, available: list[str], must: list[str], size: int) -> list[str]:
        """Steer kubelet to device IDs on the cards the predicted container's record names."""
        cards: list[int] = []
        try:
            with self._allocate_lock:
                pods = self.pods.pods_on_node(self.config.node)
                served = {(g.pod_uid, g.container, g.resource) for g in self.store.grants()}
            m = matching.match(self.config.node, kind.name, size, pods, served)
            cards = [s.index for s in m.share.shares]
        except matching.NoMatch:
            pass  # Allocate will refuse with the reason; any devices do for the preference
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

    # ---- reconciliation ---------------------------------------------------------------------
    def reconcile(self) -> reconcile.Plan:
        pods = self.pods.pods_on_node(self.config.node)
        try:
            held = list_held(self.config.pod_resources_socket)
        except Exception as exc:
            log.warning("pod-resources unavailable, reconciling with the API only: %s", exc)
            held = None
        p = reconcile.plan(self.store.grants(), self.store.shares(), pods, held)
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
        across the listing and the release keeps a pod created meanwhile from being released."""
        with self._allocate_lock:
            pods = self.pods.pods_on_node(self.config.node)
            gone = reconcile.plan(self.store.grants(), self.store.shares(), pods, None).release_pods
            if gone:
                self.store.release_pods(gone)
        for uid, why in gone.items():
            log.info("release pod %s: %s", uid, why)
        if gone:
            self._remove_stale_container_dirs(pods)
        return gone

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

    # ---- node metadata and metrics ----------------------------------------------------------
    def _publish_node(self) -> None:
        if not self.config.label_node:
            return
        labels, notes = node_metadata(list(self.cards.values()), self.unhealthy(), self.policy.value)
        try:
            self.pods.patch_node(self.config.node, labels, notes)
        except Exception as exc:  # retried from the kubelet watcher until it lands
            self._publish_due = time.monotonic() + NODE_PUBLISH_RETRY_S
            log.warning("node %s: could not write GPU labels/annotations (retrying in %.0f s): %s",
                        self.config.node, NODE_PUBLISH_RETRY_S, exc)
            return
        self._publish_due = None

    def _pods_cached(self, max_age_s: float) -> list[dict]:
        """The node's pods, listed again when the cached list is older than ``max_age_s`` (or
        ``--pod-refresh``); the metrics sampler and the isolation loop share one list."""
        now = time.monotonic()
        with self._pods_lock:
            cached = self._pods_cache
            if cached is not None and now - cached[0] < min(max_age_s, self.config.pod_refresh_s):
                return cached[1]
            pods = self.pods.pods_on_node(self.config.node)
            self._pods_cache = (now, pods)
            return pods

    def _pods_for_metrics(self) -> list[dict]:
        try:
            return self._pods_cached(self.config.pod_refresh_s)
        except Exception as exc:
            log.warning("metrics: listing pods failed: %s", exc)
            return self._pods_cache[1] if self._pods_cache else []

    def sample_once(self) -> None:
        try:
            usage = self.backend.sample()
        except BackendError as exc:
            log.warning("sampling: %s", exc)
            usage = ()
        snap = build_snapshot(self.config.node, list(self.cards.values()), self.unhealthy(), usage,
                              self.store.shares(), self._pods_for_metrics())
        self.metrics.collector.update(snap)

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.config.sample_interval_s):
            try:
                self.sample_once()
            except Exception:  # a bad sample must not end sampling for the life of the process
                log.exception("metrics sample failed")


def over_commit(m: matching.Match, cards: dict[int, CardInfo], shares: list[Share], pods: list[dict]) -> list[str]:
    """Why granting ``m``'s cards would put a card over its capacity, given the shares of the node's
    live pods in the store (deleted and finished pods no longer hold theirs); empty when it fits.

    The node is the last line of defence: the extender's commitments keep binders from promising
    a card twice, and this refuses a record that does so anyway (an older extender, a binder
    running without commitments, a record written by hand)."""
    live = {str((p.get("metadata") or {}).get("uid", "")) for p in pods
            if not finished(p)}
    held = [Commitment(f"{s.workload_id}/{s.container}", f"{s.namespace}/{s.workload}", 0,
                       (CardUse(s.card_index, s.core_milli, s.memory_mib, s.core_milli >= CORE_MILLI_PER_CARD),))
            for s in shares if s.workload_id in live and (s.workload_id, s.container) != m.key]
    mine = Commitment(f"{m.pod_uid}/{m.container}", f"{m.namespace}/{m.pod}", 0, tuple(
        CardUse(s.index, s.core_milli, s.memory_mib, s.core_milli >= CORE_MILLI_PER_CARD) for s in m.share.shares))
    return over_commitment({i: c.memory_mib for i, c in cards.items()}, held, mine)


def _json_list(values: list[str]) -> str:
    import json

    return json.dumps(sorted(set(values)))


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
