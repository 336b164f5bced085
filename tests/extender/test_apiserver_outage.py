"""An apiserver that cannot be reached is a refusal in the extender's answer, never an HTTP 500
(issue 21 §7): filter answers ``Error`` (kube-scheduler retries the pod), prioritize has no opinion
(an empty list), bind answers ``Error``. The real Kubernetes client against a closed port: the
same connection refusal a stopped apiserver gives."""

from __future__ import annotations

import json
import socket

import pytest
from kubernetes import client

from qgpu_runtime.extender.app import ExtenderApp
from qgpu_runtime.extender.binder import Binder
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.extender.trust import TrustedPods
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.placement.policies import make_policy
from tests.extender.test_kube_cache import node, pod
from tests.recordkeys import SIGNER, VERIFIER


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket is closed


@pytest.fixture
def app() -> ExtenderApp:
    configuration = client.Configuration()
    configuration.host = f"https://127.0.0.1:{_closed_port()}"
    configuration.retries = 0
    api = client.CoreV1Api(client.ApiClient(configuration))
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([node("a"), node("b")])
    cache.replace_pods([])
    cache.synced.set()
    binder = Binder(api, cache, DEFAULT_LIMITS, attempts=2, signer=SIGNER)
    return ExtenderApp(cache, binder, DEFAULT_LIMITS, pods=TrustedPods(cache, DEFAULT_LIMITS, binder.read_pod_if_exists))


def _call(app: ExtenderApp, verb: str, doc: dict) -> tuple[int, object]:
    return app.handle(verb, json.dumps(doc).encode())


def test_filter_of_a_pod_the_cache_lacks_is_refused_with_the_reason(app: ExtenderApp) -> None:
    status, doc = _call(app, "filter", {"Pod": pod("new"), "NodeNames": ["a", "b"]})
    assert status == 200, doc
    assert "the apiserver cannot be reached" in doc["Error"] and doc["NodeNames"] is None
    assert app.metrics.refused.labels("filter", "apiserver-unavailable")._value.get() == 1


def test_prioritize_has_no_opinion(app: ExtenderApp) -> None:
    status, body = _call(app, "prioritize", {"Pod": pod("new"), "NodeNames": ["a", "b"]})
    assert status == 200 and json.loads(bytes(body)) == []


def test_bind_answers_the_reason(app: ExtenderApp) -> None:
    cpu_only = {**pod("cpu"), "spec": {"nodeName": "", "containers": [{"name": "c"}]}}
    app.cache.apply_pod("ADDED", cpu_only)  # in the watch cache: filter needs no apiserver
    status, doc = _call(app, "filter", {"Pod": cpu_only, "NodeNames": ["a"]})
    assert status == 200 and doc["NodeNames"] == ["a"]
    status, doc = _call(app, "bind", {"PodName": "cpu", "PodNamespace": "ns", "PodUID": "uid-cpu", "Node": "a"})
    assert status == 200, doc
    assert "the apiserver cannot be reached" in doc["Error"]
