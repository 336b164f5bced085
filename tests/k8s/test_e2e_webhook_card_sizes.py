"""DRA pools serve T9k percent pods with the role defaults (issue 22 §4): `qgpu webhook serve --dra`
without --dra-card-memory-mib, registered with the real kube-apiserver v1.37, reads the card sizes
from the ResourceSlices of driver gpu.qgpu.io: a percent pod's template has one alternative per
published size, a size published later joins within the refresh, and a webhook whose identity may
not list slices refuses the pod with a 500 naming the call.

The control plane is shared by the session and other modules publish slices of their own, so the
sizes here are ones nobody else publishes and the checks are about them."""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any, Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract import dra
from qgpu_runtime.contract.names import GPU_MODE, GPU_MODE_DRA
from qgpu_runtime.gpu.types import CardInfo
from tests.k8s.controlplane import QgpuServer, free_port, kubeconfig
from tests.k8s.kubeobjects import gpu_pod
from tests.polling import poll

PERCENT = {"tensorstack.dev/nvidia-gpu-percent": 25}
SIZES = (23552, 47104)  # MiB: 23 GiB and 46 GiB cards, published by no other test
LATER = 35840


class Hook:
    def __init__(self, cluster: Any, ns: str, nodes: list[str]):
        self.cluster = cluster
        self.ns = ns
        self.nodes = nodes
        self.resource = client.ResourceV1Api(cluster.api_client)
        self.count = 0

    def percent_pod_sizes(self) -> list[int]:
        """Create a percent pod; the card sizes (MiB) its claim template chooses among."""
        self.count += 1
        pod = gpu_pod(f"pct-{self.count}", PERCENT, scheduler_name="qgpu-test-nobody")
        created = json.loads(self.cluster.api.create_namespaced_pod(self.ns, pod, _preload_content=False).data)
        (ref,) = created["spec"]["resourceClaims"]
        template = json.loads(self.resource.read_namespaced_resource_claim_template(
            ref["resourceClaimTemplateName"], self.ns, _preload_content=False).data)
        (request,) = template["spec"]["spec"]["devices"]["requests"]
        return [int(s["name"].removeprefix("mib")) for s in request["firstAvailable"]]

    def publish(self, node: str, memory_mib: int) -> None:
        cards = [CardInfo(index=i, uuid=f"GPU-{node}-{i}", model="Tesla T4", memory_mib=memory_mib, minor=i) for i in range(2)]
        self.resource.create_resource_slice({
            "apiVersion": dra.API_VERSION, "kind": "ResourceSlice", "metadata": {"name": dra.slice_name(node)},
            "spec": {"driver": dra.DRIVER, "nodeName": node, "pool": {"name": dra.pool_name(node), "generation": 1,
                                                                      "resourceSliceCount": 1},
                     "devices": [dra.slice_device(card, "fixed-share") for card in cards]}})


def _serve(cluster: Any, name: str, kubeconfig_path: str) -> QgpuServer:
    cp = cluster.cp
    pair = cp.ca.issue(name, "qgpu-webhook", server=True, hosts=("127.0.0.1",))
    port = free_port()
    server = QgpuServer(name, ["webhook", "serve", "--address", "127.0.0.1", "--port", str(port), "--tls-cert-file", str(pair.cert),
                               "--tls-private-key-file", str(pair.key), "--dra", "--kubeconfig", kubeconfig_path,
                               *cp.webhook_auth_args()],
                        cp.workdir, port, "https", cp.ca.cert_path, client_cert=cp.webhook_client)
    server.start(ready_path="/healthz")
    return server


def _register(cluster: Any, server: QgpuServer, selector: dict[str, str]) -> str:
    name = f"qgpu-card-sizes-{uuid.uuid4().hex[:6]}"
    client.AdmissionregistrationV1Api(cluster.api_client).create_mutating_webhook_configuration({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration", "metadata": {"name": name},
        "webhooks": [{"name": "mutate-dra.qgpu.io", "admissionReviewVersions": ["v1"], "sideEffects": "NoneOnDryRun",
                      "failurePolicy": "Fail", "timeoutSeconds": 10, "namespaceSelector": {"matchLabels": selector},
                      "clientConfig": {"url": f"{server.url}/mutate-dra", "caBundle": base64.b64encode(cluster.cp.ca.pem).decode()},
                      "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]}]})
    return name


def _namespace(cluster: Any, selector: dict[str, str]) -> str:
    ns = cluster.namespace()
    cluster.api.patch_namespace(ns, {"metadata": {"labels": {GPU_MODE: GPU_MODE_DRA, **selector}}})
    return ns


def _wait_until_active(cluster: Any, ns: str) -> None:
    def converted() -> bool | None:
        pod = gpu_pod("probe", {"tencent.com/vcuda-core": 50, "tencent.com/vcuda-memory": 4})
        created = json.loads(cluster.api.create_namespaced_pod(ns, pod, dry_run="All", _preload_content=False).data)
        return True if created["spec"].get("resourceClaims") else None
    poll(converted, timeout=30, interval=0.5, what="the card-sizes webhook active")


@pytest.fixture(scope="module")
def hook(cluster) -> Iterator[Hook]:
    server = _serve(cluster, "qgpu-webhook-card-sizes", str(cluster.cp.admin_kubeconfig))
    selector = {"qgpu-test-card-sizes": uuid.uuid4().hex[:8]}
    name = _register(cluster, server, selector)
    nodes = [f"sizes-{uuid.uuid4().hex[:6]}" for _ in range(3)]
    h = Hook(cluster, _namespace(cluster, selector), nodes)
    try:
        _wait_until_active(cluster, h.ns)
        yield h
    finally:
        client.AdmissionregistrationV1Api(cluster.api_client).delete_mutating_webhook_configuration(name)
        server.stop()
        for node in nodes:
            try:
                h.resource.delete_resource_slice(dra.slice_name(node))
            except ApiException as exc:
                if exc.status != 404:
                    raise


def test_a_percent_pod_chooses_among_the_card_sizes_the_pools_publish(hook):
    for node, size in zip(hook.nodes, SIZES):
        hook.publish(node, size)
    sizes = hook.percent_pod_sizes()
    assert set(SIZES) <= set(sizes) and sizes == sorted(sizes)
    assert LATER not in sizes
    # a node of a new card size joins within the webhook's refresh (10 s)
    hook.publish(hook.nodes[2], LATER)
    deadline = time.monotonic() + 30
    while LATER not in hook.percent_pod_sizes():
        assert time.monotonic() < deadline, "the new card size never reached percent pods"
        time.sleep(1)


def test_a_webhook_that_may_not_list_slices_refuses_percent_pods_with_a_500_naming_the_call(cluster):
    cp = cluster.cp
    pair = cp.ca.issue("card-sizes-no-rbac", "qgpu-webhook-without-rbac", client=True)
    config = cp._write_yaml("card-sizes-no-rbac.kubeconfig", kubeconfig(cp.server, cp.ca.cert_path, pair, "qgpu-webhook-without-rbac"))
    server = _serve(cluster, "qgpu-webhook-card-sizes-norbac", str(config))
    selector = {"qgpu-test-card-sizes": uuid.uuid4().hex[:8]}
    name = _register(cluster, server, selector)
    ns = _namespace(cluster, selector)
    try:
        def refused() -> str | None:
            try:
                cluster.api.create_namespaced_pod(ns, gpu_pod("pct", PERCENT), dry_run="All", _preload_content=False)
            except ApiException as exc:
                return json.loads(exc.body)["message"]
            return None
        message = poll(refused, timeout=30, interval=0.5, what="the percent pod refused")
        assert "the card sizes of the DRA pools cannot be read" in message, message
        assert "listing ResourceSlices of driver gpu.qgpu.io: the apiserver answered 403 Forbidden" in message, message
    finally:
        client.AdmissionregistrationV1Api(cluster.api_client).delete_mutating_webhook_configuration(name)
        server.stop()
