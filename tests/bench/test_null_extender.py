"""The benchmark's protocol floor (issue 14 §2): the null extender answers each verb as the least an
answer can be, and the floor arithmetic splits a pod's CPU the way docs/benchmarks.md reads it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from bench.extender_bench import protocol_floor
from bench.null_extender import NullExtender


class _Response:
    def read(self) -> bytes:
        return b"{}"

    def release_conn(self) -> None:
        pass


class _Api:
    def __init__(self, fail: int | None = None):
        self.bound: list[tuple[str, str, Any]] = []
        self.fail = fail

    def create_namespaced_pod_binding(self, name: str, namespace: str, body: Any, **_: Any) -> _Response:
        if self.fail:
            raise ApiException(status=self.fail, reason="Conflict")
        self.bound.append((namespace, name, body))
        return _Response()


def _args(names: list[str]) -> bytes:
    return json.dumps({"Pod": {"metadata": {"name": "p", "namespace": "ns"}}, "NodeNames": names}).encode()


def test_filter_passes_every_name_and_prioritize_scores_every_host_0():
    app = NullExtender(_Api())  # type: ignore[arg-type]
    status, doc = app.handle("filter", _args(["a", "b", "c"]))
    assert status == 200 and doc["NodeNames"] == ["a", "b", "c"] and not doc.get("FailedNodes")
    status, raw = app.handle("prioritize", _args(["a", "b"]))
    assert status == 200 and json.loads(raw) == []  # every host 0: the list names none (extender/wire.py)


def test_bind_creates_the_binding_with_the_pods_uid_as_precondition():
    api = _Api()
    status, doc = NullExtender(api).handle(  # type: ignore[arg-type]
        "bind", json.dumps({"PodName": "p", "PodNamespace": "ns", "PodUID": "u1", "Node": "n1"}).encode())
    assert status == 200 and doc == {"Error": ""}
    (namespace, name, body), = api.bound
    assert (namespace, name, body.metadata.uid, body.target.name) == ("ns", "p", "u1", "n1")


def test_a_failed_binding_and_a_bad_body_are_reported_not_raised():
    app = NullExtender(_Api(fail=409))  # type: ignore[arg-type]
    status, doc = app.handle("bind", json.dumps({"PodName": "p", "PodNamespace": "ns", "Node": "n1"}).encode())
    assert status == 200 and "409" in doc["Error"]
    assert app.handle("bind", b'{"PodName": "p"}')[0] == 400
    assert app.handle("filter", b"[]")[0] == 400
    assert app.handle("nope", b"{}")[0] == 404


def _arm(etcd: float, apiserver: float, scheduler: float, **own: float) -> dict[str, Any]:
    # the gross figures are what a run without the idle sample has; the floor reads the net ones
    net = {"etcd": etcd, "kube-apiserver": apiserver, "kube-scheduler": scheduler, **own}
    return {"cpu_ms_per_pod": {name: 2 * value + 1 for name, value in net.items()}, "net_cpu_ms_per_pod": net}


def test_the_floor_splits_control_plane_cpu_into_protocol_and_qgpu_parts():
    result = {"without_extender": _arm(1.0, 2.0, 3.0), "without_extender_again": _arm(1.0, 3.0, 3.0),
              "with_null_extender": _arm(1.5, 3.5, 5.0, **{"null-extender": 2.0}),
              "with_extender": _arm(1.5, 4.5, 5.5, **{"qgpu-extender": 4.0})}
    floor = protocol_floor(result)
    assert floor["baseline_control_plane_ms"] == 6.5
    assert floor["protocol_control_plane_ms"] == 3.5
    assert floor["qgpu_control_plane_over_protocol_ms"] == 1.5
    assert (floor["null_extender_own_ms"], floor["qgpu_extender_own_ms"]) == (2.0, 4.0)
    assert floor["over_baseline_by_process_ms"]["with_null_extender"] == {"etcd": 0.5, "kube-apiserver": 1.0,
                                                                          "kube-scheduler": 2.0}
    assert floor["zero_cpu_extender_ratio"] == pytest.approx(6.5 / 10.0, abs=1e-3)
