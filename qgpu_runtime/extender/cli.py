"""`qgpu extender serve`: the kube-scheduler extender (filter, prioritize, bind) over HTTPS.

Wiring only: API client → cache fed by watches → verbs → HTTP server, plus the expiry loop.

HTTPS with client certificates is the default and plain HTTP the exception: whoever can call
``/bind`` can bind any pod, so only kube-scheduler (holding a certificate the client CA signed)
may call the verbs. Plain HTTP needs ``--insecure-plain-http`` and a loopback address, where only
processes of the same host (kube-scheduler with host networking) can reach it.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import signal
import socket
import threading
from typing import Any

from kubernetes.config import ConfigException
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from qgpu_runtime.contract.cliflags import address_problem, label_problem, printable_problem
from qgpu_runtime.contract.largestcard import add_largest_card_argument, card_limits
from qgpu_runtime.contract.names import BINDERS
from qgpu_runtime.contract.signature import RecordSigner, SigningKeyError
from qgpu_runtime.extender.app import ExtenderApp, ExtenderMetrics
from qgpu_runtime.extender.binder import Binder
from qgpu_runtime.extender.cache import DEFAULT_MAX_HOLDS, AllocationCache
from qgpu_runtime.extender.commitments import LeaseCommitments
from qgpu_runtime.extender.dra import DraView
from qgpu_runtime.extender.evictor import UnhealthyCardEvictor
from qgpu_runtime.extender.groups import (
    DEFAULT_GROUP_SETTLE_S,
    DEFAULT_GROUP_TIMEOUT_S,
    MAX_GROUP_SETTLE_S,
    MAX_GROUP_TIMEOUT_S,
)
from qgpu_runtime.extender.presence import MODES
from qgpu_runtime.extender.trust import TrustedPods
from qgpu_runtime.extender.watch import CacheFeeder, expire_loop
from qgpu_runtime.kube.client import api_client
from qgpu_runtime.kube.leasedoc import LeaseDocuments
from qgpu_runtime.placement.policies import make_policy
from qgpu_runtime.serving import JsonServer, Routes
from qgpu_runtime.servingcert import CertificateError, CertificateMetrics

PRIORITIES = ("binpack", "spread", "frag")
PRESENCE_LABELS = {"app.kubernetes.io/managed-by": "qgpu", "app.kubernetes.io/component": "binders"}
DEFAULT_EVICT_PERIOD_S = 2.0
MAX_MAX_HOLDS = 100_000
"""--max-holds: a hold is a pod between filter and bind; kube-scheduler binds a few hundred pods a
second, so 100,000 held at once is far past any real backlog."""
MAX_ASSUME_TIMEOUT_S = 3600.0
"""--assume-timeout: a Binding follows its filter within seconds; inf or NaN would keep a record
that never got one holding its cards for ever."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = sub.add_parser("serve", help="serve filter, prioritize and bind for kube-scheduler")
    serve.add_argument("--port", type=int, default=12345, help="listen port (default 12345)")
    serve.add_argument("--address", default="0.0.0.0", help="listen address (default all interfaces)")
    serve.add_argument("--priority", choices=PRIORITIES, default="binpack",
                       help="node policy: binpack fills nodes and cards first, spread balances, frag minimises fragmentation")
    serve.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster service account)")
    serve.add_argument("--tls-cert-file", default=None, help="serve HTTPS with this certificate (PEM); required "
                       "unless --insecure-plain-http")
    serve.add_argument("--tls-private-key-file", "--tls-key-file", dest="tls_private_key_file", default=None,
                       help="private key of --tls-cert-file (PEM)")
    serve.add_argument("--client-ca-file", default=None,
                       help="CA (PEM) that signed kube-scheduler's client certificate; only its clients may call "
                            "filter, prioritize and bind (required with HTTPS)")
    serve.add_argument("--insecure-plain-http", action="store_true",
                       help="serve plain HTTP without client authentication; refused unless --address is loopback")
    serve.add_argument("--http2", choices=("on", "off"), default="on",
                       help="offer HTTP/2 over TLS (ALPN), which kube-scheduler takes: one connection instead of a TLS "
                            "handshake per concurrent call (default on; off: HTTP/1.1 only)")
    serve.add_argument("--max-holds", type=int, default=DEFAULT_MAX_HOLDS,
                       help=f"at most this many pods hold cards between filter and bind (default {DEFAULT_MAX_HOLDS})")
    serve.add_argument("--max-holds-per-namespace", type=int, default=None, metavar="N",
                       help="at most this many of them from one namespace (default: half of --max-holds, rounded up); "
                            "at --max-holds, a pod of a namespace holding fewer takes the oldest hold of the one holding most")
    serve.add_argument("--assume-timeout", type=float, default=60.0,
                       help="seconds an allocation record may wait for its Binding before it is released (default 60)")
    serve.add_argument("--group-timeout", type=float, default=DEFAULT_GROUP_TIMEOUT_S,
                       help="seconds the held placements of an incomplete T9k group (scheduler.tensorstack.dev/"
                            f"group-name) are kept before they are released (default {DEFAULT_GROUP_TIMEOUT_S:g}, "
                            f"at most {MAX_GROUP_TIMEOUT_S:g}); the group then rests as long before it holds again")
    serve.add_argument("--group-settle", type=float, default=DEFAULT_GROUP_SETTLE_S,
                       help="seconds a T9k group whose pods do not state its size (qgpu.io/group-min-member) waits, "
                            "after its newest member appeared, before it counts as complete, so pods a controller is "
                            f"still creating join it (default {DEFAULT_GROUP_SETTLE_S:g}, 0 to 60, below "
                            "--group-timeout; 0: no wait)")
    serve.add_argument("--filter-result", choices=("all", "best"), default="all",
                       help="filter answers every feasible node (all, default) or only the chosen one (best: one round "
                            "trip per pod when the scheduler is configured without prioritizeVerb)")
    # node commitments (issue 11 §5): binds safe across extender processes
    serve.add_argument("--node-commitments", nargs="?", const="always", default="auto", choices=MODES,
                       metavar="{always,auto,off}",
                       help="commit binds through a per-node Lease that the apiserver arbitrates, so two extenders "
                            "or schedulers never over-commit a card: always; auto (default) only while another "
                            "binder is live, as the binders' Lease qgpu-binders says; off only with one active "
                            "extender, e.g. under leader election. A bare --node-commitments means always")
    serve.add_argument("--no-node-commitments", dest="node_commitments", action="store_const", const="off",
                       help="the same as --node-commitments=off (the earlier spelling)")
    serve.add_argument("--binder-identity", default=None, metavar="NAME",
                       help="this extender's entry in the binders' Lease (default: host name, process id and a random "
                            "suffix, unique per process)")
    serve.add_argument("--commitment-namespace", default="qgpu-system",
                       help="namespace of the per-node commitment Leases qgpu-node.<node> (default qgpu-system)")
    serve.add_argument("--dra-prioritize", action=argparse.BooleanOptionalAction, default=False,
                       help="also score pods whose GPUs come through ResourceClaims of qgpu's DeviceClasses "
                            "(watches ResourceSlices, ResourceClaims and ResourceClaimTemplates: needs list and "
                            "watch on them); configure kube-scheduler with a prioritize-only extender entry for "
                            "them (docs/dra.md)")
    serve.add_argument("--evict-on-unhealthy-card", action=argparse.BooleanOptionalAction, default=False,
                       help="evict (Eviction API, PodDisruptionBudgets honoured) the pods whose signed records hold a "
                            "card that its node marks unhealthy, on device-plugin pools; a pod tolerating "
                            "gpu.qgpu.io/unhealthy (operator Exists, effect NoExecute or none) stays, for its "
                            "tolerationSeconds if set; needs create on pods/eviction (docs/operations.md)")
    serve.add_argument("--evict-period", type=float, default=DEFAULT_EVICT_PERIOD_S,
                       help="seconds between two looks for pods on failed cards with --evict-on-unhealthy-card "
                            f"(default {DEFAULT_EVICT_PERIOD_S:g}, 0.1 to 60)")
    add_largest_card_argument(serve)
    serve.add_argument("--record-signing-key", metavar="FILE", default=None,
                       help="Ed25519 private key (PEM) the extender signs every allocation record with; node "
                            "managers and the cache believe only records it signed (required)")
    serve.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _check(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        raise SystemExit(f"qgpu extender serve: --port {args.port}: must be within 1..65535")
    tls_flags = {"--tls-cert-file": args.tls_cert_file, "--tls-private-key-file": args.tls_private_key_file,
                 "--client-ca-file": args.client_ca_file}
    if args.insecure_plain_http:
        given = [flag for flag, value in tls_flags.items() if value]
        if given:
            raise SystemExit(f"qgpu extender serve: --insecure-plain-http and {', '.join(given)}: "
                             "choose HTTPS or plain HTTP, not both")
        if not is_loopback(args.address):
            raise SystemExit(f"qgpu extender serve: --address {args.address} with --insecure-plain-http: plain HTTP "
                             "is served only on a loopback address (127.0.0.0/8, ::1, localhost); anything else "
                             "needs HTTPS with client certificates")
    else:
        missing = [flag for flag, value in tls_flags.items() if not value]
        if missing:
            raise SystemExit(f"qgpu extender serve: {', '.join(missing)} missing: the extender serves HTTPS with "
                             "client-certificate authentication (--tls-cert-file, --tls-private-key-file, "
                             "--client-ca-file); plain HTTP needs --insecure-plain-http and a loopback --address")
    problem = address_problem("--address", args.address)
    if problem:
        raise SystemExit(f"qgpu extender serve: {problem}")
    if not 1 <= args.max_holds <= MAX_MAX_HOLDS:
        raise SystemExit(f"qgpu extender serve: --max-holds {args.max_holds}: must be >= 1, at most {MAX_MAX_HOLDS}")
    if args.max_holds_per_namespace is not None and not 1 <= args.max_holds_per_namespace <= args.max_holds:
        raise SystemExit(f"qgpu extender serve: --max-holds-per-namespace {args.max_holds_per_namespace}: must be within "
                         f"1..--max-holds ({args.max_holds})")
    if not 0 < args.assume_timeout <= MAX_ASSUME_TIMEOUT_S:  # NaN too: no comparison holds for it
        raise SystemExit(f"qgpu extender serve: --assume-timeout {args.assume_timeout}: must be > 0 seconds, at most "
                         f"{MAX_ASSUME_TIMEOUT_S:g}")
    if not 0 < args.group_timeout <= MAX_GROUP_TIMEOUT_S:
        raise SystemExit(f"qgpu extender serve: --group-timeout {args.group_timeout}: must be > 0 and <= "
                         f"{MAX_GROUP_TIMEOUT_S:g} seconds (held cards of an incomplete group are released after it)")
    if not (0 <= args.group_settle <= MAX_GROUP_SETTLE_S and args.group_settle < args.group_timeout):
        raise SystemExit(f"qgpu extender serve: --group-settle {args.group_settle}: must be >= 0, <= "
                         f"{MAX_GROUP_SETTLE_S:g} and below --group-timeout ({args.group_timeout:g}) seconds")
    if not 0.1 <= args.evict_period <= 60:
        raise SystemExit(f"qgpu extender serve: --evict-period {args.evict_period}: must be from 0.1 to 60 seconds")
    problem = None if args.binder_identity is None else printable_problem("--binder-identity", args.binder_identity)
    if problem:
        raise SystemExit(f"qgpu extender serve: {problem}")
    problem = (label_problem("--commitment-namespace", args.commitment_namespace or "", "a namespace name")
               if args.node_commitments != "off" else None)
    if problem:
        raise SystemExit(f"qgpu extender serve: {problem}")
    try:
        card_limits(args.largest_card_memory_mib)
    except ValueError as exc:
        raise SystemExit(f"qgpu extender serve: {exc}") from None
    if not args.record_signing_key:
        raise SystemExit("qgpu extender serve: --record-signing-key missing: the extender signs every allocation record "
                         "it writes (Ed25519, PEM private key; the qgpu_scheduler role mounts it from the "
                         "qgpu-record-signing-key Secret), and believes no record it did not sign")


def load_signing_key(path: str) -> RecordSigner:
    try:
        with open(path, "rb") as f:
            pem = f.read()
    except OSError as exc:
        raise SystemExit(f"qgpu extender serve: --record-signing-key {path}: cannot read it ({exc.strerror})") from None
    try:
        return RecordSigner.from_pem(pem, f"--record-signing-key {path}")
    except SigningKeyError as exc:
        raise SystemExit(f"qgpu extender serve: {exc}") from None


def build(args: argparse.Namespace) -> tuple[JsonServer, ExtenderApp, Any]:
    from kubernetes import client

    signer = load_signing_key(args.record_signing_key)
    limits = card_limits(args.largest_card_memory_mib)  # _check refused a value out of bounds
    try:
        connection = api_client(args.kubeconfig)
    except (ConfigException, OSError) as exc:
        where = f"--kubeconfig {args.kubeconfig}" if args.kubeconfig else "in-cluster service account (no --kubeconfig)"
        raise SystemExit(f"qgpu extender serve: {where}: cannot load the Kubernetes client configuration: {exc}") from None
    api = client.CoreV1Api(connection)
    cache = AllocationCache(make_policy(args.priority), args.priority, limits, int(args.assume_timeout * 1e9),
                            max_holds=args.max_holds, max_holds_per_namespace=args.max_holds_per_namespace, verifier=signer.verifier,
                            group_timeout_ns=int(args.group_timeout * 1e9), group_settle_ns=int(args.group_settle * 1e9))
    coordination = client.CoordinationV1Api(connection)
    commitments = (LeaseCommitments(coordination, args.commitment_namespace)
                   if args.node_commitments != "off" else None)
    # A commitment outlives its bind in flight by the assume timeout (a group's held member by the
    # group timeout): by then the Binding (and its record, which every extender's cache books)
    # exists, or the bind is over.
    metrics = ExtenderMetrics.create()
    binder = Binder(api, cache, limits, commitments=commitments,
                    commitment_grace_ns=int(max(args.assume_timeout, args.group_timeout, 10.0) * 1e9),
                    on_conflict=metrics.commitment_conflicts.inc, signer=signer)
    if commitments is not None:
        identity = args.binder_identity or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        binder.track_binders(LeaseDocuments(coordination, args.commitment_namespace, BINDERS, PRESENCE_LABELS), identity,
                             args.node_commitments, recent_s=max(args.assume_timeout, 10.0))
    pods = TrustedPods(cache, limits, binder.read_pod_if_exists)
    dra = DraView(limits, cache.node_specs) if args.dra_prioritize else None
    app = ExtenderApp(cache, binder, limits, metrics, filter_result=args.filter_result, pods=pods, dra=dra)

    def metrics() -> tuple[int, str, bytes]:
        app.refresh_gauges()
        return 200, CONTENT_TYPE_LATEST, generate_latest(app.metrics.registry)

    def readyz() -> tuple[int, str, bytes]:
        if not cache.synced.is_set():
            return 503, "text/plain", b"node and pod caches not synced yet"
        presence = binder.choice.presence
        if presence is not None and not presence.ready():
            return 503, "text/plain", b"not confirmed in the binders' Lease yet (node commitments: docs/extender.md)"
        return 200, "text/plain", b"ok"

    routes = Routes(
        post={"/": lambda verb, body: app.handle(verb, body)},
        get={"/healthz": lambda: (200, "text/plain", b"ok"), "/readyz": readyz, "/metrics": metrics},
        on_connection=app.metrics.connections.inc,
        on_http2=app.metrics.http2_connections.inc,
        # kube-scheduler's bind body is an ExtenderBindingArgs (pod name, namespace, UID, node):
        # a few hundred bytes. filter/prioritize carry a node list (or, without nodeCacheCapable,
        # whole Node objects) and keep the server's default.
        body_limits={"/bind": BIND_BODY_LIMIT},
        # kubelet's probes present no client certificate; the verbs and /metrics need one.
        open_paths=frozenset({"/healthz", "/readyz"}),
        # filter and prioritize decide from the cache (a pod the watch has not brought yet is one
        # GET): over HTTP/2 they run on the connection's reading thread, bind and preempt (API
        # writes, LISTs) on the worker pool
        inline=frozenset({"/filter", "/prioritize", "/dra-prioritize"}),
    )
    if args.tls_cert_file:
        app.metrics.certificate = CertificateMetrics.create(app.metrics.registry, "qgpu_extender")
    try:
        server = JsonServer(args.address, args.port, routes, args.tls_cert_file, args.tls_private_key_file,
                            client_ca_file=args.client_ca_file, http2=args.http2 == "on",
                            certificate_metrics=app.metrics.certificate)
    except OSError as exc:  # the port is taken, or the address is not this host's
        raise SystemExit(f"qgpu extender serve: --address {args.address} --port {args.port}: cannot listen: "
                         f"{exc.strerror or exc}") from None
    feeder = CacheFeeder(api, cache, dra=dra)
    return server, app, (feeder, binder)


BIND_BODY_LIMIT = 64 * 1024


def run(args: argparse.Namespace) -> int:
    _check(args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server, app, (feeder, binder) = build(args)
    except CertificateError as exc:
        raise SystemExit(f"qgpu extender serve: {exc}") from None
    stop = threading.Event()
    feeder.start()
    period = max(0.5, min(10.0, args.assume_timeout / 4, args.group_timeout / 4))
    threading.Thread(target=expire_loop, args=(app.cache, binder.delete_expired, period, stop, binder.expire_groups),
                     name="expire", daemon=True).start()
    if args.evict_on_unhealthy_card:
        evictor = UnhealthyCardEvictor(binder.pods.api, app.cache.failed_cards, app.cache.verifier,
                                       on_result=lambda result: app.metrics.evictions.labels(result).inc())
        threading.Thread(target=evictor.run, args=(stop, args.evict_period), name="evict-unhealthy", daemon=True).start()
    presence = binder.choice.presence
    if presence is not None:
        threading.Thread(target=presence.run, args=(stop,), name="binder-presence", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.stop, daemon=True).start())
    logging.getLogger(__name__).info("extender serving %s on %s:%d (policy %s, node commitments %s)",
                                     "HTTPS with client certificates" if server.client_auth else "plain HTTP (loopback)",
                                     args.address, server.port, args.priority,
                                     f"{args.node_commitments} in namespace {args.commitment_namespace}"
                                     if args.node_commitments != "off" else "off")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        feeder.stop()
        if presence is not None:
            presence.leave()
    return 0
