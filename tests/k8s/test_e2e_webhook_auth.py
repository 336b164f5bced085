"""Who may call `qgpu webhook serve --dra` (issue 21 §2), against the real kube-apiserver v1.37,
which presents the client certificate of its admission configuration (controlplane.py,
``--admission-control-config-file``).

A forged AdmissionReview sent straight to the webhook without that certificate reserves nothing in
the claim-quota ledger and creates no ResourceClaimTemplate; the victim's own claim through the
apiserver is still admitted, and pods are still converted through the apiserver."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import uuid
from typing import Any, Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract.leases import ledger_name
from tests.k8s.controlplane import QgpuServer, free_port
from tests.k8s.kubeobjects import gpu_pod
from tests.k8s.test_e2e_claimquota_webhook import _claim, _quota, _review
from tests.polling import poll

LABEL = "qgpu-test-webhook-auth"
QGPU = {"tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 4}


class Hook:
    def __init__(self, cluster: Any, server: QgpuServer, ledger_ns: str, selector: dict[str, str]):
        self.cluster = cluster
        self.server = server
        self.ledger_ns = ledger_ns
        self.selector = selector
        self.resource = client.ResourceV1Api(cluster.api_client)
        self.leases = client.CoordinationV1Api(cluster.api_client)

    def namespace(self, quota_core: int) -> str:
        ns = self.cluster.namespace()
        self.cluster.api.patch_namespace(ns, {"metadata": {"labels": {**self.selector, "qgpu.io/gpu-mode": "dra"}}})
        self.cluster.api.create_namespaced_resource_quota(ns, _quota(quota_core))
        return ns

    def forge(self, path: str, request: dict, context: ssl.SSLContext | None) -> int:
        """POST a forged review straight to the webhook, as anything on the network could."""
        conn = http.client.HTTPSConnection("127.0.0.1", self.server.port, timeout=10, context=context)
        try:
            body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            return conn.getresponse().status
        finally:
            conn.close()

    def ledger(self, ns: str) -> dict | None:
        try:
            return self.leases.read_namespaced_lease(ledger_name(ns), self.ledger_ns).to_dict()
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def templates(self, ns: str) -> list[str]:
        items = json.loads(self.resource.list_namespaced_resource_claim_template(ns, _preload_content=False).data)["items"]
        return [t["metadata"]["name"] for t in items]


@pytest.fixture(scope="module")
def hook(cluster) -> Iterator[Hook]:
    cp = cluster.cp
    ledger_ns = cluster.namespace()
    pair = cp.ca.issue("webhook-auth", "qgpu-webhook", server=True, hosts=("127.0.0.1",))
    port = free_port()
    server = QgpuServer("qgpu-webhook-auth", [
        "webhook", "serve", "--address", "127.0.0.1", "--port", str(port), "--tls-cert-file", str(pair.cert),
        "--tls-private-key-file", str(pair.key), "--dra", "--dra-card-memory-mib", "15360", "--kubeconfig",
        str(cp.admin_kubeconfig), "--quota-ledger-namespace", ledger_ns, *cp.webhook_auth_args()],
        cp.workdir, port, "https", cp.ca.cert_path, client_cert=cp.webhook_client)
    server.start(ready_path="/healthz")
    selector = {LABEL: uuid.uuid4().hex[:8]}
    name = f"qgpu-auth-{selector[LABEL]}"
    ca_bundle = base64.b64encode(cp.ca.pem).decode()

    def entry(path: str, rule: dict) -> dict:
        return {"name": f"{path}.qgpu.io", "admissionReviewVersions": ["v1"], "sideEffects": "NoneOnDryRun",
                "failurePolicy": "Fail", "timeoutSeconds": 10, "namespaceSelector": {"matchLabels": selector},
                "clientConfig": {"url": f"{server.url}/{path}", "caBundle": ca_bundle}, "rules": [rule]}

    api = client.AdmissionregistrationV1Api(cluster.api_client)
    api.create_validating_webhook_configuration({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration", "metadata": {"name": name},
        "webhooks": [entry("validate-claim", {"apiGroups": ["resource.k8s.io"], "apiVersions": ["*"], "operations": ["CREATE"],
                                              "resources": ["resourceclaims"]})]})
    api.create_mutating_webhook_configuration({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration", "metadata": {"name": name},
        "webhooks": [entry("mutate-dra", {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]})]})
    h = Hook(cluster, server, ledger_ns, selector)
    try:
        probe = h.namespace(quota_core=0)

        def active() -> bool:
            try:
                h.resource.create_namespaced_resource_claim(probe, _claim("probe", 100), dry_run="All", _preload_content=False)
            except ApiException as exc:
                return exc.status == 422  # the webhook judged it over the zero quota
            return False

        poll(active, timeout=30, interval=0.5, what="the webhook configurations to become active")
        yield h
    finally:
        api.delete_validating_webhook_configuration(name)
        api.delete_mutating_webhook_configuration(name)
        server.stop()


def _anonymous(hook: Hook) -> ssl.SSLContext:
    """Trusts the webhook's serving certificate, presents no client certificate."""
    return ssl.create_default_context(cafile=str(hook.server.ca_file))


def test_a_forged_claim_review_reserves_nothing_and_the_victims_claim_is_admitted(hook):
    victim = hook.namespace(quota_core=1000)
    forged = _review(victim, "squatter", 1000)
    assert hook.forge("/validate-claim", forged, _anonymous(hook)) == 401
    assert hook.ledger(victim) is None  # no reservation in the victim's ledger
    hook.resource.create_namespaced_resource_claim(victim, _claim("mine", 1000), _preload_content=False)
    assert hook.resource.read_namespaced_resource_claim("mine", victim) is not None


def test_a_forged_pod_review_creates_no_template(hook):
    victim = hook.namespace(quota_core=1000)
    pod = gpu_pod("forged", dict(QGPU))
    pod["metadata"]["namespace"] = victim
    request = {"uid": str(uuid.uuid4()), "operation": "CREATE", "namespace": victim, "name": "forged",
               "kind": {"group": "", "version": "v1", "kind": "Pod"}, "object": pod}
    assert hook.forge("/mutate-dra", request, _anonymous(hook)) == 401
    assert hook.templates(victim) == []


def test_the_apiserver_presents_its_certificate_and_pods_are_converted_through_it(hook):
    """The same webhook, called by the apiserver: the pod is converted, the template created, and a
    claim over the quota is refused with the figures (the quota check ran)."""
    ns = hook.namespace(quota_core=1000)
    pod = json.loads(hook.cluster.api.create_namespaced_pod(ns, gpu_pod("real", dict(QGPU)), _preload_content=False).data)
    assert pod["spec"].get("resourceClaims"), pod["spec"]
    assert hook.templates(ns) == ["qgpu-c300-m4096-x1"]
    with pytest.raises(ApiException) as refused:
        hook.resource.create_namespaced_resource_claim(ns, _claim("too-big", 1001), _preload_content=False)
    assert refused.value.status == 422 and "requested 1001 > hard 1000" in json.loads(refused.value.body)["message"]


def test_the_apiservers_admission_certificate_is_what_the_webhook_accepts(hook):
    """Directly, with the certificate the apiserver's admission configuration names: answered."""
    ns = hook.namespace(quota_core=1000)
    context = hook.server.ssl_context()
    assert hook.forge("/validate-claim", {**_review(ns, "direct", 100), "dryRun": True}, context) == 200
