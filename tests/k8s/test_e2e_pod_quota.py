"""One GPU quota across dialects, served (issue 22 §5): `qgpu webhook serve --pod-quota` registered
for Pod CREATEs at /validate with the real kube-apiserver v1.37.

A namespace capped at one card by ``gpu.qgpu.io/core`` cannot take a second one by changing
dialect (qGPU, vcuda, T9k, nvidia.com/gpu); claims and pods draw on the same quota; pods created at
the same moment at the quota's edge never pass it; a pod deleted or finished gives its share back.
Pods name a scheduler nobody serves: they stay pending, which holds their share as a running pod
does (the quota counts what is asked, as upstream's does)."""

from __future__ import annotations

import base64
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract.dra import SHARED_CLASS
from qgpu_runtime.kube.paging import LIST_PAGE_ITEMS
from qgpu_runtime.webhook.claimquota import CORE_QUOTA, MEMORY_QUOTA
from tests.k8s.controlplane import QgpuServer, free_port
from tests.k8s.kubeobjects import gpu_pod
from tests.k8s.test_e2e_claimquota_webhook import _race

LABEL = "qgpu-test-pod-quota"
NOBODY = "qgpu-test-nobody"
QGPU_SHARE = {"tke.cloud.tencent.com/qgpu-core": 60, "tke.cloud.tencent.com/qgpu-memory": 1}


class Hook:
    def __init__(self, cluster: Any, selector: dict[str, str]):
        self.cluster = cluster
        self.selector = selector
        self.resource = client.ResourceV1Api(cluster.api_client)

    def namespace(self, quota_core: int | None = None, quota_memory: int = 1 << 20) -> str:
        ns = self.cluster.namespace()
        self.cluster.api.patch_namespace(ns, {"metadata": {"labels": self.selector}})
        if quota_core is not None:
            self.cluster.api.create_namespaced_resource_quota(ns, {
                "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpu"},
                "spec": {"hard": {CORE_QUOTA: str(quota_core), MEMORY_QUOTA: str(quota_memory)}}})
        return ns

    def create(self, ns: str, name: str, limits: dict[str, Any], **kwargs: Any) -> None:
        self.cluster.api.create_namespaced_pod(ns, gpu_pod(name, limits, scheduler_name=NOBODY), _preload_content=False, **kwargs)

    def refusal(self, ns: str, name: str, limits: dict[str, Any]) -> str:
        with pytest.raises(ApiException) as refused:
            self.create(ns, name, limits)
        assert refused.value.status == 422, refused.value.body
        return json.loads(refused.value.body)["message"]


@pytest.fixture(scope="module")
def hook(cluster) -> Iterator[Hook]:
    cp = cluster.cp
    ledger_ns = cluster.namespace()
    pair = cp.ca.issue("webhook-pod-quota", "qgpu-webhook", server=True, hosts=("127.0.0.1",))
    port = free_port()
    server = QgpuServer("qgpu-webhook-pod-quota", [
        "webhook", "serve", "--address", "127.0.0.1", "--port", str(port), "--tls-cert-file", str(pair.cert),
        "--tls-private-key-file", str(pair.key), "--pod-quota", "--kubeconfig", str(cp.admin_kubeconfig),
        "--quota-ledger-namespace", ledger_ns, *cp.webhook_auth_args()],
        cp.workdir, port, "https", cp.ca.cert_path, client_cert=cp.webhook_client)
    server.start(ready_path="/healthz")
    api = client.AdmissionregistrationV1Api(cluster.api_client)
    selector = {LABEL: uuid.uuid4().hex[:8]}
    name = f"qgpu-pod-quota-{selector[LABEL]}"
    api.create_validating_webhook_configuration({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration", "metadata": {"name": name},
        "webhooks": [{"name": "validate.qgpu.io", "admissionReviewVersions": ["v1"], "sideEffects": "NoneOnDryRun",
                      "failurePolicy": "Fail", "timeoutSeconds": 10, "namespaceSelector": {"matchLabels": selector},
                      "clientConfig": {"url": f"{server.url}/validate", "caBundle": base64.b64encode(cp.ca.pem).decode()},
                      "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]}]})
    h = Hook(cluster, selector)
    try:
        _wait_until_active(h)
        yield h
    finally:
        api.delete_validating_webhook_configuration(name)
        server.stop()


def _wait_until_active(h: Hook) -> None:
    """The apiserver picks the configuration up through a watch: probe with dry-run pods over a zero quota."""
    ns = h.namespace(quota_core=0)
    deadline = time.monotonic() + 30
    while True:
        try:
            h.create(ns, "probe", {"nvidia.com/gpu": 1}, dry_run="All")
        except ApiException as exc:
            if exc.status == 422:
                return
            raise
        assert time.monotonic() < deadline, "webhook never became active"
        time.sleep(0.5)


@pytest.mark.parametrize("limits", [{"tencent.com/vcuda-core": 100}, {"nvidia.com/gpu": 1}, {"tensorstack.dev/nvidia-gpu": 1},
                                    {"tke.cloud.tencent.com/qgpu-core": 100}])
def test_a_namespace_capped_on_one_card_cannot_take_another_in_any_dialect(hook, limits):
    ns = hook.namespace(quota_core=1000)
    hook.create(ns, "share", QGPU_SHARE)
    message = hook.refusal(ns, "card", limits)
    assert (f"qgpu: Pod {ns}/card: exceeded quota 'gpu' in namespace '{ns}': gpu.qgpu.io/core used 600 + requested 1000 "
            "> hard 1000 (thousandths of a card)") in message
    hook.create(ns, "rest", {"tencent.com/vcuda-core": 40, "tencent.com/vcuda-memory": 4})  # what is left still fits


def test_pods_and_claims_draw_on_the_same_quota(hook):
    ns = hook.namespace(quota_core=1000)
    hook.resource.create_namespaced_resource_claim(ns, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "half"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": SHARED_CLASS, "capacity": {"requests": {"core": "500", "memory": "1024"}}}}]}}},
        _preload_content=False)
    assert "used 500 + requested 1000 > hard 1000" in hook.refusal(ns, "card", {"nvidia.com/gpu": 1})
    hook.create(ns, "share", {"tke.cloud.tencent.com/qgpu-core": 50, "tke.cloud.tencent.com/qgpu-memory": 1})


def test_a_deleted_or_finished_pod_gives_its_share_back(hook):
    ns = hook.namespace(quota_core=1000)
    hook.create(ns, "first", {"nvidia.com/gpu": 1})
    hook.refusal(ns, "second", {"nvidia.com/gpu": 1})
    hook.cluster.api.delete_namespaced_pod("first", ns, grace_period_seconds=0)
    hook.create(ns, "second", {"nvidia.com/gpu": 1})
    hook.cluster.api.patch_namespaced_pod_status("second", ns, {"status": {"phase": "Succeeded"}})
    hook.create(ns, "third", {"nvidia.com/gpu": 1})


def test_a_namespace_past_one_page_is_charged_whole(hook):
    """The check lists a namespace LIST_PAGE_ITEMS pods at a time through the apiserver's continue
    tokens: 105 shares of 1 GiB over two pages, each counted."""
    ns = hook.namespace(quota_core=100_000, quota_memory=106 * 1024)
    share = {"tke.cloud.tencent.com/qgpu-core": 1, "tke.cloud.tencent.com/qgpu-memory": 1}
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: hook.create(ns, f"s{i}", share), range(105)))
    assert LIST_PAGE_ITEMS < 105
    assert "gpu.qgpu.io/memory used 107520 + requested 2048 > hard 108544" in hook.refusal(
        ns, "big", {"tke.cloud.tencent.com/qgpu-core": 1, "tke.cloud.tencent.com/qgpu-memory": 2})
    hook.create(ns, "last", share)


def _creator(hook: Hook, ns: str, limits: Callable[[int], dict[str, Any]], refusals: list[str]) -> Callable[[int], bool]:
    def create(i: int) -> bool:
        try:
            hook.create(ns, f"p{i}", limits(i))
            return True
        except ApiException as exc:
            refusals.append(json.loads(exc.body)["message"])
            return False
    return create


def test_two_pods_at_once_at_the_quota_edge_one_is_admitted(hook):
    """Two dialects, one card left: without the ledger both would be judged against the same list."""
    ns = hook.namespace(quota_core=1000)
    refusals: list[str] = []
    dialects = [{"nvidia.com/gpu": 1}, {"tencent.com/vcuda-core": 100}]
    for _ in range(3):
        admitted = _race(2, _creator(hook, ns, lambda i: dialects[i], refusals))
        assert len(admitted) == 1, refusals
        for pod in json.loads(hook.cluster.api.list_namespaced_pod(ns, _preload_content=False).data)["items"]:
            hook.cluster.api.delete_namespaced_pod(pod["metadata"]["name"], ns, grace_period_seconds=0)
        _gone(hook, ns)
    assert all("exceeded quota 'gpu'" in m for m in refusals), refusals


def test_many_pods_of_mixed_dialects_created_at_once_never_pass_the_hard_limit(hook):
    ns = hook.namespace(quota_core=2000)
    refusals: list[str] = []
    shapes = [{"tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 1},
              {"tencent.com/vcuda-core": 30, "tencent.com/vcuda-memory": 4}]
    admitted = _race(16, _creator(hook, ns, lambda i: shapes[i % 2], refusals))
    assert len(admitted) == 6, refusals  # 6 × 300 = 1800 <= 2000 < 7 × 300; nothing that fit was refused
    assert all("exceeded quota 'gpu'" in m for m in refusals), refusals


def _gone(hook: Hook, ns: str) -> None:
    deadline = time.monotonic() + 30
    while json.loads(hook.cluster.api.list_namespaced_pod(ns, _preload_content=False).data)["items"]:
        assert time.monotonic() < deadline, "pods not deleted"
        time.sleep(0.2)
