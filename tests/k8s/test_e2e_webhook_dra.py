"""`qgpu webhook serve --dra` registered with the real kube-apiserver: in a namespace labelled
``qgpu.io/gpu-mode=dra`` a pod of every dialect is admitted with claims on templates the webhook
created with qgpu's capacity requests; invalid pods are refused with the parser's words; dryRun
creates nothing; device-plugin pods keep their resources."""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract import dra, draclaim
from qgpu_runtime.contract.names import GPU_MODE, GPU_MODE_DEVICE_PLUGIN, GPU_MODE_DRA, POOL_MODE_LABEL
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.kube.client import api_client
from qgpu_runtime.webhook.claimquota import Usage, claim_controllers, claim_usage
from qgpu_runtime.webhook.dra import TemplateError, convert
from qgpu_runtime.webhook.podquota import ClaimSeen, pod_usage
from qgpu_runtime.webhook.templates import TemplateWriter
from tests.k8s.controlplane import QgpuServer, free_port, kubeconfig
from tests.k8s.kubeobjects import gpu_node, gpu_pod, qgpu_device_classes, read_pod
from tests.polling import poll

DRA_NAMESPACE = {GPU_MODE: GPU_MODE_DRA}
DRA_SCHEDULER = "qgpu-test-dra-pool"
QGPU = {"tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 4}


class Hook:
    def __init__(self, cluster: Any, ns: str, server: QgpuServer):
        self.cluster = cluster
        self.ns = ns
        self.server = server
        self.resource = client.ResourceV1Api(cluster.api_client)

    def template(self, name: str) -> dict:
        return json.loads(self.resource.read_namespaced_resource_claim_template(name, self.ns, _preload_content=False).data)

    def create(self, name: str, resources: dict, annotations: dict | None = None, ns: str | None = None, **kwargs: Any) -> dict:
        pod = gpu_pod(name, resources, annotations=annotations)
        response = self.cluster.api.create_namespaced_pod(ns or self.ns, pod, _preload_content=False, **kwargs)
        return json.loads(response.data)


@pytest.fixture(scope="module")
def hook(cluster) -> Iterator[Hook]:
    cp = cluster.cp
    pair = cp.ca.issue("webhook-dra", "qgpu-webhook", server=True, hosts=("127.0.0.1",))
    port = free_port()
    server = QgpuServer("qgpu-webhook-dra", ["webhook", "serve", "--address", "127.0.0.1", "--port", str(port),
                                             "--tls-cert-file", str(pair.cert), "--tls-private-key-file", str(pair.key),
                                             "--scheduler-name", "qgpu-scheduler", "--dra", "--dra-card-memory-mib", "15360",
                                             "--kubeconfig", str(cp.admin_kubeconfig), *cp.webhook_auth_args()],
                        cp.workdir, port, "https", cp.ca.cert_path, client_cert=cp.webhook_client)
    server.start(ready_path="/healthz")
    api = client.AdmissionregistrationV1Api(cluster.api_client)
    ca_bundle = base64.b64encode(cp.ca.pem).decode()
    name = f"qgpu-dra-{uuid.uuid4().hex[:6]}"

    def hook_of(path: str) -> dict:
        return {"name": f"{path}.qgpu.io", "admissionReviewVersions": ["v1"], "sideEffects": "NoneOnDryRun", "failurePolicy": "Fail",
                "timeoutSeconds": 10, "namespaceSelector": {"matchLabels": DRA_NAMESPACE},
                "clientConfig": {"url": f"{server.url}/{path}", "caBundle": ca_bundle},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["pods"]}]}

    api.create_validating_webhook_configuration({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
                                                 "metadata": {"name": name}, "webhooks": [hook_of("validate")]})
    api.create_mutating_webhook_configuration({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                                               "metadata": {"name": name}, "webhooks": [hook_of("mutate-dra")]})
    ns = cluster.namespace()
    cluster.api.patch_namespace(ns, {"metadata": {"labels": DRA_NAMESPACE}})
    h = Hook(cluster, ns, server)
    try:
        _wait_until_active(h)
        yield h
    finally:
        api.delete_validating_webhook_configuration(name)
        api.delete_mutating_webhook_configuration(name)
        server.stop()


def _wait_until_active(h: Hook) -> None:
    """The apiserver picks configurations up through a watch: probe with dry-run pods until one is converted."""
    deadline = time.monotonic() + 30
    while True:
        pod = h.create("probe", dict(QGPU), dry_run="All")
        if pod["spec"].get("resourceClaims"):
            return
        assert time.monotonic() < deadline, "webhook never became active"
        time.sleep(0.5)


def _claim_template(pod: dict, container: int = 0) -> str:
    (claim,) = pod["spec"]["containers"][container]["resources"]["claims"]
    (ref,) = [r for r in pod["spec"]["resourceClaims"] if r["name"] == claim["name"]]
    return ref["resourceClaimTemplateName"]


def _only_request(template: dict) -> dict:
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    return request


def test_qgpu_share_becomes_a_claim_on_a_template_with_qgpu_capacity(hook):
    pod = read_pod(hook.cluster.api, hook.ns, hook.create("qgpu", dict(QGPU))["metadata"]["name"])
    assert _claim_template(pod) == "qgpu-c300-m4096-x1"
    resources = pod["spec"]["containers"][0]["resources"]
    assert not any(k.startswith("tke.cloud.tencent.com/") for k in {**resources.get("limits", {}), **resources.get("requests", {})})
    assert pod["spec"].get("schedulerName") == "default-scheduler"  # kube-scheduler's own, no extender
    exactly = _only_request(hook.template("qgpu-c300-m4096-x1"))["exactly"]
    assert exactly["deviceClassName"] == dra.SHARED_CLASS
    assert exactly["capacity"]["requests"] == {"core": "300", "memory": "4096"}  # consumable capacity is on in 1.37


def test_vcuda_share_uses_the_same_template(hook):
    pod = hook.create("vcuda", {"tencent.com/vcuda-core": 30, "tencent.com/vcuda-memory": 16})
    assert _claim_template(pod) == "qgpu-c300-m4096-x1"


def test_t9k_whole_cards_become_a_whole_card_claim_on_distinct_cards(hook):
    pod = hook.create("t9k", {"tensorstack.dev/nvidia-gpu": 2})
    assert _claim_template(pod) == "qgpu-whole-x2"
    template = hook.template("qgpu-whole-x2")
    exactly = _only_request(template)["exactly"]
    assert (exactly["deviceClassName"], exactly["allocationMode"], exactly["count"]) == (dra.WHOLE_CLASS, "ExactCount", 2)
    assert template["spec"]["spec"]["devices"]["constraints"] == [{"requests": ["gpu"], "distinctAttribute": "gpu.qgpu.io/uuid"}]


def test_t9k_percent_asks_a_share_of_the_pools_card_size(hook):
    pod = hook.create("t9k-pct", {"tensorstack.dev/nvidia-gpu-percent": 50})
    (sub,) = _only_request(hook.template(_claim_template(pod)))["firstAvailable"]
    assert sub["capacity"]["requests"] == {"core": "10", "memory": "8192"}


def test_offline_pod_carries_class_and_greedy_in_the_opaque_config(hook):
    pod = hook.create("offline", {"tke.cloud.tencent.com/qgpu-core-greedy": 40, "tke.cloud.tencent.com/qgpu-memory": 2},
                      annotations={"tke.cloud.tencent.com/app-class": "offline", "qgpu.io/gpu-model": "Tesla T4"})
    template = hook.template(_claim_template(pod))
    devices = template["spec"]["spec"]["devices"]
    assert draclaim.read_share_config(devices["config"][0]["opaque"]["parameters"]) == ("offline", True)
    assert devices["requests"][0]["exactly"]["selectors"] == [{"cel": {"expression": 'device.attributes["gpu.qgpu.io"].model in ["Tesla T4"]'}}]
    assert pod["spec"]["nodeSelector"] == {"mixed-qgpu-enable": "enable"}


def test_an_existing_template_is_reused_though_the_apiserver_rewrote_its_quantities(hook):
    greedy = {"tke.cloud.tencent.com/qgpu-core-greedy": 100, "tke.cloud.tencent.com/qgpu-memory": 8}
    offline = {"tke.cloud.tencent.com/app-class": "offline"}
    first = hook.create("greedy-1", dict(greedy), annotations=offline)
    second = hook.create("greedy-2", dict(greedy), annotations=offline)  # 409, read back, same template
    assert _claim_template(first) == _claim_template(second) == "qgpu-c1000-m8192-x1-offline"
    stored = _only_request(hook.template("qgpu-c1000-m8192-x1-offline"))["exactly"]["capacity"]["requests"]
    assert stored == {"core": "1k", "memory": "8192"}  # canonical form, as kube-apiserver v1.37.2 stores it


def test_nvidia_gpu_stays_for_the_whole_card_class(hook):
    pod = hook.create("nvidia", {"nvidia.com/gpu": 1})
    assert not pod["spec"].get("resourceClaims")
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    # only a DRA pool makes kube-scheduler's claim, which the quota charges (issue F2)
    assert pod["spec"]["nodeSelector"][POOL_MODE_LABEL] == "dra"


def test_device_plugin_pods_keep_their_resources(hook):
    kept = hook.create("kept", dict(QGPU), annotations={GPU_MODE: GPU_MODE_DEVICE_PLUGIN})
    assert not kept["spec"].get("resourceClaims")
    assert kept["spec"]["containers"][0]["resources"]["limits"]["tke.cloud.tencent.com/qgpu-core"] == "30"
    assert kept["spec"]["schedulerName"] == "qgpu-scheduler"  # /mutate's completion, for the extender
    other = hook.cluster.namespace()  # a namespace of a device-plugin pool: /mutate-dra is not called
    untouched = hook.create("elsewhere", dict(QGPU), ns=other)
    assert not untouched["spec"].get("resourceClaims")
    assert untouched["spec"]["containers"][0]["resources"]["limits"]["tke.cloud.tencent.com/qgpu-memory"] == "4"


def test_invalid_pod_is_refused_with_the_parsers_message(hook):
    with pytest.raises(ApiException) as refused:
        hook.create("bad", {"tke.cloud.tencent.com/qgpu-core": 150, "tke.cloud.tencent.com/qgpu-memory": 4})
    message = json.loads(refused.value.body)["message"]
    assert refused.value.status == 422
    assert "mutate-dra.qgpu.io" in message
    assert "container 'c0': tke.cloud.tencent.com/qgpu-core=150: 100 or more must be a multiple of 100 (whole cards)" in message


def test_dry_run_answers_the_conversion_but_creates_nothing(hook):
    pod = hook.create("dry", {"tke.cloud.tencent.com/qgpu-core": 70, "tke.cloud.tencent.com/qgpu-memory": 7}, dry_run="All")
    assert _claim_template(pod) == "qgpu-c700-m7168-x1"
    with pytest.raises(ApiException) as missing:
        hook.template("qgpu-c700-m7168-x1")
    assert missing.value.status == 404
    with pytest.raises(ApiException) as no_pod:
        hook.cluster.api.read_namespaced_pod("dry", hook.ns)
    assert no_pod.value.status == 404


def test_a_changed_template_is_not_overwritten_and_the_pod_is_refused_with_the_reason(hook):
    manifest = {"apiVersion": dra.API_VERSION, "kind": "ResourceClaimTemplate", "metadata": {"name": "qgpu-c900-m1024-x1"},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": dra.WHOLE_CLASS}}]}}}}
    hook.resource.create_namespaced_resource_claim_template(hook.ns, manifest)
    with pytest.raises(ApiException) as refused:
        hook.create("clash", {"tke.cloud.tencent.com/qgpu-core": 90, "tke.cloud.tencent.com/qgpu-memory": 1})
    message = json.loads(refused.value.body)["message"]
    assert f"ResourceClaimTemplate {hook.ns}/qgpu-c900-m1024-x1: exists with another spec" in message


# --- the converted pods are allocatable: kube-scheduler places them on qgpu's slices ----------------

@dataclass
class Pool:
    node: str
    taint: dict
    ns: str


@pytest.fixture(scope="module")
def pool(cluster, hook) -> Iterator[Pool]:
    """One fake node with four T4s published as a qgpu ResourceSlice, tainted so that only this
    test's pods land there, and the resourceclaim controller that makes claims from templates."""
    cp = cluster.cp
    cp._spawn("kcm-resourceclaim", [str(cp.bindir / "kube-controller-manager"), f"--kubeconfig={cp.admin_kubeconfig}",
                                    "--controllers=resourceclaim-controller", "--leader-elect=false", "--secure-port=0"])
    # A DRA pool needs no extender: its own kube-scheduler profile, as the session's routes every
    # GPU resource (nvidia.com/gpu included) to qgpu's extender.
    config = cp._write_yaml("scheduler-dra.yaml", {
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(cp.scheduler_kubeconfig)}, "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": DRA_SCHEDULER}]})
    cp._spawn("kube-scheduler-dra", [str(cp.bindir / "kube-scheduler"), f"--config={config}", "--secure-port=0", "--v=2"])
    node = f"dra-{uuid.uuid4().hex[:8]}"
    taint = {"key": "qgpu-test-dra", "value": node, "effect": "NoSchedule"}
    gpu_node(cluster.api, node, [])
    # labelled as qgpu_node_pool labels a DRA pool: /mutate-dra pins nvidia.com/gpu pods to it
    cluster.api.patch_node(node, {"metadata": {"labels": {POOL_MODE_LABEL: "dra"}}, "spec": {"taints": [taint]}})
    with qgpu_device_classes(hook.resource):  # deleted at the end: the whole-card class maps nvidia.com/gpu
        cards = [CardInfo(index=i, uuid=f"GPU-{node}-{i}", model="Tesla T4", memory_mib=15360, minor=i) for i in range(4)]
        hook.resource.create_resource_slice({
            "apiVersion": dra.API_VERSION, "kind": "ResourceSlice", "metadata": {"name": dra.slice_name(node)},
            "spec": {"driver": dra.DRIVER, "nodeName": node, "pool": {"name": dra.pool_name(node), "generation": 1, "resourceSliceCount": 1},
                     "devices": [dra.slice_device(card, "fixed-share") for card in cards]}})
        try:
            yield Pool(node, taint, hook.ns)
        finally:
            cp._stop_process("kcm-resourceclaim")
            cp._stop_process("kube-scheduler-dra")
            hook.resource.delete_resource_slice(dra.slice_name(node))
            cluster.api.delete_node(node)


def _place(hook: Hook, pool: Pool, name: str, resources: dict, annotations: dict | None = None) -> None:
    pod = gpu_pod(name, resources, annotations=annotations, selector={"kubernetes.io/hostname": pool.node})
    pod["spec"]["tolerations"] = [{**pool.taint, "operator": "Equal"}]
    pod["spec"]["schedulerName"] = DRA_SCHEDULER
    hook.cluster.api.create_namespaced_pod(pool.ns, pod)


def _shares(hook: Hook, pool: Pool, name: str) -> list[draclaim.ClaimShare]:
    def bound() -> dict | None:
        pod = read_pod(hook.cluster.api, pool.ns, name)
        return pod if pod["spec"].get("nodeName") else None

    pod = poll(bound, timeout=60, interval=0.5, what=f"pod {name} bound")
    assert pod["spec"]["nodeName"] == pool.node
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim = json.loads(hook.resource.read_namespaced_resource_claim(status["resourceClaimName"], pool.ns, _preload_content=False).data)
    return draclaim.claim_shares(claim, pool.node)


def test_converted_pods_are_allocated_the_capacity_they_asked(hook, pool):
    _place(hook, pool, "a-share", dict(QGPU))
    _place(hook, pool, "b-whole", {"tensorstack.dev/nvidia-gpu": 2})
    _place(hook, pool, "c-percent", {"tensorstack.dev/nvidia-gpu-percent": 50})
    (share,) = _shares(hook, pool, "a-share")
    assert (share.core_milli, share.memory_mib) == (300, 4096)
    whole = _shares(hook, pool, "b-whole")
    assert len({s.card_index for s in whole}) == 2 and all(s.core_milli == 1000 and s.memory_mib == 15360 for s in whole)
    (percent,) = _shares(hook, pool, "c-percent")
    assert (percent.core_milli, percent.memory_mib) == (10, 8192)
    assert percent.card_index not in {s.card_index for s in whole}


def test_nvidia_gpu_is_a_whole_card_through_the_classes_extended_resource_name(hook, pool):
    _place(hook, pool, "d-nvidia", {"nvidia.com/gpu": 1})

    def bound() -> dict | None:
        pod = read_pod(hook.cluster.api, pool.ns, "d-nvidia")
        return pod if pod["spec"].get("nodeName") and pod.get("status", {}).get("extendedResourceClaimStatus") else None

    pod = poll(bound, timeout=60, interval=0.5, what="d-nvidia bound with its extended-resource claim")
    assert pod["spec"]["nodeName"] == pool.node and not pod["spec"].get("resourceClaims")
    name = pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    claim = json.loads(hook.resource.read_namespaced_resource_claim(name, pool.ns, _preload_content=False).data)
    (share,) = draclaim.claim_shares(claim, pool.node)
    assert (share.core_milli, share.memory_mib) == (1000, 15360)
    # the pod quota credits that claim to the pod only because kube-scheduler made the pod its
    # controller: checked on the real objects (a status naming another claim credits nothing)
    assert claim_controllers([claim], pool.ns) == {name: pod["metadata"]["uid"]}
    # (read as a pod from before /mutate-dra pinned pods to DRA pools, which the pin alone credits)
    unpinned = {**pod, "spec": {**pod["spec"], "nodeSelector": {}}}
    seen = {name: ClaimSeen(claim_usage(claim), pod["metadata"]["uid"])}
    assert pod_usage(unpinned, dra_namespace=True, claims=seen) == Usage()
    assert pod_usage(unpinned, dra_namespace=True, claims={}) == pod_usage(unpinned) != Usage()


def test_a_pod_naming_another_model_is_not_allocated(hook, pool):
    _place(hook, pool, "v100-only", dict(QGPU), annotations={"qgpu.io/gpu-model": "Tesla V100"})

    def unschedulable() -> str | None:
        conditions = read_pod(hook.cluster.api, pool.ns, "v100-only").get("status", {}).get("conditions") or []
        return next((c.get("message", "") for c in conditions if c["type"] == "PodScheduled" and c["status"] == "False"), None)

    message = poll(unschedulable, timeout=60, interval=0.5, what="v100-only unschedulable")
    assert "claim" in message, message
    assert not read_pod(hook.cluster.api, pool.ns, "v100-only")["spec"].get("nodeName")


def test_an_identity_without_rbac_gets_the_apiservers_refusal_naming_the_template(cluster, hook):
    cp = cluster.cp
    pair = cp.ca.issue("no-rbac", "qgpu-webhook-without-rbac", client=True)
    config = cp._write_yaml("no-rbac.kubeconfig", kubeconfig(cp.server, cp.ca.cert_path, pair, "qgpu-webhook-without-rbac"))
    writer = TemplateWriter(api_client(str(config)))
    (template,) = convert(gpu_pod("p", {"tke.cloud.tencent.com/qgpu-core": 20, "tke.cloud.tencent.com/qgpu-memory": 2})).templates
    with pytest.raises(TemplateError) as refused:
        writer(hook.ns, [template])
    assert str(refused.value).startswith(f"ResourceClaimTemplate {hook.ns}/qgpu-c200-m2048-x1: the apiserver refused to read it: 403 Forbidden: ")
    assert 'cannot get resource "resourceclaimtemplates"' in str(refused.value)
