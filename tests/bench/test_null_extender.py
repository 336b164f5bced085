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


def test_behind_granian_it_answers_certified_callers_and_refuses_a_connection_without_a_certificate(tmp_path):
    """`--server granian` (bench/extender_bench.py --compare-floor): the same verbs from the same
    handler, HTTP/2 offered by ALPN, and no request without a certificate the client CA signed."""
    import socket
    import ssl
    import subprocess
    import sys
    import urllib.request

    from tests.k8s.controlplane import ROOT, free_port
    from tests.k8s.pki import CertificateAuthority
    from tests.polling import poll

    ca = CertificateAuthority(tmp_path / "pki", "floor-ca")
    server = ca.issue("null-extender", "null-extender", server=True, hosts=("127.0.0.1",))
    scheduler = ca.issue("kube-scheduler", "system:kube-scheduler", client=True)
    kubeconfig = tmp_path / "kubeconfig"  # bind is not called here: the client is never used
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
                          "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
                          "current-context: c\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.null_extender", "--port", str(port), "--kubeconfig", str(kubeconfig),
                             "--tls-cert-file", str(server.cert), "--tls-private-key-file", str(server.key),
                             "--client-ca-file", str(ca.cert_path), "--server", "granian"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        certified = ssl.create_default_context(cafile=str(ca.cert_path))
        certified.load_cert_chain(str(scheduler.cert), str(scheduler.key))

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", context=certified, timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        poll(ready, timeout=30, what="the granian null extender to answer /readyz")
        request = urllib.request.Request(f"https://127.0.0.1:{port}/filter", data=_args(["a", "b"]), method="POST")
        with urllib.request.urlopen(request, context=certified, timeout=5) as r:
            assert json.loads(r.read())["NodeNames"] == ["a", "b"]
        certified.set_alpn_protocols(["h2", "http/1.1"])
        with certified.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5), server_hostname="127.0.0.1") as s:
            assert s.selected_alpn_protocol() == "h2"
        anonymous = ssl.create_default_context(cafile=str(ca.cert_path))
        with pytest.raises((ssl.SSLError, OSError)):
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", context=anonymous, timeout=5) as r:
                r.read()
    finally:
        proc.terminate()
        assert proc.wait(10) is not None
