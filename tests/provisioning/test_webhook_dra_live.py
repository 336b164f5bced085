"""The DRA webhook manifest the qgpu_webhook role renders, live on the real kube-apiserver v1.37:
`qgpu webhook serve --dra` running as the rendered ServiceAccount, bound only by the rendered RBAC,
registered by the rendered configuration entries (CEL conditions compiled by the apiserver),
converts pods and enforces the claim quota; the rendered admission policy refuses its identity any
template or Lease outside qgpu's names."""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from test_webhook_dra_render import render

from qgpu_runtime.contract.dra import SHARED_CLASS
from qgpu_runtime.webhook.claimquota import CORE_QUOTA, MEMORY_QUOTA
from tests.k8s.controlplane import QgpuServer, free_port
from tests.k8s.kubeobjects import gpu_pod
from tests.polling import poll

LABEL = "qgpu-test-webhook-dra-live"


class Live:
    def __init__(self, cluster: Any, ns: str, selector: dict[str, str], sa_config: Path):
        self.cluster = cluster
        self.ns = ns  # the webhook's own namespace
        self.selector = selector
        self.sa_config = sa_config
        self.sa_client = client.ApiClient(_configuration(sa_config))

    def namespace(self, **labels: str) -> str:
        ns = self.cluster.namespace()
        self.cluster.api.patch_namespace(ns, {"metadata": {"labels": {**self.selector, **labels}}})
        return ns


def _configuration(path: Path) -> client.Configuration:
    from kubernetes import config

    configuration = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=configuration)
    return configuration


def _sa_kubeconfig(cluster: Any, ns: str, path: Path) -> Path:
    token = cluster.api.create_namespaced_service_account_token("qgpu-webhook", ns, client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=1200))).status.token
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "c", "cluster": {"server": cluster.cp.server, "certificate-authority": str(cluster.cp.ca.cert_path)}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa"}}]}))
    return path


def _create(api_client: client.ApiClient, doc: dict[str, Any]) -> None:
    from kubernetes import utils

    utils.create_from_dict(api_client, doc)


@pytest.fixture(scope="module")
def live(cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("webhook-dra-live")
    ns = cluster.namespace()
    suffix = uuid.uuid4().hex[:6]
    docs = render(tmp / "render", "dra", qgpu_webhook_namespace=ns, qgpu_webhook_dra_card_memory_mib=[15360])
    cp = cluster.cp
    pair = cp.ca.issue("webhook-dra-live", "qgpu-webhook", server=True, hosts=("127.0.0.1",))
    port = free_port()
    selector = {LABEL: suffix}
    created: list[tuple[str, str]] = []
    rbac = client.RbacAuthorizationV1Api(cluster.api_client)
    admission = client.AdmissionregistrationV1Api(cluster.api_client)
    server = None
    try:
        for doc in docs:
            kind, meta = doc["kind"], doc["metadata"]
            if kind in ("Secret", "Service", "Deployment"):
                continue  # the webhook runs here as a process, with the rendered account's token
            if kind in ("ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                        "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
                meta["name"] = f"{meta['name']}-{suffix}"  # cluster-wide names: one per test run
            if kind == "ClusterRoleBinding":
                doc["roleRef"]["name"] = f"{doc['roleRef']['name']}-{suffix}"
            if kind == "ValidatingAdmissionPolicyBinding":
                doc["spec"]["policyName"] = f"{doc['spec']['policyName']}-{suffix}"
            if kind.endswith("WebhookConfiguration"):
                for hook in doc["webhooks"]:
                    path = hook["clientConfig"]["service"]["path"]
                    hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": base64.b64encode(cp.ca.pem).decode()}
                    hook["namespaceSelector"]["matchExpressions"].append({"key": LABEL, "operator": "In", "values": [suffix]})
            if kind.endswith("WebhookConfiguration"):
                continue  # registered once the server runs
            _create(cluster.api_client, doc)
            created.append((kind, meta["name"]))
        sa_config = _sa_kubeconfig(cluster, ns, tmp / "sa.kubeconfig")
        (container,) = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"]
        args = [a for a in container["args"] if not a.startswith(("--port", "--address", "--tls-", "--client-ca-file"))]
        server = QgpuServer("qgpu-webhook-dra-live", ["webhook", "serve", "--address", "127.0.0.1", "--port", str(port),
                                                      "--tls-cert-file", str(pair.cert), "--tls-private-key-file", str(pair.key),
                                                      *args, "--kubeconfig", str(sa_config), *cp.webhook_auth_args()],
                            cp.workdir, port, "https", cp.ca.cert_path)
        server.start(ready_path="/healthz")
        for doc in docs:
            if doc["kind"] == "MutatingWebhookConfiguration":
                admission.create_mutating_webhook_configuration(doc)
                created.append((doc["kind"], doc["metadata"]["name"]))
            elif doc["kind"] == "ValidatingWebhookConfiguration":
                admission.create_validating_webhook_configuration(doc)
                created.append((doc["kind"], doc["metadata"]["name"]))
        yield Live(cluster, ns, selector, sa_config)
    finally:
        for kind, name in reversed(created):
            delete = {"MutatingWebhookConfiguration": admission.delete_mutating_webhook_configuration,
                      "ValidatingWebhookConfiguration": admission.delete_validating_webhook_configuration,
                      "ValidatingAdmissionPolicy": admission.delete_validating_admission_policy,
                      "ValidatingAdmissionPolicyBinding": admission.delete_validating_admission_policy_binding,
                      "ClusterRole": rbac.delete_cluster_role, "ClusterRoleBinding": rbac.delete_cluster_role_binding}.get(kind)
            if delete is not None:
                delete(name)
        if server is not None:
            server.stop()


def _claim(name: str, device_class: str, core: int) -> dict:
    exactly = {"deviceClassName": device_class, "capacity": {"requests": {"core": str(core), "memory": "1024"}}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}


def _refusal(call: Any) -> str | None:
    try:
        call()
    except ApiException as exc:
        return json.loads(exc.body)["message"]
    return None


def test_a_pod_in_a_dra_namespace_is_converted_with_the_rendered_rbac(live):
    ns = live.namespace(**{"qgpu.io/gpu-mode": "dra"})
    pod = poll(lambda: _converted(live, ns), timeout=30, interval=0.5, what="the pod converted by /mutate-dra")
    (ref,) = pod["spec"]["resourceClaims"]
    assert ref["resourceClaimTemplateName"] == "qgpu-c300-m4096-x1"
    client.ResourceV1Api(live.cluster.api_client).read_namespaced_resource_claim_template("qgpu-c300-m4096-x1", ns)


def _converted(live: Live, ns: str) -> dict | None:
    pod = json.loads(live.cluster.api.create_namespaced_pod(ns, gpu_pod(f"p-{uuid.uuid4().hex[:5]}", {
        "tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 4}), _preload_content=False).data)
    return pod if pod["spec"].get("resourceClaims") else None


def test_qgpu_claims_are_held_to_the_quota_and_other_drivers_claims_are_not_sent(live):
    ns = live.namespace()
    live.cluster.api.create_namespaced_resource_quota(ns, {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpu"},
                                                           "spec": {"hard": {CORE_QUOTA: "500", MEMORY_QUOTA: "65536"}}})
    resource = client.ResourceV1Api(live.cluster.api_client)

    def refused_over_quota() -> str | None:
        message = _refusal(lambda: resource.create_namespaced_resource_claim(ns, _claim("big", SHARED_CLASS, 600), dry_run="All"))
        return message if message and "exceeded quota" in message else None

    message = poll(refused_over_quota, timeout=30, interval=0.5, what="the claim-quota entry active")
    assert "gpu.qgpu.io/core used 0 + requested 600 > hard 500" in message
    resource.create_namespaced_resource_claim(ns, _claim("fits", SHARED_CLASS, 500))
    # another driver's claim is not judged (the matchCondition, compiled by the apiserver, sends only qgpu's classes)
    resource.create_namespaced_resource_claim(ns, _claim("other", "gpu.example.com", 5000))


def test_the_policy_holds_the_webhooks_account_to_qgpus_names(live):
    resource = client.ResourceV1Api(live.sa_client)
    leases = client.CoordinationV1Api(live.sa_client)
    ns = live.namespace()
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "users-template"},
                "spec": {"spec": {"devices": {"requests": []}}}}

    def refused_template() -> str | None:
        message = _refusal(lambda: resource.create_namespaced_resource_claim_template(ns, template, dry_run="All"))
        return message if message and "qgpu-webhook: ResourceClaimTemplate" in message else None

    message = poll(refused_template, timeout=30, interval=0.5, what="the admission policy active")
    assert message.endswith(f"qgpu-webhook: ResourceClaimTemplate {ns}/users-template: rule: the webhook writes only "
                            "templates named qgpu-*"), message
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "kube-scheduler"}, "spec": {}}
    message = _refusal(lambda: leases.create_namespaced_lease(live.ns, lease))
    assert message and f"qgpu-webhook: Lease {live.ns}/kube-scheduler: rule: the webhook writes only its claim-quota ledgers" in message
    # and RBAC: no Lease elsewhere, no claim writes, no deletes
    assert "forbidden" in (_refusal(lambda: leases.create_namespaced_lease(ns, {**lease, "metadata": {"name": "qgpu-claim-quota.x"}})) or "")
    assert "forbidden" in (_refusal(lambda: resource.create_namespaced_resource_claim(ns, _claim("c", SHARED_CLASS, 1))) or "")
    assert "forbidden" in (_refusal(lambda: resource.delete_namespaced_resource_claim_template("qgpu-x", ns)) or "")
