"""`qgpu webhook serve`: the validating and mutating admission webhook over TLS.

Routes: POST /validate and POST /mutate (AdmissionReview v1); GET /healthz. With ``--dra`` also
POST /mutate-dra, which turns every dialect into DRA claims and creates their ResourceClaimTemplates
(docs/dra.md, "Every dialect through the webhook"), and POST /validate-claim, which holds
ResourceClaim CREATEs to the namespace's GPU core and memory quota (docs/dra.md, "Quota on GPU core
and memory"). With ``--pod-quota``, /validate also charges every dialect's GPU share of a pod
against the same quota (docs/extender.md, "One GPU quota for every dialect").

Who may call: /mutate-dra, /validate-claim and /validate with --pod-quota have side effects (a template written, quota
reserved in the ledger), so only kube-apiserver may call them: ``--dra`` needs ``--client-ca-file``,
the CA that signed the client certificate the apiserver presents through its admission
configuration (docs/extender.md, "Who may call the webhook"). /validate and /mutate need the same
certificate, unless ``--insecure-no-client-auth`` (no --dra, no --pod-quota) says otherwise. /healthz and /readyz
stay open for kubelet's probes.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from dataclasses import replace
from functools import partial
from typing import Any, Callable

from kubernetes.config import ConfigException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from qgpu_runtime.contract.cliflags import address_problem, label_problem, subdomain_problem
from qgpu_runtime.contract.largestcard import add_largest_card_argument, card_limits
from qgpu_runtime.kube.client import api_client
from qgpu_runtime.serving import READ_CHUNK, JsonServer, Routes, ServerLimits
from qgpu_runtime.servingcert import CertificateError, CertificateMetrics
from qgpu_runtime.webhook.admission import ReviewError, WebhookConfig, _answer, _review, mutate, validate
from qgpu_runtime.webhook.cardsizes import SliceCardSizes
from qgpu_runtime.webhook.dra import DraConfig, EnsureTemplates, mutate_dra
from qgpu_runtime.webhook.quota import ClaimQuota, Verdict
from qgpu_runtime.webhook.templates import TemplateWriter

ClaimCheck = Callable[[dict[str, Any]], Verdict]
DEFAULT_LEDGER_NAMESPACE = "qgpu-system"
DEFAULT_RESERVATION_S = 30.0



def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = sub.add_parser("serve", help="serve /validate and /mutate for kube-apiserver")
    serve.add_argument("--port", type=int, default=8443, help="listen port (default 8443)")
    serve.add_argument("--address", default="0.0.0.0", help="listen address (default all interfaces)")
    serve.add_argument("--tls-cert-file", required=True, help="serving certificate (PEM); the apiserver only calls HTTPS webhooks")
    serve.add_argument("--tls-private-key-file", required=True, help="private key of --tls-cert-file (PEM)")
    serve.add_argument("--http2", choices=("on", "off"), default="off",
                       help="offer HTTP/2 over TLS (ALPN), which kube-apiserver then takes: one connection for all its "
                            "admission calls, so behind a Service every call of one apiserver reaches one replica "
                            "(default off: HTTP/1.1, whose connections the Service spreads)")
    serve.add_argument("--client-ca-file", default=None,
                       help="CA (PEM) that signed the client certificate kube-apiserver presents (its admission "
                            "configuration's kubeConfigFile); only its clients may call the admission paths. Required "
                            "unless --insecure-no-client-auth")
    serve.add_argument("--insecure-no-client-auth", action="store_true",
                       help="serve /validate and /mutate to any caller, without client certificates (not with --dra: "
                            "its paths have side effects and always need --client-ca-file)")
    serve.add_argument("--scheduler-name", default=None, help="set spec.schedulerName of GPU pods that kept the default")
    serve.add_argument("--dra", action="store_true",
                       help="serve /mutate-dra (GPU pods of every dialect become DRA claims) and /validate-claim (the claims' GPU "
                            "core and memory quota); needs RBAC: resourceclaimtemplates get/create, resourceslices, "
                            "resourceclaims, resourcequotas and pods list, namespaces get, leases get/create/update in "
                            "--quota-ledger-namespace")
    serve.add_argument("--dra-card-memory-mib", type=int, action="append", default=[], metavar="MIB",
                       help="a card size (MiB) of the DRA pools, repeatable, for T9k nvidia-gpu-percent requests and the quota "
                            "charge of a request naming no memory (the largest size, when above 80 GiB); default: "
                            "the sizes the pools' ResourceSlices publish (needs RBAC: resourceslices list)")
    add_largest_card_argument(serve, also="with --dra or --pod-quota also what the GPU quota charges a whole card or a "
                                          "request naming no memory (the card is not known before placement); with --dra "
                                          "a larger card the pools publish counts too")
    serve.add_argument("--pod-quota", action="store_true",
                       help="on /validate, charge every dialect's GPU share of a pod against the namespace's gpu.qgpu.io/core "
                            "and gpu.qgpu.io/memory quota, with its claims (docs/extender.md, 'One GPU quota for every "
                            "dialect'); needs RBAC: pods, resourceclaims and resourcequotas list, leases get/create/update in "
                            "--quota-ledger-namespace (with --dra also namespaces get)")
    serve.add_argument("--kubeconfig", default=None,
                       help="with --dra or --pod-quota: kubeconfig file (default: in-cluster service account)")
    serve.add_argument("--quota-ledger-namespace", default=None, metavar="NAMESPACE",
                       help="with --dra or --pod-quota: namespace of the quota ledger Leases qgpu-claim-quota.<namespace>, "
                            "the webhook's own (default qgpu-system)")
    serve.add_argument("--claim-reservation-seconds", type=float, default=None, metavar="SECONDS",
                       help="with --dra or --pod-quota: how long an admitted claim or pod not yet stored counts against the "
                            "quota (default 30)")
    serve.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def handler(review: Callable[[bytes, WebhookConfig], dict[str, Any]], config: WebhookConfig) -> Callable[[str, bytes], tuple[int, Any]]:
    def handle(rest: str, body: bytes) -> tuple[int, Any]:
        if rest:
            return 404, {"error": f"unknown path suffix {rest!r}"}
        try:
            return 200, review(body, config)
        except ReviewError as exc:
            return 400, {"error": str(exc)}
    return handle


# kube-apiserver takes request bodies of at most 3 MiB, and every qgpu webhook is registered for
# CREATE only, so a review carries one copy of the object (oldObject is null) plus an envelope
# (uid, kinds, userInfo, options: a few KiB).
MAX_REVIEW_BYTES = 3 * 1024 * 1024 + 64 * 1024
# What a review's JSON may decode to: a 3 MiB body of `[{},{},...]` is ~80 MiB of Python objects,
# of `{"name":"x","value":"y"}` env entries ~25 MiB (docs/benchmarks.md, "Webhook memory"). A
# 1.5 MiB pod (etcd's default object limit) of env entries counts ~190,000 tokens.
MAX_REVIEW_TOKENS = 256 * 1024
# The container limit is 256 Mi (templates/kubernetes/qgpu-webhook.yaml.j2): a ~70 MiB process,
# at most 8 bodies held (~25 MiB) and 3 decoded at once (each bounded by the token count) stay
# well inside it (docs/benchmarks.md, "Webhook memory"). Deadlines are short: the apiserver sends a
# review in one write, and its own timeout is at most 30 s.
WEBHOOK_LIMITS = ServerLimits(
    max_connections=128,  # HTTP/1.1: one per review in flight, per apiserver
    max_in_flight=3,
    idle_timeout_s=120.0,  # above Go's 90 s idle keep-alive
    header_timeout_s=5.0,  # TLS handshake, then request line and headers
    body_timeout_s=5.0,
    min_body_rate=1024 * 1024,
    write_timeout_s=10.0,
    busy_wait_s=5.0,
    body_budget=8 * MAX_REVIEW_BYTES,
    read_chunk=READ_CHUNK,  # bodies reserved as they arrive: an announced body holds 64 KiB
)


def routes(config: WebhookConfig, dra: tuple[DraConfig, EnsureTemplates] | None = None, claim_quota: ClaimCheck | None = None,
           pod_quota: ClaimCheck | None = None, registry: CollectorRegistry | None = None) -> Routes:
    """The webhook's paths; with ``registry`` also ``GET /metrics`` (Prometheus text), which like
    the admission paths needs the client CA's certificate."""
    validate_route = validate if pod_quota is None else partial(_validate_pod, check=pod_quota)
    post = {"/validate": handler(validate_route, config), "/mutate": handler(mutate, config)}
    if dra is not None:
        dra_config, ensure = dra
        post["/mutate-dra"] = handler(partial(_mutate_dra, dra_config=dra_config, ensure=ensure), config)
    if claim_quota is not None:
        post["/validate-claim"] = handler(partial(_validate_claim, check=claim_quota), config)
    get: dict[str, Callable[[], tuple[int, str, bytes]]] = {"/healthz": lambda: (200, "text/plain", b"ok"),
                                                            "/readyz": lambda: (200, "text/plain", b"ok")}
    if registry is not None:
        get["/metrics"] = lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry))
    return Routes(
        post=post,
        get=get,
        body_limits={path: MAX_REVIEW_BYTES for path in post},
        token_limits={path: MAX_REVIEW_TOKENS for path in post},
        # kubelet's probes present no client certificate; every admission path needs one.
        open_paths=frozenset({"/healthz", "/readyz"}),
    )


def _mutate_dra(body: bytes, config: WebhookConfig, *, dra_config: DraConfig, ensure: EnsureTemplates) -> dict[str, Any]:
    return mutate_dra(body, config, dra_config, ensure)


def _validate_pod(body: bytes, config: WebhookConfig, *, check: ClaimCheck) -> dict[str, Any]:
    """The request model's rules first (a pod they refuse reserves nothing), then the GPU quota."""
    answer = validate(body, config)
    if not answer["response"]["allowed"]:
        return answer
    _, request = _review(body)
    verdict = check(request)
    return _answer(request["uid"], verdict.allowed, verdict.message, code=verdict.code)


def _validate_claim(body: bytes, config: WebhookConfig, *, check: ClaimCheck) -> dict[str, Any]:
    _, request = _review(body)
    verdict = check(request)
    return _answer(request["uid"], verdict.allowed, verdict.message, code=verdict.code)


def _check_auth(args: argparse.Namespace) -> None:
    """Client certificates unless explicitly waived, and never waived for the side-effect paths."""
    if args.client_ca_file and args.insecure_no_client_auth:
        raise SystemExit("qgpu webhook serve: --client-ca-file and --insecure-no-client-auth: choose one")
    if args.pod_quota and not args.client_ca_file:
        raise SystemExit("qgpu webhook serve: --pod-quota without --client-ca-file: /validate then reserves quota in the "
                         "ledger, so only kube-apiserver (a client certificate the CA signed) may call it")
    if args.dra and not args.client_ca_file:
        raise SystemExit("qgpu webhook serve: --dra without --client-ca-file: /mutate-dra creates ResourceClaimTemplates "
                         "and /validate-claim reserves quota, so only kube-apiserver (a client certificate the CA "
                         "signed) may call them; --insecure-no-client-auth does not cover them")
    if not args.client_ca_file and not args.insecure_no_client_auth:
        raise SystemExit("qgpu webhook serve: --client-ca-file missing: the webhook answers only kube-apiserver's client "
                         "certificate (its admission configuration); --insecure-no-client-auth serves /validate and "
                         "/mutate to any caller instead")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise SystemExit(f"qgpu webhook serve: --port {args.port}: must be within 1..65535")
    problem = (address_problem("--address", args.address)
               or (subdomain_problem("--scheduler-name", args.scheduler_name, "a scheduler's name (spec.schedulerName)")
                   if args.scheduler_name is not None else None)
               or (label_problem("--quota-ledger-namespace", args.quota_ledger_namespace, "a namespace name")
                   if args.quota_ledger_namespace is not None else None))
    if problem:
        raise SystemExit(f"qgpu webhook serve: {problem}")
    _check_auth(args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.insecure_no_client_auth:
        logging.getLogger(__name__).warning(
            "--insecure-no-client-auth: /validate and /mutate answer any caller that reaches the port, not only kube-apiserver")
    dra = None
    if not args.dra and args.dra_card_memory_mib:
        raise SystemExit("qgpu webhook serve: --dra-card-memory-mib: only with --dra")
    api_only = (args.kubeconfig, args.quota_ledger_namespace, args.claim_reservation_seconds)
    if not (args.dra or args.pod_quota) and any(v is not None for v in api_only):
        raise SystemExit("qgpu webhook serve: --kubeconfig, --quota-ledger-namespace and --claim-reservation-seconds: "
                         "only with --dra or --pod-quota")
    claim_quota = pod_quota = None
    largest = args.largest_card_memory_mib
    try:
        limits = card_limits(largest)
    except ValueError as exc:
        raise SystemExit(f"qgpu webhook serve: {exc}") from None
    dra_config = DraConfig(limits=limits)
    if args.dra:
        try:
            dra_config = DraConfig(tuple(args.dra_card_memory_mib), limits=limits)
        except ValueError as exc:
            raise SystemExit(f"qgpu webhook serve: --dra-card-memory-mib: {exc}") from None
    if args.dra or args.pod_quota:
        reservation_s = DEFAULT_RESERVATION_S if args.claim_reservation_seconds is None else args.claim_reservation_seconds
        if not 1 <= reservation_s <= 3600:
            raise SystemExit(f"qgpu webhook serve: --claim-reservation-seconds {reservation_s:g}: must be within 1..3600 "
                             "(longer than the rest of the admission chain, short enough that a claim that never appeared stops counting)")
        try:
            connection = api_client(args.kubeconfig)
        except (ConfigException, OSError) as exc:
            where = f"--kubeconfig {args.kubeconfig}" if args.kubeconfig else "in-cluster service account (no --kubeconfig)"
            raise SystemExit(f"qgpu webhook serve: {'--dra' if args.dra else '--pod-quota'}: {where}: {exc}") from None
        # One guard for claims and pods: one namespace lock, one ledger, one quota; its 8 s budget
        # sits inside the 10 s the role's quota entries wait.
        if args.dra:
            # the card sizes T9k percent pods need: the flag's, else what the pools' slices publish
            dra_config = replace(dra_config, published=SliceCardSizes(connection))
        quota = ClaimQuota(connection, args.quota_ledger_namespace or DEFAULT_LEDGER_NAMESPACE, reservation_ttl_s=reservation_s,
                           default_memory_mib=largest or dra_config.limits.max_card_memory_mib, limits=dra_config.limits, dra=args.dra,
                           card_sizes=dra_config.card_sizes if args.dra else None)
        if args.dra:
            dra = (dra_config, TemplateWriter(connection))
            claim_quota = quota
        if args.pod_quota:
            pod_quota = quota.check_pod
    registry = CollectorRegistry()
    config = WebhookConfig(args.scheduler_name, limits)
    try:
        server = JsonServer(args.address, args.port, routes(config, dra, claim_quota, pod_quota, registry),
                            args.tls_cert_file, args.tls_private_key_file, limits=WEBHOOK_LIMITS, client_ca_file=args.client_ca_file,
                            http2=args.http2 == "on", certificate_metrics=CertificateMetrics.create(registry, "qgpu_webhook"))
    except CertificateError as exc:
        raise SystemExit(f"qgpu webhook serve: {exc}") from None
    except OSError as exc:  # the port is taken, or the address is not this host's
        raise SystemExit(f"qgpu webhook serve: --address {args.address} --port {args.port}: cannot listen: "
                         f"{exc.strerror or exc}") from None
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.stop, daemon=True).start())
    logging.getLogger(__name__).info("webhook serving HTTPS on %s:%d (%s)", args.address, server.port,
                                     "client certificates required" if server.client_auth else "no client authentication")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0
