"""`qgpu webhook serve`'s HTTP layer under forged, greedy and slow callers (issue 21 §2, §5): the
webhook's own routes and limits (cli.routes, cli.WEBHOOK_LIMITS) behind the shared JsonServer.

Every assertion is on what the server did (its handlers' calls, its ServerStats), never on time.
The same against the real kube-apiserver: tests/k8s/test_e2e_webhook_auth.py.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import ssl
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest

from qgpu_runtime.serving import JsonServer, ServerLimits
from qgpu_runtime.webhook import cli
from qgpu_runtime.webhook.admission import WebhookConfig
from qgpu_runtime.webhook.dra import ClaimTemplate, DraConfig
from qgpu_runtime.webhook.quota import Verdict
from tests.k8s.pki import CertificateAuthority, KeyPair

LIMITS = cli.WEBHOOK_LIMITS
CAP = cli.MAX_REVIEW_BYTES
GPU_POD = {"metadata": {"name": "p", "namespace": "victim"},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {"tke.cloud.tencent.com/qgpu-core": "40",
                                                                          "tke.cloud.tencent.com/qgpu-memory": "4"}}}]}}
CLAIM = {"metadata": {"name": "c", "namespace": "victim"}, "spec": {"devices": {"requests": []}}}


def review(obj: dict, kind: str = "Pod") -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "forged", "kind": {"group": "", "version": "v1", "kind": kind}, "operation": "CREATE",
        "namespace": "victim", "object": obj}}).encode()


@dataclass
class SideEffects:
    """What the side-effect paths were asked to do: templates to create, claims to reserve."""

    templates: list[tuple[str, int]] = field(default_factory=list)
    reservations: list[str] = field(default_factory=list)

    def ensure(self, namespace: str, templates: Sequence[ClaimTemplate]) -> None:
        self.templates.append((namespace, len(templates)))

    def check(self, request: dict[str, Any]) -> Verdict:
        self.reservations.append(str(request.get("namespace")))
        return Verdict(True)


@dataclass
class Pki:
    ca: Path
    server: KeyPair
    apiserver: KeyPair  # what kube-apiserver presents through its admission configuration
    stranger: KeyPair  # signed by another CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    base = tmp_path_factory.mktemp("webhook-pki")
    serving = CertificateAuthority(base / "serving", "qgpu-webhook-ca")
    clients = CertificateAuthority(base / "clients", "qgpu-webhook-client-ca")
    other = CertificateAuthority(base / "other", "someone-else")
    return Pki(serving.cert_path, serving.issue("tls", "qgpu-webhook", server=True, hosts=("127.0.0.1",)),
               clients.issue("apiserver", "kube-apiserver", client=True), other.issue("x", "kube-apiserver", client=True))


def start(routes: Any, pki: Pki | None, limits: ServerLimits = LIMITS, client_auth: bool = True) -> JsonServer:
    srv = JsonServer("127.0.0.1", 0, routes, str(pki.server.cert) if pki else None, str(pki.server.key) if pki else None,
                     limits=limits, client_ca_file=str(pki.apiserver.cert.parent / "ca.crt") if pki and client_auth else None)
    srv.start()
    return srv


@pytest.fixture
def effects() -> SideEffects:
    return SideEffects()


@pytest.fixture
def server(pki: Pki, effects: SideEffects) -> Iterator[JsonServer]:
    srv = start(cli.routes(WebhookConfig(), (DraConfig(card_memory_mib=(15360,)), effects.ensure), effects.check), pki)
    yield srv
    srv.stop()


def context(pki: Pki, cert: KeyPair | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    return ctx


def post(port: int, path: str, body: bytes, ctx: ssl.SSLContext | None) -> tuple[int, dict]:
    conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=ctx) if ctx
            else http.client.HTTPConnection("127.0.0.1", port, timeout=30))
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


# -- who may call ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body", [("/mutate-dra", review(GPU_POD)), ("/validate-claim", review(CLAIM, "ResourceClaim")),
                                        ("/validate", review(GPU_POD)), ("/mutate", review(GPU_POD))])
def test_a_forged_review_without_a_client_certificate_is_refused_before_any_side_effect(server, pki, effects, path, body):
    status, doc = post(server.port, path, body, context(pki, None))
    assert status == 401 and doc["Error"].startswith(f"{path}: a client certificate signed by the server's client CA")
    assert effects.templates == [] and effects.reservations == []
    assert server.stats.refused_unauthenticated == 1 and server.stats.body_bytes_peak == 0


def test_a_certificate_of_another_ca_fails_the_handshake(server, pki, effects):
    with pytest.raises((ssl.SSLError, ConnectionError)):
        post(server.port, "/validate-claim", review(CLAIM, "ResourceClaim"), context(pki, pki.stranger))
    assert effects.reservations == []


def test_the_apiservers_certificate_reaches_the_side_effect_paths(server, pki, effects):
    assert post(server.port, "/validate-claim", review(CLAIM, "ResourceClaim"), context(pki, pki.apiserver))[0] == 200
    assert post(server.port, "/mutate-dra", review(GPU_POD), context(pki, pki.apiserver))[0] == 200
    assert effects.reservations == ["victim"] and effects.templates == [("victim", 1)]


def test_probes_stay_open_without_a_certificate(server, pki):
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10, context=context(pki, None))
    try:
        for path in ("/healthz", "/readyz"):
            conn.request("GET", path)
            response = conn.getresponse()
            assert (response.status, response.read()) == (200, b"ok")
    finally:
        conn.close()


@pytest.mark.parametrize("argv, message", [
    ([], "--client-ca-file missing: the webhook answers only kube-apiserver's client certificate"),
    (["--dra", "--insecure-no-client-auth"], "--dra without --client-ca-file: /mutate-dra creates ResourceClaimTemplates"),
    (["--pod-quota", "--insecure-no-client-auth"], "--pod-quota without --client-ca-file: /validate then reserves quota"),
    (["--client-ca-file", "ca.crt", "--insecure-no-client-auth"], "--client-ca-file and --insecure-no-client-auth: choose one"),
])
def test_serving_without_client_authentication_needs_the_opt_out_and_never_covers_dra(argv, message):
    from qgpu_runtime.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["webhook", "serve", "--tls-cert-file", "a", "--tls-private-key-file", "b", *argv])


# -- bodies ---------------------------------------------------------------------------------------

def _announce(port: int, ctx: ssl.SSLContext | None, path: str, length: int) -> int:
    """Headers announcing a ``length``-byte body; the status the server answers before the body
    (sending body bytes into a connection the server closed unread only resets it)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1") if ctx else raw
    with sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
        return int(sock.recv(64).split(b" ", 2)[1])


def _concurrently(n: int, call: Any) -> list[Any]:
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - reported in the assertion
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


EIGHT_MIB = 8 * 1024 * 1024


def test_eight_unauthenticated_8_mib_bodies_are_refused_unread(server, pki):
    results = _concurrently(8, lambda: _announce(server.port, context(pki, None), "/validate", EIGHT_MIB))
    assert results == [401] * 8
    assert server.stats.refused_unauthenticated == 8 and server.stats.body_bytes_peak == 0


def test_an_unauthenticated_sender_expecting_100_continue_gets_the_401_instead(server, pki):
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    with context(pki, None).wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(f"POST /validate HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: {EIGHT_MIB}\r\n\r\n".encode())
        assert sock.recv(12) == b"HTTP/1.1 401"
    assert server.stats.refused_unauthenticated == 1 and server.stats.body_bytes_peak == 0


def test_eight_authenticated_8_mib_bodies_are_refused_on_their_content_length(server, pki):
    results = _concurrently(8, lambda: _announce(server.port, context(pki, pki.apiserver), "/mutate-dra", EIGHT_MIB))
    assert results == [413] * 8
    assert server.stats.refused_too_large == 8 and server.stats.body_bytes_peak == 0


def test_concurrent_bodies_at_the_cap_hold_at_most_the_budget(pki, effects):
    """Sixteen max-size reviews at once: the body bytes held never pass the budget (8 bodies), and
    every caller gets an answer (200 after decoding, or 503 to retry), none a dropped connection.
    The memory limits are the webhook's own; only the deadlines are relaxed, because here the 16
    senders share one process (and its GIL) with the server, so on a loaded machine a sender can
    fall below ``min_body_rate`` and be closed, which is the deadline's job, not this test's."""
    limits = dataclasses.replace(LIMITS, header_timeout_s=120.0, body_timeout_s=120.0, busy_wait_s=120.0)
    server = start(cli.routes(WebhookConfig(), (DraConfig(card_memory_mib=(15360,)), effects.ensure), effects.check), pki, limits)
    try:
        _sixteen_at_the_cap(server, pki)
    finally:
        server.stop()


def _sixteen_at_the_cap(server: JsonServer, pki: Pki) -> None:
    padding = CAP - len(review(GPU_POD)) - 64
    big = json.loads(review(GPU_POD))
    big["request"]["object"]["metadata"]["annotations"] = {"pad": "x" * padding}
    body = json.dumps(big).encode()
    assert CAP - 128 < len(body) <= CAP
    results = _concurrently(16, lambda: post(server.port, "/validate", body, context(pki, pki.apiserver))[0])
    assert set(results) <= {200, 503} and 200 in results, results
    assert server.stats.body_bytes_peak <= LIMITS.body_budget


def test_a_body_of_too_many_json_tokens_is_refused_before_it_is_decoded(server, pki, effects):
    """~1 MiB of `[{},{},...]` would decode to ~27 MiB of dicts: refused on the count alone."""
    body = b'{"request":[' + b"{}," * (cli.MAX_REVIEW_TOKENS // 2 + 1) + b"{}]}"
    status, doc = post(server.port, "/mutate-dra", body, context(pki, pki.apiserver))
    assert status == 413 and doc["Error"].endswith(f"rule: at most {cli.MAX_REVIEW_TOKENS}"), doc
    assert effects.templates == [] and server.stats.refused_too_large == 1


# -- slow senders ---------------------------------------------------------------------------------

ROUNDS = 20


def test_connections_that_announce_a_body_and_send_nothing_do_not_starve_validate(pki):
    """Without client authentication (the opt-out): more stalled bodies than connection slots,
    each announcing the largest body; every /validate after them is answered."""
    srv = start(cli.routes(WebhookConfig()), None, client_auth=False)
    try:
        with ExitStack() as stalled:
            for _ in range(LIMITS.max_connections + 8):
                sock = stalled.enter_context(socket.create_connection(("127.0.0.1", srv.port), timeout=30))
                sock.sendall(f"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: {CAP}\r\n\r\n".encode())
            answers = [post(srv.port, "/validate", review(GPU_POD), None)[0] for _ in range(ROUNDS)]
        assert answers == [200] * ROUNDS
        # the stalled connections held one read chunk each, not their announced bodies, and the
        # callers got in by closing the oldest of them, never by being refused
        assert srv.stats.refused_budget == 0 and srv.connections.refused == 0 and srv.connections.evicted >= 8
    finally:
        srv.stop()


def test_connections_that_never_finish_the_handshake_do_not_starve_validate(server, pki):
    """With client authentication an attacker cannot get past the handshake; connections stuck
    in it (more than there are slots) are closed for newcomers, and the apiserver's calls go through."""
    with ExitStack() as stalled:
        for _ in range(LIMITS.max_connections + 8):
            stalled.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=30))
        answers = [post(server.port, "/validate", review(GPU_POD), context(pki, pki.apiserver))[0] for _ in range(ROUNDS)]
    assert answers == [200] * ROUNDS
    assert server.connections.refused == 0 and server.connections.evicted >= 8
