"""The extender and webhook over real HTTP(S) sockets: routes, status codes, TLS, and fuzzing.

A client's mistake must be a 4xx with a reason and the server must keep serving; a 500 would mean
a bug of ours, so the fuzzers assert there is none.
"""

from __future__ import annotations

import http.client
import json
import ssl
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from qgpu_runtime.extender.app import ExtenderApp
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.model.requests import DEFAULT_LIMITS, GPU_RESOURCES
from qgpu_runtime.placement.policies import make_policy
from qgpu_runtime.serving import JsonServer, Routes
from qgpu_runtime.webhook import cli as webhook_cli
from qgpu_runtime.webhook.admission import WebhookConfig
from tests.extender.test_kube_cache import node
from tests.k8s.pki import CertificateAuthority
from tests.recordkeys import VERIFIER


def _app() -> ExtenderApp:
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([node("a"), node("b", n_cards=1)])
    cache.replace_pods([])
    return ExtenderApp(cache, None, DEFAULT_LIMITS)


def _routes(app: ExtenderApp) -> Routes:
    hook = webhook_cli.routes(WebhookConfig("qgpu-scheduler"))
    return Routes(
        post={"/validate": hook.post["/validate"], "/mutate": hook.post["/mutate"], "/": lambda verb, body: app.handle(verb, body)},
        get={"/healthz": lambda: (200, "text/plain", b"ok"),
             "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(app.metrics.registry))},
    )


@pytest.fixture(scope="module")
def plain() -> Iterator[tuple[JsonServer, ExtenderApp]]:
    app = _app()
    server = JsonServer("127.0.0.1", 0, _routes(app))
    server.start()
    yield server, app
    server.stop()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[JsonServer, Path, ExtenderApp]]:
    ca = CertificateAuthority(Path(tmp_path_factory.mktemp("pki")))
    pair = ca.issue("srv", "qgpu", server=True, hosts=("127.0.0.1",))
    app = _app()
    server = JsonServer("127.0.0.1", 0, _routes(app), str(pair.cert), str(pair.key))
    server.start()
    yield server, ca.cert_path, app
    server.stop()


def call(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    if response.getheader("Content-Type", "").startswith("application/json"):
        return response.status, json.loads(data)
    return response.status, data


def gpu_pod(limits: dict, app: ExtenderApp | None = None) -> dict:
    """A pending pod; with ``app``, one its watch cache has seen (the extender trusts only those)."""
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "uid-p"},
           "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]}}
    if app is not None:
        app.cache.apply_pod("MODIFIED", pod)
    return pod


def test_filter_prioritize_and_health_over_http(plain):
    server, app = plain
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    args = json.dumps({"Pod": gpu_pod({"tke.cloud.tencent.com/qgpu-core": "100"}, app), "NodeNames": ["a", "b", "zz"]}).encode()
    status, doc = call(conn, "POST", "/filter", args)
    assert status == 200 and doc["NodeNames"] == ["a", "b"] and "zz" in doc["FailedAndUnresolvableNodes"]
    status, doc = call(conn, "POST", "/prioritize", args)
    # a whole card: binpack wants the node it fills (b, one card); a and the unknown zz score 0 and are left out
    assert status == 200 and doc == [{"Host": "b", "Score": 10}]
    assert call(conn, "GET", "/healthz") == (200, b"ok")
    status, metrics = call(conn, "GET", "/metrics")
    assert status == 200 and b'qgpu_extender_requests_total{code="200",verb="filter"}' in metrics


def test_invalid_gpu_request_fails_every_node_with_the_reason(plain):
    server, app = plain
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    args = json.dumps({"Pod": gpu_pod({"tke.cloud.tencent.com/qgpu-core": "150"}, app), "NodeNames": ["a"]}).encode()
    status, doc = call(conn, "POST", "/filter", args)
    assert status == 200 and doc["NodeNames"] == []
    assert "multiple of 100" in doc["FailedAndUnresolvableNodes"]["a"]


def test_a_pod_listing_a_thousand_gpu_models_fails_every_node_and_is_not_remembered(plain):
    """Admitted before the bound (or where the webhook does not run): filter refuses it with the
    parser's words, and the parse memo keeps nothing of it (it kept ~3.2 MiB per such pod)."""
    server, app = plain
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    pod = {"metadata": {"name": "models", "namespace": "ns", "uid": "uid-models", "resourceVersion": "1",
                        "annotations": {"qgpu.io/gpu-model": "|".join(str(i) for i in range(1000))}},
           "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    app.cache.apply_pod("MODIFIED", pod)
    remembered = len(app.cache.requests)
    status, doc = call(conn, "POST", "/filter", json.dumps({"Pod": pod, "NodeNames": ["a"]}).encode())
    assert status == 200 and doc["NodeNames"] == []
    assert "annotation qgpu.io/gpu-model=0|1|2|3|4|5|6|7|8|9|10|11|12|13|14|15|16... (3889 characters): " \
        "lists 1000 GPU model names, at most 16 are allowed" in doc["FailedAndUnresolvableNodes"]["a"]
    assert len(app.cache.requests) == remembered


def test_pod_asking_for_nothing_of_ours_passes_every_node(plain):
    server, app = plain
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    args = json.dumps({"Pod": gpu_pod({"cpu": "1"}, app), "NodeNames": ["a", "elsewhere"]}).encode()
    assert call(conn, "POST", "/filter", args)[1]["NodeNames"] == ["a", "elsewhere"]


def test_client_mistakes_are_4xx_with_a_reason(plain):
    server, _ = plain
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    status, doc = call(conn, "POST", "/filter", b"{oops")
    assert status == 400 and "not JSON" in doc["Error"]
    status, doc = call(conn, "POST", "/preempt", b"{}")
    assert status == 400 and "ExtenderPreemptionArgs.Pod" in doc["Error"]
    status, doc = call(conn, "POST", "/evict", b"{}")
    assert status == 404 and "evict" in doc["Error"]
    status, doc = call(conn, "POST", "/bind", b'{"PodName": "p"}')
    assert status == 400 and "Node" in doc["Error"]
    conn.putrequest("POST", "/filter")
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 411 and b"Content-Length" in response.read()


def test_https_serves_with_the_given_certificate(tls):
    server, ca, app = tls
    ctx = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10, context=ctx)
    args = json.dumps({"Pod": gpu_pod({"nvidia.com/gpu": "1"}, app), "NodeNames": ["b"]}).encode()
    status, doc = call(conn, "POST", "/filter", args)
    assert status == 200 and doc["NodeNames"] == ["b"]
    with pytest.raises(ssl.SSLCertVerificationError):
        http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10, context=ssl.create_default_context()).request("GET", "/healthz")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
quantities = st.one_of(st.integers(-5, 1000).map(str), st.sampled_from(["1.5", "2k", "500m", "", "abc", "1e3", "0x10"]), st.integers(-5, 300))
limits = st.dictionaries(st.sampled_from(sorted(GPU_RESOURCES) + ["cpu", "tke.cloud.tencent.com/qgpu-bogus"]), quantities, max_size=3)
pods = st.builds(
    lambda lims, ann, init: {"metadata": {"name": "p", "namespace": "ns", "annotations": ann},
                             "spec": {"containers": [{"name": "c", "resources": {"limits": lims}}],
                                      **({"initContainers": [{"name": "i", "resources": {"limits": lims}}]} if init else {})}},
    limits,
    st.dictionaries(st.sampled_from(["tke.cloud.tencent.com/app-class", "qgpu.io/gpu-model"]),
                    st.sampled_from(["online", "offline", "gold", "", "V100", "|"]), max_size=2),
    st.booleans(),
)
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.builds(lambda p, names, key: json.dumps({key: p, "NodeNames": names}).encode(),
              pods, st.lists(st.sampled_from(["a", "b", "c"]), max_size=3), st.sampled_from(["Pod", "pod", "POD"])),
    st.builds(lambda p: json.dumps({"Pod": p, "Nodes": {"items": [{"metadata": {"name": "a"}}]}}).encode(), pods),
    st.builds(lambda d: json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                    "request": {"uid": "u", "kind": {"group": "", "kind": "Pod"}, "operation": "CREATE", "object": d}}).encode(),
              pods),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/filter", "/prioritize", "/bind", "/validate", "/mutate", "/x"]), body=bodies)
def test_fuzzed_requests_never_crash_the_server(plain, path, body):
    server, _ = plain
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    status, doc = call(conn, "POST", path, body)
    assert status in (200, 400, 404), (status, doc)
    assert isinstance(doc, (dict, list))
    if status == 200 and path == "/prioritize":
        assert all(0 <= h["Score"] <= 10 for h in doc)
    conn.close()
