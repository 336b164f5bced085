"""`qgpu webhook serve` registered with the real kube-apiserver (TLS, caBundle): bad GPU pods are
refused at creation with the request model's message; good ones are completed."""

from __future__ import annotations

import base64
import json
import time
from typing import Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.k8s.controlplane import QgpuServer, free_port
from tests.k8s.kubeobjects import gpu_pod, pool_xgn_taint, read_pod, tolerates

ENABLED = {"qgpu-webhook": "enabled"}


@pytest.fixture(scope="module")
def webhook(cluster) -> Iterator[str]:
    cp = cluster.cp
    pair = cp.ca.issue("webhook", "qgpu-webhook", server=True, hosts=("127.0.0.1",))
    port = free_port()
    server = QgpuServer("qgpu-webhook", ["webhook", "serve", "--address", "127.0.0.1", "--port", str(port),
                                         "--tls-cert-file", str(pair.cert), "--tls-private-key-file", str(pair.key),
                                         "--scheduler-name", "qgpu-scheduler", *cp.webhook_auth_args()],
                        cp.workdir, port, "https", cp.ca.cert_path, client_cert=cp.webhook_client)
    server.start(ready_path="/healthz")
    api = client.AdmissionregistrationV1Api(cluster.api_client)
    ca_bundle = base64.b64encode(cp.ca.pem).decode()

    def hook(path: str) -> dict:
        return {"name": f"{path}.qgpu.io", "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
                "timeoutSeconds": 5, "namespaceSelector": {"matchLabels": ENABLED},
                "clientConfig": {"url": f"{server.url}/{path}", "caBundle": ca_bundle},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]}

    api.create_validating_webhook_configuration({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
                                                 "metadata": {"name": "qgpu-validate"}, "webhooks": [hook("validate")]})
    api.create_mutating_webhook_configuration({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                                               "metadata": {"name": "qgpu-mutate"}, "webhooks": [hook("mutate")]})
    ns = cluster.namespace()
    cluster.api.patch_namespace(ns, {"metadata": {"labels": ENABLED}})
    try:
        yield ns
    finally:
        api.delete_validating_webhook_configuration("qgpu-validate")
        api.delete_mutating_webhook_configuration("qgpu-mutate")
        server.stop()


def test_invalid_gpu_pod_is_refused_by_the_apiserver_with_the_rule(cluster, webhook):
    bad = gpu_pod("bad", {"tke.cloud.tencent.com/qgpu-core": 150, "tke.cloud.tencent.com/qgpu-memory": 4})
    deadline = time.monotonic() + 30
    while True:
        try:
            cluster.api.create_namespaced_pod(webhook, bad)
        except ApiException as exc:
            message = json.loads(exc.body)["message"]
            assert "validate.qgpu.io" in message and "multiple of 100" in message, message
            assert exc.status == 422
            return
        # The configuration was not active yet (the apiserver picks it up through a watch): undo, retry.
        cluster.api.delete_namespaced_pod("bad", webhook, grace_period_seconds=0)
        assert time.monotonic() < deadline, "webhook never became active"
        time.sleep(0.5)


def test_exclusive_pod_is_completed_by_the_mutating_webhook(cluster, webhook):
    deadline = time.monotonic() + 30
    n = 0
    while True:
        name = f"whole-{n}"
        cluster.api.create_namespaced_pod(webhook, gpu_pod(name, {"tensorstack.dev/nvidia-gpu": 1}))
        pod = read_pod(cluster.api, webhook, name)
        if pod["spec"]["schedulerName"] == "qgpu-scheduler":
            break
        assert time.monotonic() < deadline, "mutating webhook never became active"
        n += 1
        time.sleep(0.5)
    assert tolerates(pod["spec"]["tolerations"], pool_xgn_taint())  # the taint qgpu_node_pool puts on xgn nodes
    assert pod["spec"]["containers"][0]["resources"]["requests"]["tensorstack.dev/nvidia-gpu"] == "1"
