"""The extender's verbs, independent of HTTP: bytes in, (status, JSON value) out.

Status codes follow one rule: a malformed request is the client's mistake (400, with the reason);
a well-formed request always gets 200 and an extender/v1 body, whose ``Error`` field (filter,
bind) tells the scheduler that this attempt failed (preempt has no such field: a refused preempt
answers no nodes, so kube-scheduler evicts nothing). A bug of ours is the only source of a 500.
An apiserver that cannot be reached is such a failure, not a bug: filter and bind answer its
reason in ``Error``, prioritize answers no scores (kube-scheduler ignores a failed prioritize).

Trust: the body names a pod, the apiserver says what it is (:mod:`.trust`). Filter and prioritize
work on the apiserver's pod and refuse a body that asks for something else; bind is refused unless
a filter passed that pod (same UID) for that node; filter is refused while ``max_holds`` pods await
their bind. Preempt works on the apiserver's pod too, and names only victims its own watch has on
that node, of a lower priority than the pod's (as the watch has both). A pod past the entries qgpu
keeps of one (kube/podslim.py ``MAX_KEPT_POD_ENTRIES``) is one qgpu cannot see into: filter answers
it unresolvable on every node, naming the pod, the list, its length and the budget; prioritize,
preempt and dra-prioritize have no opinion. Refusals are counted by verb and reason.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from qgpu_runtime.extender.binder import Binder, BindError
from qgpu_runtime.extender.cache import AllocationCache, GroupError, HoldLimit
from qgpu_runtime.extender.dra import CLAIM_WAIT_S, DraView
from qgpu_runtime.extender.trust import PodUnavailable, TrustedPods, UntrustedPod
from qgpu_runtime.extender.wire import (
    BindingArgs,
    ExtenderArgs,
    FilterResult,
    NodeVictims,
    PreemptionArgs,
    WireError,
    encode_binding_result,
    encode_preemption_result,
    encode_priorities_json,
)
from qgpu_runtime.kube.podslim import oversized
from qgpu_runtime.model.requests import CardLimits, RequestError
from qgpu_runtime.serving import RawJSON
from qgpu_runtime.servingcert import CertificateMetrics

log = logging.getLogger(__name__)

Response = tuple[int, Any]


@dataclass
class ExtenderMetrics:
    registry: CollectorRegistry
    latency: Histogram
    requests: Counter
    binds: Counter
    connections: Counter
    nodes: Gauge
    bookings: Gauge
    holds: Gauge
    refused: Counter
    http2_connections: Counter
    commitment_conflicts: Counter
    untrusted_records: Gauge
    evictions: Counter
    unapplied_pods: Gauge
    # the serving certificate's notAfter and reloads (servingcert.py); over TLS only: over plain HTTP
    # a notAfter of 0 would read as expired to every alert on it
    certificate: CertificateMetrics | None = None

    @classmethod
    def create(cls) -> "ExtenderMetrics":
        registry = CollectorRegistry()
        buckets = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
        return cls(
            registry=registry,
            latency=Histogram("qgpu_extender_request_duration_seconds", "Time to answer one extender call",
                              ["verb"], registry=registry, buckets=buckets),
            requests=Counter("qgpu_extender_requests_total", "Extender calls by verb and HTTP status",
                             ["verb", "code"], registry=registry),
            binds=Counter("qgpu_extender_binds_total", "Bind attempts by result", ["result"], registry=registry),
            # kube-scheduler keeps at most 2 idle connections per extender: a count that grows with
            # the binds means concurrent calls open (and handshake) new ones.
            connections=Counter("qgpu_extender_connections", "Connections accepted", registry=registry),
            # kube-scheduler negotiates HTTP/2 when offered (--http2 on): then it keeps one connection
            http2_connections=Counter("qgpu_extender_http2_connections", "Connections that negotiated HTTP/2",
                                      registry=registry),
            nodes=Gauge("qgpu_extender_cached_nodes", "Nodes in the extender's cache", registry=registry),
            bookings=Gauge("qgpu_extender_bookings", "Pods whose cards are booked in the cache", registry=registry),
            holds=Gauge("qgpu_extender_holds", "Pods a filter passed that await their bind", registry=registry),
            refused=Counter("qgpu_extender_refused", "Calls refused by the trust rules",
                            ["verb", "reason"], registry=registry),
            # Each one is a bind that lost a node's Lease to another binder and decided again.
            commitment_conflicts=Counter("qgpu_extender_commitment_conflicts",
                                         "Node commitment writes refused by the apiserver (409), each followed by a "
                                         "fresh decision", registry=registry),
            untrusted_records=Gauge("qgpu_extender_untrusted_records",
                                    "Live pods whose allocation record the extender's key did not sign for them "
                                    "(written by a tenant or edited); they book nothing", registry=registry),
            evictions=Counter("qgpu_extender_unhealthy_card_evictions",
                              "Eviction API calls for pods on failed cards (--evict-on-unhealthy-card) by result: "
                              "evicted, or refused (a PodDisruptionBudget, the apiserver; asked again later)",
                              ["result"], registry=registry),
            unapplied_pods=Gauge("qgpu_extender_unapplied_pods",
                                 "Live pods whose latest watch event the cache could not apply (logged once per pod "
                                 "version); each keeps the state the cache had of it", registry=registry),
        )


FILTER_RESULTS = ("all", "best")


def _refusal(exc: UntrustedPod) -> str:
    """The ``reason`` label of a refused call: the apiserver unreachable, or the pod not trusted."""
    return "apiserver-unavailable" if isinstance(exc, PodUnavailable) else "untrusted-pod"


class ExtenderApp:
    """``filter_result``: "all" answers every feasible node (kube-scheduler then weighs them with
    prioritize and its own plugins); "best" answers only the node the engine chose and now holds,
    so a scheduler configured without prioritizeVerb needs one round trip per pod instead of two
    (HAMi's and gpu-admission's way). Infeasible nodes carry their reasons in both modes."""

    def __init__(self, cache: AllocationCache, binder: Binder | None, limits: CardLimits, metrics: ExtenderMetrics | None = None,
                 filter_result: str = "all", pods: TrustedPods | None = None, dra: DraView | None = None):
        if filter_result not in FILTER_RESULTS:
            raise ValueError(f"filter_result={filter_result!r}: must be one of {', '.join(FILTER_RESULTS)}")
        self.filter_result = filter_result
        self.cache = cache
        # Without an API reader the watch cache alone says which pods exist.
        self.pods = pods or TrustedPods(cache, limits)
        self.binder = binder
        self.limits = limits
        self.metrics = metrics or ExtenderMetrics.create()
        # DRA prioritize: pods whose cards come through ResourceClaims of qgpu's DeviceClasses are
        # scored by where the DRA allocator's first fit would leave each node (extender/dra.py).
        self.dra = dra

    def handle(self, verb: str, body: bytes) -> Response:
        started = time.perf_counter()
        handler = {"filter": self.filter, "prioritize": self.prioritize, "bind": self.bind,
                   "preempt": self.preempt, "dra-prioritize": self.dra_prioritize}.get(verb)
        if handler is None:
            status, doc = 404, {"Error": f"unknown verb {verb!r}; this extender serves filter, prioritize, bind, "
                                         "preempt and dra-prioritize"}
        else:
            try:
                status, doc = handler(body)
            except WireError as exc:
                status, doc = 400, {"Error": str(exc)}
        self.metrics.requests.labels(verb if handler else "unknown", str(status)).inc()
        if handler is not None:
            self.metrics.latency.labels(verb).observe(time.perf_counter() - started)
        return status, doc

    def _request(self, pod: dict[str, Any]) -> Any:
        """``pod`` as the apiserver has it (``self.pods.resolve``), never a body's."""
        return self.cache.requests.of(pod, self.limits)

    def _refuse(self, verb: str, reason: str, message: str) -> None:
        self.metrics.refused.labels(verb, reason).inc()
        log.warning("%s refused: %s", verb, message)

    def _oversized(self, verb: str, pod: dict[str, Any]) -> str | None:
        """Why qgpu cannot judge ``pod`` (kept oversized: kube/podslim.py), counted and logged;
        None for every other pod."""
        over = oversized(pod)
        if over is None:
            return None
        meta = pod.get("metadata") or {}
        message = (f"pod {meta.get('namespace') or 'default'}/{meta.get('name')} lists {over.describe()}: "
                   "qgpu does not place it; split it into pods of fewer containers or claims")
        self._refuse(verb, "oversized-pod", message)
        return message

    def filter(self, body: bytes) -> Response:
        args = ExtenderArgs.decode(body)
        names = args.names
        try:
            pod = self.pods.resolve(args.pod)
        except UntrustedPod as exc:
            self._refuse("filter", _refusal(exc), str(exc))
            return 200, FilterResult([], error=str(exc)).encode(args)
        too_big = self._oversized("filter", pod)
        if too_big is not None:  # its lists are fixed once it exists: no node will do
            return 200, FilterResult([], {}, {n: too_big for n in names}).encode(args)
        try:
            request = self._request(pod)
        except RequestError as exc:
            message = f"invalid GPU request: {exc}"
            return 200, FilterResult([], {}, {n: message for n in names}).encode(args)
        try:
            if not request.wants_gpu:
                self.cache.authorize(pod, names, time.time_ns())
                return 200, FilterResult(names).encode(args)
            outcome = self.cache.filter(pod, request, names, time.time_ns())
        except HoldLimit as exc:
            self._refuse("filter", "hold-limit", str(exc))
            return 200, FilterResult([], error=str(exc)).encode(args)
        except GroupError as exc:  # kube-scheduler's FailedScheduling Event on the pod carries the reason
            return 200, FilterResult([], error=str(exc)).encode(args)
        passed = outcome.passed
        if self.filter_result == "best" and outcome.held is not None:
            passed = [outcome.held]
        return 200, FilterResult(passed, outcome.failed, outcome.unresolvable).encode(args)

    def prioritize(self, body: bytes) -> Response:
        args = ExtenderArgs.decode(body)
        names = args.names
        pod = None
        try:
            pod = self.pods.resolve(args.pod)
            request = None if self._oversized("prioritize", pod) else self._request(pod)
        except UntrustedPod as exc:  # no opinion: kube-scheduler weighs the nodes without us
            self._refuse("prioritize", _refusal(exc), str(exc))
            request = None
        except RequestError:
            request = None
        if request is not None and not request.wants_gpu and self.dra is not None and pod is not None:
            asks = self.dra.demand(pod, CLAIM_WAIT_S)
            if asks:
                scores = self.dra.scores(asks, request, names, self.cache.policy)
                return 200, RawJSON(encode_priorities_json(names, scores))
        if request is None or not request.wants_gpu:
            return 200, RawJSON(encode_priorities_json(names, [0] * len(names)))
        return 200, RawJSON(encode_priorities_json(names, self.cache.prioritize_scores(pod, request, names)))

    def preempt(self, body: bytes) -> Response:
        """ExtenderPreemptionArgs in, ExtenderPreemptionResult out (docs/extender.md, "Preemption").

        For a pod asking no GPU qgpu has no opinion: kube-scheduler's victims come back unchanged.
        Otherwise each node gets qgpu's card-level victims (cache.preempt), and nodes where no set of
        lower-priority pods helps are left out. NumPDBViolations counts qgpu's victims that a
        PodDisruptionBudget protects, as kube-scheduler counts its own (placement/disruption.py)."""
        args = PreemptionArgs.decode(body)
        try:
            pod = self.pods.resolve(args.pod)
            if self._oversized("preempt", pod):  # filter refuses it everywhere: evict nothing for it
                return 200, encode_preemption_result({})
            request = self._request(pod)
        except UntrustedPod as exc:
            self._refuse("preempt", _refusal(exc), str(exc))
            return 200, encode_preemption_result({})
        except RequestError as exc:
            log.info("preempt: invalid GPU request, no victims: %s", exc)
            return 200, encode_preemption_result({})
        if not request.wants_gpu:
            return 200, encode_preemption_result({n: v for n, v in args.victims.items() if v.uids})
        chosen = self.cache.preempt(pod, request, {n: v.uids for n, v in args.victims.items()}, time.time_ns())
        return 200, encode_preemption_result({node: NodeVictims(choice.uids, choice.pdb_violations)
                                               for node, choice in chosen.items()})

    def dra_prioritize(self, body: bytes) -> Response:
        """Prioritize for DRA claim pods only; every other pod gets 0 on every node.

        kube-scheduler sends every pod to an extender entry without managedResources, which is the
        only way a claim pod (it asks no extended resource) reaches an extender. Under the shared
        ``prioritize`` verb a dialect pod would then be scored by both entries, the main entry's
        weight plus this one's; this verb keeps the dialect pods' weight what the main entry says.
        """
        args = ExtenderArgs.decode(body)
        names = args.names
        if self.dra is None:
            return 404, {"Error": "dra-prioritize: this extender was started without --dra-prioritize"}
        try:
            pod = self.pods.resolve(args.pod)
            request = None if self._oversized("dra-prioritize", pod) else self._request(pod)
        except UntrustedPod as exc:
            self._refuse("dra-prioritize", _refusal(exc), str(exc))
            return 200, RawJSON(encode_priorities_json(names, [0] * len(names)))
        except RequestError:
            request = None
        if request is not None and not request.wants_gpu:
            asks = self.dra.demand(pod, CLAIM_WAIT_S)
            if asks:
                return 200, RawJSON(encode_priorities_json(names, self.dra.scores(asks, request, names, self.cache.policy)))
        return 200, RawJSON(encode_priorities_json(names, [0] * len(names)))

    def bind(self, body: bytes) -> Response:
        args = BindingArgs.decode(body)
        if self.binder is not None and not self.cache.synced.is_set():
            # kube-scheduler calls before /readyz says ready. A bind now would choose cards without
            # the records on the pods, and prune node commitments of pods it has not listed yet.
            self.metrics.binds.labels("failed").inc()
            return 200, encode_binding_result("the extender's node and pod caches are not synced yet; "
                                              "binding now could double-book cards, retry shortly")
        refusal = self.cache.bind_refusal(f"{args.pod_namespace}/{args.pod_name}", args.pod_uid, args.node)
        if refusal is not None:
            self.metrics.binds.labels("refused").inc()
            self._refuse("bind", "not-filtered", refusal)
            return 200, encode_binding_result(refusal)
        if self.binder is None:
            return 200, encode_binding_result("this extender runs without an API connection and cannot bind")
        try:
            self.binder.bind(args.pod_namespace, args.pod_name, args.pod_uid, args.node)
        except BindError as exc:
            self.metrics.binds.labels("failed").inc()
            log.info("bind failed: %s", exc)
            return 200, encode_binding_result(str(exc))
        self.metrics.binds.labels("bound").inc()
        return 200, encode_binding_result()

    def refresh_gauges(self) -> None:
        with self.cache.lock:
            state = self.cache.state()
            self.metrics.nodes.set(state.node_count)
            self.metrics.bookings.set(len(state.bookings))
        self.metrics.holds.set(self.cache.holds())
        self.metrics.untrusted_records.set(len(self.cache.untrusted()))
        self.metrics.unapplied_pods.set(len(self.cache.unapplied()))
