"""Which Leases the extender's and the webhook's ServiceAccounts can write, with real tokens.

Issue 21 §3: the extender's Role granted get, create and update on every Lease of its namespace,
kube-system by default, so its token could take kube-scheduler's leader Lease (kube-scheduler logs
"leaderelection lost", exits, and nothing in the cluster is scheduled any more) or renew
kube-controller-manager's. The RBAC and admission policies here are the deployment templates',
rendered with the roles' defaults, in two places: qgpu's own namespace (the default, qgpu-system)
and kube-system (an operator's choice, where only the admission policies hold the names). Writes
to another component's Lease are dry runs: a policy that failed to refuse one changes nothing.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from qgpu_runtime.contract.names import CLAIM_QUOTA_LEASE_PREFIX, COMMITMENTS_LEASE_PREFIX
from tests.k8s.conftest import Cluster
from tests.k8s.rbac import render_template, wait_pod_policies_lifted, wait_policies_enforced

PAUSE = "registry.k8s.io/pause:3.10"
KUBE_SYSTEM = "kube-system"
# the control plane's leader-election Leases (kube-scheduler, kube-controller-manager)
LEADERS = ("kube-scheduler", "kube-controller-manager")


@dataclass
class Deployed:
    """The rendered objects of both templates applied in ``ns``, and a Lease client per identity."""

    cluster: Cluster
    ns: str
    applied: list[dict[str, Any]] = field(default_factory=list)
    made: list[tuple[str, str]] = field(default_factory=list)  # (namespace, name) of Leases to delete
    extender: client.CoordinationV1Api | None = None
    webhook: client.CoordinationV1Api | None = None

    @property
    def leases(self) -> client.CoordinationV1Api:
        return client.CoordinationV1Api(self.cluster.api_client)

    def apply(self) -> None:
        dynamic = DynamicClient(self.cluster.api_client)
        docs = (render_template("qgpu-scheduler.yaml.j2", qgpu_scheduler_namespace=self.ns)
                + render_template("qgpu-webhook.yaml.j2", qgpu_webhook_namespace=self.ns, qgpu_webhook_dra=True,
                                  qgpu_webhook_image="qgpu:test", qgpu_webhook_ca_bundle="", qgpu_webhook_tls_crt="",
                                  qgpu_webhook_tls_key="", qgpu_webhook_client_ca=""))
        for doc in docs:
            if doc["kind"] in ("DaemonSet", "Deployment", "Secret", "Service") or "WebhookConfiguration" in doc["kind"]:
                continue  # the workloads and their serving: these tests act with the identities directly
            resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            resource.create(body=doc, namespace=doc["metadata"].get("namespace"))
            self.applied.append(doc)

    def token_client(self, account: str) -> client.CoordinationV1Api:
        out = self.cluster.api.create_namespaced_service_account_token(account, self.ns, {"spec": {"expirationSeconds": 600}})
        cp = self.cluster.cp
        conf = client.Configuration()
        conf.host = cp.server
        conf.ssl_ca_cert = str(cp.ca.cert_path)
        conf.api_key = {"authorization": f"Bearer {out.status.token}"}
        return client.CoordinationV1Api(client.ApiClient(conf))

    def victim(self, namespace: str, name: str) -> dict[str, Any]:
        """Lease ``namespace/name`` as its owner (the cluster admin here) holds it, made if absent."""
        try:
            return read(self.leases, namespace, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
        self.leases.create_namespaced_lease(namespace, lease(name, holder=name))
        self.made.append((namespace, name))
        return read(self.leases, namespace, name)

    def close(self) -> None:
        for namespace, name in self.made:
            quietly(lambda: self.leases.delete_namespaced_lease(name, namespace))
        dynamic = DynamicClient(self.cluster.api_client)
        for doc in reversed(self.applied):
            resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            quietly(lambda: resource.delete(name=doc["metadata"]["name"], namespace=doc["metadata"].get("namespace")))
        wait_pod_policies_lifted(self.cluster.api, self.ns)


def lease(name: str, holder: str = "", annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "annotations": annotations or {}},
            "spec": {"holderIdentity": holder} if holder else {}}


def read(api: client.CoordinationV1Api, namespace: str, name: str) -> dict[str, Any]:
    return json.loads(api.read_namespaced_lease(name, namespace, _preload_content=False).data)


def quietly(call: Callable[[], Any]) -> None:
    try:
        call()
    except ApiException:
        pass


def refusal(call: Callable[[], Any]) -> str:
    """The apiserver's message for a refused write; fails the test when the write goes through (or
    fails for another reason, e.g. 409 AlreadyExists after authorization and admission let it by)."""
    try:
        call()
    except ApiException as exc:
        assert exc.status in (403, 422), f"{exc.status}: {exc.body}"
        return str(json.loads(exc.body or "{}").get("message", exc.body))
    raise AssertionError("the write was allowed")


def wait_until_enforced(d: Deployed, timeout: float = 30.0) -> None:
    """Admission policies reach the admission chain through informers, each policy and binding on its
    own: poll, for each template, a dry-run write that RBAC allows and only that template's LAST
    policy refuses, until it is refused — the extender renaming a pod's label (the scheduler
    template's last policy) and the webhook creating a Lease of a name not its own (the webhook
    template's only one). Probing one template only raced the other's policy (a CI run saw the
    webhook's writes allowed for a moment after the extender's were refused)."""
    pods = d.cluster.api
    name = f"probe-{uuid.uuid4().hex[:6]}"
    pods.create_namespaced_pod(d.ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                                      "spec": {"schedulerName": "qgpu-test-nobody", "containers": [{"name": "c", "image": PAUSE}]}})
    token = d.cluster.api.create_namespaced_service_account_token("qgpu-scheduler", d.ns, {"spec": {"expirationSeconds": 600}})
    conf = client.Configuration()
    conf.host = d.cluster.cp.server
    conf.ssl_ca_cert = str(d.cluster.cp.ca.cert_path)
    conf.api_key = {"authorization": f"Bearer {token.status.token}"}
    core = client.CoreV1Api(client.ApiClient(conf))
    assert d.webhook is not None
    webhook = d.webhook
    try:
        wait_policies_enforced({
            "qgpu-scheduler-allocation-only": lambda: core.patch_namespaced_pod(
                name, d.ns, {"metadata": {"labels": {"probe": "x"}}}, dry_run="All",
                _content_type="application/merge-patch+json"),
            "qgpu-webhook-own-names": lambda: webhook.create_namespaced_lease(
                d.ns, lease(f"probe-{uuid.uuid4().hex[:6]}"), dry_run="All"),
        }, timeout)
    finally:
        quietly(lambda: pods.delete_namespaced_pod(name, d.ns, grace_period_seconds=0))


@pytest.fixture(scope="module", params=["qgpu-namespace", KUBE_SYSTEM])
def deployed(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[Deployed]:
    ns = cluster.namespace() if request.param == "qgpu-namespace" else KUBE_SYSTEM
    d = Deployed(cluster, ns)
    try:
        d.apply()
        d.extender = d.token_client("qgpu-scheduler")
        d.webhook = d.token_client("qgpu-webhook")
        wait_until_enforced(d)
        yield d
    finally:
        d.close()


def places(d: Deployed) -> list[str]:
    """Where the control plane's Leases are (kube-system) and qgpu's own namespace, once each."""
    return sorted({KUBE_SYSTEM, d.ns})


@pytest.mark.parametrize("identity", ["extender", "webhook"])
def test_no_qgpu_token_updates_a_leader_election_lease(deployed: Deployed, identity: str) -> None:
    api = getattr(deployed, identity)
    for namespace in places(deployed):
        for name in LEADERS:
            victim = deployed.victim(namespace, name)
            taken = {**victim, "spec": {**victim.get("spec", {}), "holderIdentity": f"qgpu-{identity}"}}
            message = refusal(lambda: api.replace_namespaced_lease(name, namespace, taken, dry_run="All"))
            assert "forbidden" in message.lower() or "qgpu" in message, message
            assert read(deployed.leases, namespace, name)["spec"].get("holderIdentity") == victim["spec"].get("holderIdentity")


@pytest.mark.parametrize("identity", ["extender", "webhook"])
def test_no_qgpu_token_creates_a_leader_election_lease(deployed: Deployed, identity: str) -> None:
    api = getattr(deployed, identity)
    for namespace in places(deployed):
        name = f"kube-scheduler-{uuid.uuid4().hex[:6]}"  # a name no Lease has: only a refusal stops the create
        refusal(lambda: api.create_namespaced_lease(namespace, lease(name, holder="qgpu"), dry_run="All"))
        refusal(lambda: api.create_namespaced_lease(namespace, lease(LEADERS[1]), dry_run="All"))


def test_the_extender_cannot_write_the_webhooks_ledger_nor_the_webhook_its_commitments(deployed: Deployed) -> None:
    ledger = deployed.victim(deployed.ns, f"{CLAIM_QUOTA_LEASE_PREFIX}victim")
    message = refusal(lambda: deployed.extender.replace_namespaced_lease(ledger["metadata"]["name"], deployed.ns, ledger,
                                                                         dry_run="All"))
    assert "qgpu-scheduler" in message and COMMITMENTS_LEASE_PREFIX in message, message
    commitments = deployed.victim(deployed.ns, f"{COMMITMENTS_LEASE_PREFIX}victim")
    message = refusal(lambda: deployed.webhook.replace_namespaced_lease(commitments["metadata"]["name"], deployed.ns,
                                                                        commitments, dry_run="All"))
    assert "qgpu-webhook" in message and CLAIM_QUOTA_LEASE_PREFIX in message, message


@pytest.mark.parametrize(("identity", "prefix"), [("extender", COMMITMENTS_LEASE_PREFIX), ("webhook", CLAIM_QUOTA_LEASE_PREFIX)])
def test_each_identity_still_creates_reads_and_updates_its_own_leases(deployed: Deployed, identity: str, prefix: str) -> None:
    api = getattr(deployed, identity)
    name = f"{prefix}own-{uuid.uuid4().hex[:6]}"
    deployed.made.append((deployed.ns, name))
    api.create_namespaced_lease(deployed.ns, lease(name, annotations={"qgpu.io/test": "1"}))
    mine = json.loads(api.read_namespaced_lease(name, deployed.ns, _preload_content=False).data)
    mine["metadata"]["annotations"] = {"qgpu.io/test": "2"}
    api.replace_namespaced_lease(name, deployed.ns, mine)
    assert read(deployed.leases, deployed.ns, name)["metadata"]["annotations"] == {"qgpu.io/test": "2"}
    # ... and only in its own namespace: the same name elsewhere is refused
    elsewhere = "default"
    refusal(lambda: api.create_namespaced_lease(elsewhere, lease(name), dry_run="All"))
