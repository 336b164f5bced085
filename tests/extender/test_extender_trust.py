"""Who may call the extender, and what a caller can make it believe (issue 11 §3), in memory and
over real TLS sockets. The same rules under the real control plane: tests/k8s/test_e2e_extender_trust.py."""

from __future__ import annotations

import http.client
import json
import ssl
from pathlib import Path
from typing import Any, Iterator

import pytest

from qgpu_runtime.extender.app import ExtenderApp
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.placement.policies import make_policy
from qgpu_runtime.serving import JsonServer, Routes
from tests.extender.test_kube_cache import SEC, node, pod
from tests.k8s.pki import CertificateAuthority
from tests.recordkeys import VERIFIER


def app_with(*pods: dict, max_holds: int = 1000, ttl_s: int = 60, per_namespace: int | None = None) -> ExtenderApp:
    cache = AllocationCache(make_policy("binpack"), "binpack", assume_ttl_ns=ttl_s * SEC, max_holds=max_holds,
                            max_holds_per_namespace=per_namespace, verifier=VERIFIER)
    cache.replace_nodes([node("a"), node("b")])
    cache.replace_pods(list(pods))  # what the watch delivered: the pods the apiserver has
    return ExtenderApp(cache, None, DEFAULT_LIMITS)


def filter_body(p: dict, names: tuple[str, ...] = ("a", "b")) -> bytes:
    return json.dumps({"Pod": p, "NodeNames": list(names)}).encode()


def bind_body(p: dict, node_name: str) -> bytes:
    meta = p["metadata"]
    return json.dumps({"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"],
                       "Node": node_name}).encode()


# -- the body names the pod; the apiserver says what it asks for ------------------------------------


def test_a_forged_filter_body_for_a_real_pod_cannot_choose_its_cards():
    """The attack of the issue: a filter body carrying a real pod's identity with other requests."""
    real = pod("p", core=200, memory=0)  # two whole cards
    app = app_with(real)
    forged = pod("p", core=10, memory=1)  # same name and UID, 10 % of one card
    status, doc = app.handle("filter", filter_body(forged))
    assert status == 200 and "asks for other resources than the pod in the apiserver" in doc["Error"]
    assert app.cache.booking("ns/p") is None and app.cache.holds() == 0
    status, doc = app.handle("filter", filter_body(real))
    assert doc["Error"] == "" and doc["NodeNames"] == ["a", "b"]
    held = app.cache.booking("ns/p")
    assert held is not None and held.gpu_milli == 2000  # the real pod's two whole cards, not 10 % of one


def test_the_requests_come_from_the_apiserver_pod_even_when_the_body_differs_harmlessly():
    """A body with the same requests but other fields (the scheduler's copy) is the pod as stored."""
    real = pod("p", core=30, memory=4)
    app = app_with(real)
    copy = {**real, "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]}}
    assert app.handle("filter", filter_body(copy))[1]["NodeNames"] == ["a", "b"]


def test_a_filter_for_a_pod_the_apiserver_does_not_have_is_refused_and_holds_nothing():
    app = app_with()
    for uid in ("ghost-1", "ghost-2", "ghost-3", "ghost-4"):
        status, doc = app.handle("filter", filter_body(pod(uid, core=100, memory=0, uid=uid)))
        assert status == 200 and "is not an unbound pod the apiserver has" in doc["Error"]
    assert app.cache.holds() == 0 and not app.cache.state().bookings


def test_a_body_with_the_wrong_uid_for_a_real_pod_is_refused():
    app = app_with(pod("p"))
    doc = app.handle("filter", filter_body(pod("p", uid="other-uid")))[1]
    assert "is not an unbound pod the apiserver has" in doc["Error"]


def test_a_body_without_uid_is_refused_with_the_rule():
    body = pod("p")
    del body["metadata"]["uid"]
    doc = app_with(pod("p")).handle("filter", filter_body(body))[1]
    assert "Pod.metadata.name and Pod.metadata.uid are required" in doc["Error"]


def test_prioritize_of_a_forged_body_scores_nothing():
    app = app_with(pod("p", core=30, memory=4))
    status, scores = app.handle("prioritize", filter_body(pod("p", core=200, memory=0)))
    assert status == 200 and all(entry["Score"] == 0 for entry in json.loads(scores))


# -- bind follows filter ---------------------------------------------------------------------------


def test_a_bind_that_no_filter_passed_is_refused():
    p = pod("p")
    app = app_with(p)
    status, doc = app.handle("bind", bind_body(p, "a"))
    assert status == 200 and "no filter of this extender passed it" in doc["Error"]
    assert app.metrics.binds.labels("refused")._value.get() == 1


def test_a_bind_to_a_node_filter_did_not_pass_is_refused():
    p = pod("p")
    app = app_with(p)
    assert app.handle("filter", filter_body(p, ("a",)))[1]["NodeNames"] == ["a"]
    assert "node b is not one that filter passed" in app.handle("bind", bind_body(p, "b"))[1]["Error"]


def test_a_bind_with_another_uid_than_the_filtered_pod_is_refused():
    p = pod("p")
    app = app_with(p)
    app.handle("filter", filter_body(p))
    replaced = pod("p", uid="uid-new")
    assert "is not the uid 'uid-p' that filter passed" in app.handle("bind", bind_body(replaced, "a"))[1]["Error"]


def test_a_bind_filter_passed_goes_on_to_the_binder():
    p = pod("p")
    app = app_with(p)
    app.handle("filter", filter_body(p))
    # No API here: the binder's own answer shows the trust check let it through.
    assert "without an API connection" in app.handle("bind", bind_body(p, "b"))[1]["Error"]


# -- holds are bounded, expire and go with the pod -------------------------------------------------


def test_holds_are_bounded_in_total_and_refused_with_the_rule():
    pods = [pod(f"p{i}", core=100, memory=0) for i in range(3)]
    app = app_with(*pods, max_holds=2, per_namespace=2)
    for p in pods[:2]:
        assert app.handle("filter", filter_body(p))[1]["Error"] == ""
    doc = app.handle("filter", filter_body(pods[2]))[1]
    assert "2 pods already hold cards and await their bind (at most 2, --max-holds; namespace 'ns' holds 2" in doc["Error"]
    assert app.cache.holds() == 2 and app.cache.booking("ns/p2") is None
    # filtering a pod that holds already replaces its hold: one per pod
    assert app.handle("filter", filter_body(pods[0]))[1]["Error"] == ""
    assert app.cache.holds() == 2 and len(app.cache.state().bookings) == 2


def test_a_deleted_pod_releases_its_hold_and_its_right_to_bind():
    p, q = pod("p", core=100, memory=0), pod("q", core=100, memory=0)
    app = app_with(p, q, max_holds=1)
    app.handle("filter", filter_body(p))
    app.cache.apply_pod("DELETED", p)
    assert app.cache.booking("ns/p") is None and app.cache.holds() == 0
    assert "no filter of this extender passed it" in app.handle("bind", bind_body(p, "a"))[1]["Error"]
    assert app.handle("filter", filter_body(q))[1]["Error"] == ""  # the room is free again


def test_holds_expire_with_the_assume_timeout():
    p = pod("p", core=100, memory=0)
    app = app_with(p, ttl_s=1)
    app.handle("filter", filter_body(p))
    assert app.cache.holds() == 1
    import time

    app.cache.expire(time.time_ns() + 2 * SEC)
    assert app.cache.holds() == 0 and app.cache.booking("ns/p") is None
    assert "no filter of this extender passed it" in app.handle("bind", bind_body(p, "a"))[1]["Error"]


def test_a_bound_pod_is_no_longer_filtered():
    p = pod("p")
    app = app_with(p)
    app.cache.apply_pod("MODIFIED", {**p, "spec": {**p["spec"], "nodeName": "a"}})
    assert "is not an unbound pod the apiserver has" in app.handle("filter", filter_body(p))[1]["Error"]


# -- client certificates ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[JsonServer, CertificateAuthority, Path]]:
    base = Path(tmp_path_factory.mktemp("mtls"))
    ca = CertificateAuthority(base / "ca")
    serving = ca.issue("extender", "qgpu-extender", server=True, hosts=("127.0.0.1",))
    p = pod("p")
    app = app_with(p)
    routes = Routes(post={"/": lambda verb, body: app.handle(verb, body)},
                    get={"/healthz": lambda: (200, "text/plain", b"ok"), "/metrics": lambda: (200, "text/plain", b"m")},
                    open_paths=frozenset({"/healthz"}))
    server = JsonServer("127.0.0.1", 0, routes, str(serving.cert), str(serving.key), client_ca_file=str(ca.cert_path))
    server.start()
    yield server, ca, base
    server.stop()


def _client(server: JsonServer, ca: CertificateAuthority, cert: Any = None) -> http.client.HTTPSConnection:
    ctx = ssl.create_default_context(cafile=str(ca.cert_path))
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    return http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10, context=ctx)


def _post(conn: http.client.HTTPSConnection, path: str, body: bytes) -> tuple[int, dict]:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_without_a_client_certificate_no_verb_answers(mtls):
    server, ca, _ = mtls
    for path, body in (("/filter", filter_body(pod("p"))), ("/bind", bind_body(pod("p"), "a"))):
        status, doc = _post(_client(server, ca), path, body)
        assert status == 401 and "client certificate signed by the server's client CA (--client-ca-file) is required" in doc["Error"]
    conn = _client(server, ca)
    conn.request("GET", "/metrics")
    assert conn.getresponse().status == 401


def test_a_client_certificate_of_another_ca_fails_the_handshake(mtls):
    server, ca, base = mtls
    stranger = CertificateAuthority(base / "other").issue("client", "system:kube-scheduler", client=True)
    with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
        _post(_client(server, ca, stranger), "/bind", bind_body(pod("p"), "a"))


def test_the_scheduler_certificate_calls_every_verb_and_probes_need_none(mtls):
    server, ca, _ = mtls
    scheduler = ca.issue("scheduler", "system:kube-scheduler", client=True)
    status, doc = _post(_client(server, ca, scheduler), "/filter", filter_body(pod("p")))
    assert status == 200 and doc["NodeNames"] == ["a", "b"]
    conn = _client(server, ca)
    conn.request("GET", "/healthz")
    assert conn.getresponse().status == 200


def test_a_certified_connection_stays_certified_for_every_request_and_an_uncertified_one_is_refused_and_closed(mtls):
    """The handshake's verdict is kept per connection (not re-read per request); the context
    refuses renegotiation, so no later handshake can change who is on the other end."""
    server, ca, _ = mtls
    assert server.tls_context().options & ssl.OP_NO_RENEGOTIATION
    scheduler = ca.issue("scheduler-keepalive", "system:kube-scheduler", client=True)
    conn = _client(server, ca, scheduler)
    for _ in range(3):  # one connection, keep-alive
        status, doc = _post(conn, "/filter", filter_body(pod("p")))
        assert status == 200 and doc["NodeNames"] == ["a", "b"], doc
    bare = _client(server, ca)
    conn_status, _ = _post(bare, "/filter", filter_body(pod("p")))
    assert conn_status == 401
    with pytest.raises((http.client.HTTPException, ConnectionError, ssl.SSLError, OSError)):
        _post(bare, "/filter", filter_body(pod("p")))  # the server closed it after the 401


def test_a_client_ca_without_a_serving_certificate_is_refused():
    routes = Routes(post={}, get={})
    with pytest.raises(ValueError, match="client CA without a serving certificate"):
        JsonServer("127.0.0.1", 0, routes, client_ca_file="ca.crt")


def test_a_pod_with_volumes_and_env_is_matched_without_parsing_the_body(monkeypatch):
    """The cache keeps pods without their bulk (kube/podslim.py) while kube-scheduler's body carries
    the pod whole: the cheap field comparison compares both as kept, so the body is not parsed
    again on every filter of an ordinary pod (nearly every pod has its service-account volume)."""
    from qgpu_runtime.extender import trust

    real = pod("p", core=30, memory=4)
    real["spec"]["volumes"] = [{"name": "kube-api-access-x", "projected": {"sources": []}}]
    real["spec"]["containers"][0]["env"] = [{"name": "A", "value": "b"}]
    app = app_with(real)
    parsed = []
    original = trust.parse_pod
    monkeypatch.setattr(trust, "parse_pod", lambda *a, **k: parsed.append(1) or original(*a, **k))
    status, doc = app.handle("filter", filter_body(real))
    assert doc["Error"] == "" and parsed == []
