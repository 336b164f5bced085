"""The node manager's isolation loop: the standalone engine, fed with the node's containers.

Every tick (50 ms by default) the loop lets the isolation engine sample the cards, attribute
each GPU process to its tenant (node/containers.py: cgroup → pod UID + container ID → the store's
shares of that container, booked by the device plugin or through a ResourceClaim it references;
node/tenants.py), judge with the pure control law under the node's policy, and hold/resume the
containers' process groups (SIGSTOP/SIGCONT) or stop one caught over its memory quota. The engine,
its watchdog and the loop timing are the same objects the standalone manager uses
(isolation/runner.py); only where workloads come from differs.

The policy is the node's: the label ``tke.cloud.tencent.com/qgpu-schedule-policy`` read once at
start, unless ``--isolation-policy`` overrides it (long names and be/fs/bs alike).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from qgpu_runtime.gpu.nvml import NvmlBackend
from qgpu_runtime.gpu.types import GpuBackend
from qgpu_runtime.isolation.control import Usage
from qgpu_runtime.isolation.engine import Actuator, Sampler, TickReport, Workload
from qgpu_runtime.isolation.nvml_sampler import NvmlSampler
from qgpu_runtime.isolation.policy import POLICY_LABEL, Policy, parse_policy, policy_of_node
from qgpu_runtime.isolation.runner import build_engine, run_every
from qgpu_runtime.isolation.signals import SignalActuator
from qgpu_runtime.isolation.watchdog import IsolationEvent
from qgpu_runtime.node.containers import ContainerResolver
from qgpu_runtime.node.metrics import EnforcedContainer, IsolationSnapshot, ManagerMetrics
from qgpu_runtime.node.store import Store

log = logging.getLogger("qgpu.node.isolation")

# Builds the sampler and actuator once the resolver exists (both need its callbacks).
IsolationBackend = Callable[[ContainerResolver], tuple[Sampler, Actuator]]


def resolve_policy(override: str | None, labels: Mapping[str, str]) -> Policy:
    """``--isolation-policy`` when given, else the node label (best-effort when it is absent).

    A bad label value is an error naming the label and the value, unless the flag overrides it.
    """
    if override is None:
        return policy_of_node(labels)
    chosen = parse_policy(override, field="--isolation-policy")
    raw = labels.get(POLICY_LABEL)
    if raw is not None:
        try:
            from_label: Policy | None = policy_of_node(labels)
        except ValueError:
            from_label = None
        if from_label is not chosen:
            log.warning("--isolation-policy %s overrides the node label %s=%s", chosen.value, POLICY_LABEL, raw)
    return chosen


@dataclass(frozen=True)
class Enforcement:
    """Whether this node enforces the cards' shares, and why not (the Node condition
    names.SHARES_ENFORCED_CONDITION: reason in CamelCase, message for people)."""

    enforced: bool
    reason: str
    message: str


def enforcement(policy: Policy, isolation: bool, backend: str, tick_s: float) -> Enforcement:
    """Pure: what the manager started with says about enforcement. Memory caps hold under every
    policy while the isolation loop runs; compute shares under fixed-share and burst-share only."""
    if not isolation:
        return Enforcement(False, "IsolationOff", f"the manager runs with --no-isolation: policy {policy.value} is "
                           "advertised to the scheduler, but neither compute shares nor memory caps are enforced on this node")
    if backend != NvmlBackend.name:
        return Enforcement(False, "SimulatedGPUs", f"the cards are simulated (--gpu-backend {backend}): policy "
                           f"{policy.value} acts on simulated usage only, no real card is shared")
    if policy is Policy.BEST_EFFORT:
        return Enforcement(False, "PolicyBestEffort", "policy best-effort: containers share the cards without compute "
                           f"limits; memory caps are enforced every {tick_s:g} s")
    return Enforcement(True, "Enforced", f"policy {policy.value}: compute shares and memory caps are enforced every {tick_s:g} s")


class EventRecorder(Protocol):
    def record_event(self, namespace: str, pod: str, pod_uid: str, reason: str, message: str) -> None: ...


class PodEventSink:
    """Watchdog events as Kubernetes Events on the offending pod (through the pod source)."""

    def __init__(self, recorder: EventRecorder, refs: Callable[[str], tuple[str, str, str]]) -> None:
        self._recorder = recorder
        self._refs = refs

    def emit(self, event: IsolationEvent) -> None:
        namespace, pod, uid = self._refs(event.key)
        try:
            self._recorder.record_event(namespace, pod, uid, event.reason, event.message)
        except Exception as exc:  # the log line and the metric already carry it
            log.warning("pod %s/%s: could not record event %s: %s", namespace, pod, event.reason, exc)


class BackendSampler:
    """Per-process samples of a :class:`GpuBackend` (the simulated one on hosts without NVML).

    Each process's SM percent is taken as its use over the tick; NVML itself goes through
    :class:`NvmlSampler`, whose estimator handles the driver's sparse samples. Either way the
    engine reads the samples the metrics read (the backend's ``sample`` or its NVML sampler).
    """

    def __init__(self, backend: GpuBackend, owner: Callable[[int], str | None]) -> None:
        self._backend = backend
        self._owner = owner

    def sample(self, workloads: Sequence[Workload], dt_s: float, held: frozenset[str],
               slotted: Mapping[int, frozenset[str]] | None = None) -> Mapping[int, Mapping[str, Usage]]:
        wanted = {w.key for w in workloads}
        out: dict[int, dict[str, Usage]] = {}
        for card in self._backend.sample():
            for proc in card.processes:
                key = self._owner(proc.pid)
                if key is None or key not in wanted:
                    continue
                before = out.setdefault(card.index, {}).get(key, Usage(0.0, 0))
                out[card.index][key] = Usage(before.used_milli + proc.sm_util_pct * 10.0, before.memory_mib + proc.memory_mib)
        return out


def default_backend(backend: GpuBackend) -> IsolationBackend:
    """On real cards, a reader of the NVML backend's own process sampler (the one its metrics
    samples read) through the estimator; the backend's samples otherwise; duty cycling through the
    containers' process groups either way."""

    def build(resolver: ContainerResolver) -> tuple[Sampler, Actuator]:
        sampler: Sampler
        if isinstance(backend, NvmlBackend):
            sampler = NvmlSampler(backend.processes.reader(), resolver.owner)
        else:
            sampler = BackendSampler(backend, resolver.owner)
        return sampler, SignalActuator(resolver.groups, running=resolver.running)

    return build


class NodeIsolation:
    """One engine for the node; ``serve`` runs it on a thread until the manager stops."""

    def __init__(
        self,
        policy: Policy,
        store: Store,
        pods: Callable[[float], list[dict[str, Any]]],
        resolver: ContainerResolver,
        backend: IsolationBackend,
        metrics: ManagerMetrics,
        events: EventRecorder,
        tick_s: float = 0.05,
        refresh_s: float = 1.0,
        memory_tolerance_mib: int = 0,
    ) -> None:
        """``pods(max_age_s)`` lists the node's pods, from a cache no older than ``max_age_s``."""
        self.policy = policy
        self.resolver = resolver
        self.tick_s = tick_s
        self._store = store
        self._pods = pods
        self._metrics = metrics
        self._refresh_s = refresh_s
        self._last_refresh: float | None = None
        self._workloads: list[Workload] = []
        self._last_error: str | None = None
        sampler, self._actuator = backend(resolver)
        sink = PodEventSink(events, self._pod_of)
        self.engine = build_engine(policy, sampler, self._actuator, metrics.registry, sink, memory_tolerance_mib)

    def _pod_of(self, key: str) -> tuple[str, str, str]:
        """The pod an event about ``key`` goes to: a tenant of several pods (one claim shared by
        them) reports on its first."""
        first = self.resolver.ref(key).members[0]
        return first.namespace, first.pod, first.pod_uid

    def refresh(self, pods_max_age_s: float) -> None:
        """Re-read the store's shares and the node's pods (new containers, ended pods)."""
        self.resolver.update(self._pods(pods_max_age_s), self._store.shares(), self._store.prepared_claims())

    def tick(self, dt_s: float, now: float) -> TickReport:
        due = self._last_refresh is None or now - self._last_refresh >= self._refresh_s
        if due:
            self._last_refresh = now
            # a process of a booked pod whose container the pod list did not show yet: ask the API
            # now rather than leave a new container unthrottled until the cache expires
            try:
                self.refresh(0.0 if self.resolver.unknown_containers else float("inf"))
            except Exception as exc:  # keep enforcing what is known; retried after refresh_s
                log.warning("isolation: reading pods or shares failed, keeping the last known containers: %s", exc)
        # asked every tick: a pod being deleted is left unheld for a window that ends on time
        self._workloads = self.resolver.workloads()
        self.resolver.begin_sample()
        before = self.engine.held
        report = self.engine.tick(self._workloads, dt_s)
        reap = getattr(self._actuator, "reap", None)
        if reap is not None:
            reap()
        if report.failed:  # logged by the engine; the other workloads were acted on
            self._metrics.tick_errors.inc()
        new_holds = len(report.held - before)
        if new_holds:
            self._metrics.holds.inc(new_holds)
        self._metrics.isolation.update(self._snapshot(report))
        return report

    def _snapshot(self, report: TickReport) -> IsolationSnapshot:
        allowance: dict[str, dict[int, float | None]] = {}
        for card, verdicts in report.verdicts.items():
            for v in verdicts:
                allowance.setdefault(v.key, {})[card] = v.rate_milli
        rows = []
        for w in self._workloads:
            ref = self.resolver.ref(w.key)
            charged = {card: u[w.key].used_milli for card, u in report.usage.items() if w.key in u}
            rows.append(EnforcedContainer(ref.namespace, ref.pod, ref.container, w.key in report.held,
                                          allowance.get(w.key, {}), charged))
        return IsolationSnapshot(self.policy.value, tuple(rows), len(self.resolver.unmanaged))

    def tick_or_log(self, dt_s: float, now: float) -> None:
        try:
            self.tick(dt_s, now)
        except Exception as exc:  # one bad tick (NVML hiccup, a process vanishing mid-read) must not end isolation
            self._metrics.tick_errors.inc()
            # 20 ticks a second: the same failure is logged in full once, then counted
            if repr(exc) != self._last_error:
                log.exception("isolation tick failed (repeats are counted in qgpu_isolation_tick_errors_total)")
            self._last_error = repr(exc)
        else:
            self._last_error = None

    def serve(self, stop: threading.Event) -> None:
        try:
            run_every(self.tick_s, stop, self.tick_or_log, time.monotonic)
        finally:
            self.close()

    def close(self) -> None:
        """Resume everything held: a manager that exits never leaves a container frozen."""
        self.engine.close()
