"""The Kubernetes half of site.yml against the real control plane of tests/k8s (issue 6).

`playbooks/node-pools.yml` and `playbooks/cluster.yml` — the very plays site.yml imports — run
with an inventory shaped like inventories/example (its pool group vars copied verbatim) whose
kubeconfig is the fixture's admin kubeconfig, against fake GPU nodes created through the API.
Everything is then read back from the apiserver: labels and taints per pool, the manager
DaemonSets, the extender DaemonSet, the webhook with its configurations, ServiceAccounts and RBAC.

There is no kubelet and no kube-controller-manager, so no pod of those workloads ever runs and a
rollout never completes: the inventory sets qgpu_manager_wait, qgpu_scheduler_wait and
qgpu_webhook_wait to false (documented role variables, default true). What is checked is what the
apiserver accepted, plus what the RBAC allows, asked of the apiserver's own authorizer.

The second half loads the `v1` KubeSchedulerConfiguration that kube_scheduler_extender renders
into a real kube-scheduler and schedules a GPU pod through the extender it names.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from ansible_tools import REPO, Run, ansible_playbook, expected_pool_labels
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError
from prometheus_client.parser import text_string_to_metric_families
from test_manager_observability import delete_service_monitor_crd, service_monitor_crd

from qgpu_runtime.contract.names import GROUP_MIN_MEMBER, RETIRED_FROM
from qgpu_runtime.contract.record import ALLOCATION, ASSIGNED
from qgpu_runtime.model.requests import GPU_RESOURCES
from qgpu_runtime.node.deviceplugin.resources import CATALOG, DEFAULT_RESOURCES
from qgpu_runtime.node.kube_client import KubePodSource
from qgpu_runtime.node.pods import PodSourceError
from qgpu_runtime.webhook.admission import WebhookConfig, mutation
from tests.k8s.conftest import Cluster
from tests.k8s.controlplane import ADMIN_USER
from tests.k8s.kubeobjects import (
    bound,
    cards,
    events_for,
    gpu_node,
    gpu_pod,
    patched,
    pool_xgn_taint,
    read_pod,
    tolerates,
    wait_for,
    xgn_taint_policy_active,
)

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "inventories" / "example"
POOLS = ("qgpu_pool_training", "qgpu_pool_inference", "qgpu_pool_mixed")
NAMESPACE = "qgpu-system"  # as in inventories/example (the roles create it)
POLICIES = ("best-effort", "fixed-share", "burst-share")
XGN_TAINT = pool_xgn_taint()
# The xgn taint of earlier releases, which no webhook-mutated pod tolerates: a run must remove it.
RETIRED_XGN_TAINT = {"key": "sched.tensorstack.dev/node-alloc-mode", "value": "xgn", "effect": "NoSchedule"}
# A label and a taint qgpu does not own, put on one node before the run: they must survive it.
FOREIGN_LABEL = ("team.example.com/owner", "ml-platform")
FOREIGN_TAINT = {"key": "dedicated.example.com/gpu", "value": "training", "effect": "NoSchedule"}
KUBE_PLAYS = ("playbooks/node-pools.yml", "playbooks/cluster.yml")


def example_pools() -> dict[str, list[str]]:
    hosts = yaml.safe_load((EXAMPLE / "hosts.yml").read_text())
    children = hosts["all"]["children"]["qgpu_gpu_nodes"]["children"]
    return {pool: sorted(children[pool]["hosts"]) for pool in POOLS}


@dataclass
class Site:
    cluster: Cluster
    inventory: Path
    root: Path
    pools: dict[str, list[str]]
    first: Run

    def group_vars(self, pool: str) -> dict[str, Any]:
        return yaml.safe_load((self.inventory / "group_vars" / f"{pool}.yml").read_text())

    def run(self) -> Run:
        return run_kube_plays(self.inventory)

    def label_nodes(self) -> Run:
        """playbooks/node-pools.yml alone: the play that labels and taints the nodes (site.yml's
        first Kubernetes play; cluster.yml writes no Node label or taint)."""
        return ansible_playbook("-i", str(self.inventory), KUBE_PLAYS[0])

    def node(self, name: str) -> dict[str, Any]:
        return json.loads(self.cluster.api.read_node(name, _preload_content=False).data)


def run_kube_plays(inventory: Path) -> Run:
    return ansible_playbook("-i", str(inventory), *KUBE_PLAYS)


def task_results(run: Run, task: str) -> dict[str, str]:
    """host -> ok/changed/skipping/failed for every host of one task, from the default callback."""
    results: dict[str, str] = {}
    inside = False
    for line in run.output.splitlines():
        if line.startswith("TASK ["):
            inside = f": {task}]" in line or f"[{task}]" in line
        elif inside:
            match = re.match(r"^(ok|changed|skipping|failed|fatal): \[([^\]\s]+)", line)
            if match:
                results[match.group(2)] = match.group(1)
    return results


def write_inventory(path: Path, cluster: Cluster, root: Path, pools: dict[str, list[str]]) -> None:
    (path / "group_vars").mkdir(parents=True)
    hosts = {"all": {"children": {
        "kube_control_plane": {"hosts": {}},
        "qgpu_standalone": {"hosts": {}},
        "qgpu_kube_api": {"hosts": {"localhost": None}},
        "qgpu_gpu_nodes": {"children": {pool: {"hosts": {h: None for h in names}} for pool, names in pools.items()}},
    }}}
    (path / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    (path / "group_vars" / "all.yml").write_text(yaml.safe_dump({
        # Every kubernetes.core call is delegated to the qgpu_kube_api host, this controller.
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "qgpu_kubeconfig": str(cluster.cp.admin_kubeconfig),
        "qgpu_namespace": NAMESPACE,
        "qgpu_image": "registry.example.com/qgpu/qgpu-runtime:0.1.0",
        "qgpu_root_prefix": str(root),
        # No kubelet, no controller-manager: nothing ever runs the pods, so no rollout completes.
        "qgpu_manager_wait": False,
        "qgpu_scheduler_wait": False,
        "qgpu_webhook_wait": False,
        # The session's extender binds as the cluster admin, not as qgpu-scheduler's ServiceAccount:
        # let it write the allocation record past qgpu-pod-annotations.
        "qgpu_scheduler_extra_pod_annotation_writers": [ADMIN_USER],
    }, sort_keys=False))
    for pool in pools:  # the example's pool settings, verbatim
        shutil.copy(EXAMPLE / "group_vars" / f"{pool}.yml", path / "group_vars" / f"{pool}.yml")


@pytest.fixture(scope="module")
def site(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    work = tmp_path_factory.mktemp("k8s-half")
    pools = example_pools()
    for pool, names in pools.items():
        model, memory = ("V100", 32768) if pool == "qgpu_pool_training" else ("T4", 16384)
        for name in names:
            gpu_node(cluster.api, name, cards(2, model, memory, node=name))
    first_training = pools["qgpu_pool_training"][0]
    cluster.api.patch_node(first_training, {"metadata": {"labels": dict([FOREIGN_LABEL])},
                                            "spec": {"taints": [FOREIGN_TAINT, RETIRED_XGN_TAINT]}})
    seed_an_earlier_release_in_kube_system(cluster)
    # The Prometheus Operator's CRD, as a cluster running it has: the role adds a ServiceMonitor.
    extensions = client.ApiextensionsV1Api(cluster.api_client)
    extensions.create_custom_resource_definition(service_monitor_crd())
    wait_for("the ServiceMonitor CRD served", lambda: service_monitors_served(cluster) or None, timeout=30, interval=0.5)
    write_inventory(work / "inventory", cluster, work / "root", pools)
    first = run_kube_plays(work / "inventory")
    if first.returncode != 0:  # what a failed install applied must not reach the next module on this cluster
        ansible_playbook("-i", str(work / "inventory"), "playbooks/teardown.yml")
        delete_webhook_configurations(cluster)
        delete_service_monitor_crd(cluster)
        pytest.fail(first.output[-6000:])
    site = Site(cluster, work / "inventory", work / "root", pools, first)
    yield site
    teardown = ansible_playbook("-i", str(site.inventory), "playbooks/teardown.yml")
    xgn_policy = [{"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind, "metadata": {"name": "qgpu-xgn-taint"}}
                  for kind in ("MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")]
    try:
        # beside the manifests: the extender's TLS Secret and the re-wiring watcher's identity, whose
        # token never expires (the record signing key stays, so a reinstall verifies running pods' records)
        beside = [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "qgpu-scheduler-tls", "namespace": NAMESPACE}},
                  {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "qgpu-scheduler-wiring-token", "namespace": NAMESPACE}},
                  {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "qgpu-scheduler-wiring", "namespace": NAMESPACE}},
                  {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "qgpu-scheduler-wiring", "namespace": "default"}},
                  {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "qgpu-scheduler-wiring", "namespace": "default"}}]
        left = [f"{d['kind']}/{d['metadata']['name']}" for d in rendered_objects(site) + xgn_policy + beside
                if live_object(cluster, d)]
        left += [f"Node/{n}: {k}" for names in pools.values() for n in names
                 for k in site.node(n)["metadata"]["labels"] if k in expected_pool_labels(site.group_vars(POOLS[0]))]
        left += [f"Namespace/{NAMESPACE}: {k}" for k in cluster.api.read_namespace(NAMESPACE).metadata.annotations or {}
                 if k in RETIRED_FROM]  # the next install searches kube-system again
    finally:
        delete_webhook_configurations(cluster)
        delete_service_monitor_crd(cluster)
    assert teardown.returncode == 0, teardown.output[-4000:]
    # the apiserver unloads the deleted taint policy asynchronously: later modules must not meet it
    wait_for("the xgn taint policy unloaded", lambda: not xgn_taint_policy_active(cluster.api) or None, timeout=60, interval=1.0)
    assert left == [], "teardown.yml left these behind"


# What a release that ran qgpu in kube-system left there (issue 21 §3), and a Lease that is not qgpu's.
OLD_NAMESPACE = "kube-system"
OLD_QGPU = [("apps/v1", "DaemonSet", "qgpu-scheduler"), ("v1", "ServiceAccount", "qgpu-webhook"),
            ("coordination.k8s.io/v1", "Lease", "qgpu-node.old-node"),
            ("coordination.k8s.io/v1", "Lease", "qgpu-claim-quota.old-team")]
NOT_QGPUS = "kube-scheduler-of-someone-else"


def seed_an_earlier_release_in_kube_system(cluster: Cluster) -> None:
    qgpu = {"app.kubernetes.io/part-of": "qgpu", "app.kubernetes.io/managed-by": "ansible"}
    dynamic = DynamicClient(cluster.api_client)
    docs = [
        {"apiVersion": "apps/v1", "kind": "DaemonSet",
         "metadata": {"name": "qgpu-scheduler", "labels": {**qgpu, "app.kubernetes.io/name": "qgpu-scheduler"}},
         "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "qgpu-scheduler"}},
                  "template": {"metadata": {"labels": {"app.kubernetes.io/name": "qgpu-scheduler"}},
                               "spec": {"containers": [{"name": "extender", "image": "registry.example.com/qgpu:old"}]}}}},
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "qgpu-webhook", "labels": {**qgpu, "app.kubernetes.io/name": "qgpu-webhook"}}},
        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "qgpu-node.old-node", "labels": {
            "app.kubernetes.io/managed-by": "qgpu", "app.kubernetes.io/component": "node-commitments"}}, "spec": {}},
        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "qgpu-claim-quota.old-team", "labels": {
            "app.kubernetes.io/managed-by": "qgpu-webhook", "app.kubernetes.io/component": "claim-quota-ledger"}}, "spec": {}},
        # someone else's Lease, even carrying qgpu's labels: its name is not qgpu's, so it stays
        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": NOT_QGPUS, "labels": {
            "app.kubernetes.io/managed-by": "qgpu", "app.kubernetes.io/component": "node-commitments"}},
         "spec": {"holderIdentity": "someone-else"}},
    ]
    for doc in docs:
        dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"]).create(body=doc, namespace=OLD_NAMESPACE)


def service_monitors_served(cluster: Cluster) -> bool:
    try:
        DynamicClient(cluster.api_client).resources.get(api_version="monitoring.coreos.com/v1", kind="ServiceMonitor")
    except ResourceNotFoundError:
        return False
    return True


def delete_webhook_configurations(cluster: Cluster) -> None:
    """Delete qgpu's webhook configurations if present: a fail-closed webhook left behind by a
    failed teardown would refuse every later pod of this control plane."""
    admission = client.AdmissionregistrationV1Api(cluster.api_client)
    for delete in (admission.delete_mutating_webhook_configuration, admission.delete_validating_webhook_configuration):
        try:
            delete("qgpu-webhook")
        except ApiException as exc:
            if exc.status != 404:
                raise


def live_object(cluster: Cluster, doc: dict[str, Any]) -> dict[str, Any] | None:
    """The object a manifest document names, as the apiserver has it; None when absent."""
    resource = DynamicClient(cluster.api_client).resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    try:
        return resource.get(name=doc["metadata"]["name"], namespace=doc["metadata"].get("namespace")).to_dict()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


# -- node pools --------------------------------------------------------------------------------


@pytest.mark.parametrize("pool", POOLS)
def test_node_labels_are_exactly_what_the_pool_group_vars_say(site: Site, pool: str) -> None:
    expected = expected_pool_labels(site.group_vars(pool))
    for name in site.pools[pool]:
        labels = site.node(name)["metadata"]["labels"]
        assert {key: labels.get(key) for key in expected} == expected, name


def test_the_first_run_reports_every_node_changed(site: Site) -> None:
    results = task_results(site.first, "Apply the pool's labels and taints")
    assert results == {name: "changed" for names in site.pools.values() for name in names}


def test_the_example_pools_are_what_the_docs_promise(site: Site) -> None:
    """Pins the three pools the example inventory documents, so the label test above cannot pass
    on group vars that lost their settings."""
    policy = "tke.cloud.tencent.com/qgpu-schedule-policy"
    training, inference, mixed = (site.node(site.pools[p][0])["metadata"]["labels"] for p in POOLS)
    assert (training[policy], training["sched.tensorstack.dev/node-alloc-mode"]) == ("fixed-share", "xgn")
    assert (inference[policy], inference["sched.tensorstack.dev/node-alloc-mode"]) == ("burst-share", "sgn")
    assert (mixed[policy], mixed["mixed-qgpu-enable"]) == ("best-effort", "enable")
    # No T9k mode in its group vars: a shared pool, which serves T9k's nvidia-gpu-percent by default.
    assert mixed["sched.tensorstack.dev/node-alloc-mode"] == "sgn"


def test_only_xgn_nodes_carry_the_xgn_taint(site: Site) -> None:
    for pool, names in site.pools.items():
        for name in names:
            taints = [{k: t[k] for k in ("key", "value", "effect")} for t in site.node(name)["spec"].get("taints") or []]
            if pool == "qgpu_pool_training":
                assert XGN_TAINT in taints, name
            else:
                assert taints == [], name


def test_the_retired_xgn_taint_is_removed(site: Site) -> None:
    node = site.node(site.pools["qgpu_pool_training"][0])
    assert RETIRED_XGN_TAINT["key"] not in [t["key"] for t in node["spec"]["taints"]]


def test_a_webhook_mutated_whole_card_t9k_pod_tolerates_the_taint_the_role_put_on(site: Site) -> None:
    """The pool role's taint as the apiserver holds it, against the webhook's own mutation."""
    node = site.node(site.pools["qgpu_pool_training"][0])
    qgpu_taints = [t for t in node["spec"]["taints"] if t["key"] != FOREIGN_TAINT["key"]]
    pod = gpu_pod("whole", {"tensorstack.dev/nvidia-gpu": 1})
    tolerations = patched(pod, mutation(pod, WebhookConfig()))["spec"]["tolerations"]
    assert qgpu_taints and all(tolerates(tolerations, t) for t in qgpu_taints), (qgpu_taints, tolerations)


def test_the_xgn_taint_follows_a_label_set_by_hand_on_a_node_of_no_pool(site: Site) -> None:
    """The role's MutatingAdmissionPolicy: a Node outside every pool, labelled xgn by a person
    (here the admin), is tainted as T9k taints it, and the taint goes with the label."""
    name = f"hand-labelled-{uuid.uuid4().hex[:8]}"
    gpu_node(site.cluster.api, name, cards(1, node=name))
    try:
        site.cluster.api.patch_node(name, {"metadata": {"labels": {"sched.tensorstack.dev/node-alloc-mode": "xgn"}}})
        assert [{k: t[k] for k in ("key", "value", "effect")} for t in site.node(name)["spec"]["taints"]] == [XGN_TAINT]
        site.cluster.api.patch_node(name, {"metadata": {"labels": {"sched.tensorstack.dev/node-alloc-mode": None}}})
        assert not site.node(name)["spec"].get("taints")
    finally:
        site.cluster.api.delete_node(name)


def test_foreign_labels_and_taints_survive(site: Site) -> None:
    node = site.node(site.pools["qgpu_pool_training"][0])
    assert node["metadata"]["labels"][FOREIGN_LABEL[0]] == FOREIGN_LABEL[1]
    taints = [{k: t[k] for k in ("key", "value", "effect")} for t in node["spec"]["taints"]]
    assert sorted(taints, key=lambda t: t["key"]) == [FOREIGN_TAINT, XGN_TAINT]


# -- manifests -------------------------------------------------------------------------------------


def rendered_objects(site: Site) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in ("qgpu-manager.yaml", "qgpu-scheduler.yaml", "qgpu-webhook.yaml"):
        docs += [d for d in yaml.safe_load_all((site.root / "etc/qgpu/manifests" / name).read_text()) if d]
    return docs


def test_every_rendered_object_is_in_the_apiserver(site: Site) -> None:
    docs = rendered_objects(site)
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap",  # the Grafana dashboard
                     "DaemonSet", "Deployment", "MutatingWebhookConfiguration",
                     "PodDisruptionBudget",  # the webhook's: a drain leaves a replica serving
                     "Role", "RoleBinding",  # the extender's node commitment Leases
                     "Secret", "Service", "ServiceAccount", "ServiceMonitor",  # the managers' metrics
                     "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ValidatingWebhookConfiguration"]
    for doc in docs:
        meta = doc["metadata"]
        live = live_object(site.cluster, doc)
        assert live is not None, f"{doc['kind']}/{meta['name']} not in the apiserver"
        assert live["metadata"]["labels"] == meta["labels"], f"{doc['kind']}/{meta['name']}"
        assert live["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "ansible"


def test_the_managers_metrics_are_behind_gpu_managers_service_and_a_service_monitor(site: Site) -> None:
    """With the Prometheus Operator's CRD in the cluster: the ServiceMonitor selects the headless
    Service, the Service selects every manager pod the DaemonSets make, and no scrape annotation
    doubles the targets; the dashboard ConfigMap holds the dashboard."""
    core = client.CoreV1Api(site.cluster.api_client)
    service = core.read_namespaced_service("gpu-manager-metric", NAMESPACE)
    assert service.spec.cluster_ip == "None"
    assert not (service.metadata.annotations or {}).get("prometheus.io/scrape")
    monitor = DynamicClient(site.cluster.api_client).resources.get(
        api_version="monitoring.coreos.com/v1", kind="ServiceMonitor").get(name="qgpu-manager", namespace=NAMESPACE).to_dict()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service.metadata.labels.items()
    assert monitor["spec"]["endpoints"][0]["port"] == service.spec.ports[0].name == "metrics"
    daemonsets = client.AppsV1Api(site.cluster.api_client).list_namespaced_daemon_set(
        NAMESPACE, label_selector="app.kubernetes.io/name=qgpu-manager").items
    assert daemonsets
    for ds in daemonsets:
        assert service.spec.selector.items() <= ds.spec.template.metadata.labels.items(), ds.metadata.name
    dashboard = core.read_namespaced_config_map("qgpu-grafana-dashboard", NAMESPACE)
    assert dashboard.metadata.labels["grafana_dashboard"] == "1"
    assert json.loads(dashboard.data["qgpu.json"]) == json.loads((REPO / "templates/grafana-dashboard.json").read_text())


def test_one_manager_daemonset_per_isolation_policy_on_its_pool(site: Site) -> None:
    apps = client.AppsV1Api(site.cluster.api_client)
    for policy in POLICIES:
        ds = apps.read_namespaced_daemon_set(f"qgpu-manager-{policy}", NAMESPACE)
        assert ds.spec.template.spec.node_selector == {"qgpu-device-enable": "enable",
                                                      "tke.cloud.tencent.com/qgpu-schedule-policy": policy}
        assert ds.spec.template.spec.service_account_name == "qgpu-manager"
        (container,) = ds.spec.template.spec.containers
        assert f"--isolation-policy={policy}" in container.args
        assert container.resources.limits and container.resources.requests
    # Every labelled pool node is selected by exactly one manager DaemonSet.
    for names in site.pools.values():
        for name in names:
            labels = site.node(name)["metadata"]["labels"]
            selecting = [p for p in POLICIES if labels.get("tke.cloud.tencent.com/qgpu-schedule-policy") == p
                         and labels.get("qgpu-device-enable") == "enable"]
            assert len(selecting) == 1, name


def test_extender_daemonset_runs_on_masters_on_loopback(site: Site) -> None:
    ds = client.AppsV1Api(site.cluster.api_client).read_namespaced_daemon_set("qgpu-scheduler", NAMESPACE)
    spec = ds.spec.template.spec
    assert spec.host_network is True and spec.service_account_name == "qgpu-scheduler"
    assert spec.node_selector == {"node-role.kubernetes.io/control-plane": ""}
    (container,) = spec.containers
    assert container.command == ["qgpu", "extender", "serve"]
    assert {"--port=12345", "--address=127.0.0.1"} <= set(container.args)


def test_webhook_configurations_trust_the_generated_ca_and_point_at_the_service(site: Site) -> None:
    admission = client.AdmissionregistrationV1Api(site.cluster.api_client)
    ca = (site.root / "etc/qgpu/pki/webhook/ca.crt").read_bytes()
    service = client.CoreV1Api(site.cluster.api_client).read_namespaced_service("qgpu-webhook", NAMESPACE)
    assert service.spec.selector == {"app.kubernetes.io/name": "qgpu-webhook"}
    deployment = client.AppsV1Api(site.cluster.api_client).read_namespaced_deployment("qgpu-webhook", NAMESPACE)
    # the one GPU quota (qgpu_webhook_pod_quota, default true) reads pods, claims and quotas: a token, and its ClusterRole
    assert deployment.spec.template.spec.automount_service_account_token is True
    assert client.RbacAuthorizationV1Api(site.cluster.api_client).read_cluster_role("qgpu-webhook-quota").rules
    for hooks, path in ((admission.read_mutating_webhook_configuration("qgpu-webhook"), "/mutate"),
                        (admission.read_validating_webhook_configuration("qgpu-webhook"), "/validate")):
        (hook,) = hooks.webhooks
        assert hook.failure_policy == "Fail"
        assert hook.client_config.service.to_dict() == {"name": "qgpu-webhook", "namespace": NAMESPACE,
                                                        "path": path, "port": 443}
        assert base64.b64decode(hook.client_config.ca_bundle) == ca


def test_the_webhook_is_live_fail_closed_except_in_exempt_namespaces(site: Site) -> None:
    """No webhook pod can run here, so a GPU pod in an ordinary namespace is refused (failurePolicy
    Fail): proof the apiserver calls the configuration. The documented exemptions still admit."""
    api = site.cluster.api
    ordinary = site.cluster.namespace()
    with pytest.raises(ApiException) as refused:
        api.create_namespaced_pod(ordinary, gpu_pod("refused", {"tke.cloud.tencent.com/qgpu-core": 10}))
    assert "qgpu.io" in refused.value.body and "failed calling webhook" in refused.value.body
    exempt = exempt_namespace(site.cluster)
    api.create_namespaced_pod(exempt, gpu_pod("admitted", {"tke.cloud.tencent.com/qgpu-core": 10}))


def exempt_namespace(cluster: Cluster) -> str:
    """A namespace the qgpu webhooks skip (label qgpu.io/webhook=disabled)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.api.create_namespace({"apiVersion": "v1", "kind": "Namespace",
                                  "metadata": {"name": name, "labels": {"qgpu.io/webhook": "disabled"}}})
    return name


# -- RBAC --------------------------------------------------------------------------------------


def can(cluster: Cluster, account: str, verb: str, resource: str, *, namespace: str | None = None,
        subresource: str | None = None, group: str = "") -> bool:
    """`kubectl auth can-i --as system:serviceaccount:...`, answered by the apiserver's RBAC authorizer."""
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=f"system:serviceaccount:{NAMESPACE}:{account}",
        groups=["system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}", "system:authenticated"],
        resource_attributes=client.V1ResourceAttributes(verb=verb, resource=resource, namespace=namespace,
                                                        subresource=subresource, group=group)))
    return bool(client.AuthorizationV1Api(cluster.api_client).create_subject_access_review(review).status.allowed)


MANAGER_ALLOWED = [("list", "pods", None), ("watch", "pods", None), ("patch", "pods", "default"), ("get", "nodes", None),
                   ("patch", "nodes", None), ("create", "events", "default")]
EXTENDER_ALLOWED = [("list", "pods", None), ("watch", "pods", None), ("get", "pods", "default"),
                    ("patch", "pods", "default"), ("list", "nodes", None), ("watch", "nodes", None)]
# What none may do: read secrets (cluster-wide or next to them), delete or create nodes and
# pods, touch RBAC or admission.
FORBIDDEN = [("get", "secrets", None), ("list", "secrets", None), ("get", "secrets", NAMESPACE),
             ("delete", "nodes", None), ("create", "nodes", None), ("delete", "pods", "default"),
             ("create", "pods", "default"), ("update", "nodes", None)]


@pytest.mark.parametrize("account,allowed,forbidden", [
    # the manager creates Warning Events when its isolation loop acts on a pod; nothing else does
    ("qgpu-manager", MANAGER_ALLOWED, FORBIDDEN + [("list", "nodes", None),
                                                   ("watch", "nodes", None)]),
    ("qgpu-scheduler", EXTENDER_ALLOWED, FORBIDDEN + [("patch", "nodes", None), ("create", "events", "default")]),
    # the one GPU quota (qgpu_webhook_pod_quota): list pods and quotas, read nothing else of them
    ("qgpu-webhook", [("list", "pods", None), ("list", "resourcequotas", "default")],
     FORBIDDEN + [e for e in EXTENDER_ALLOWED if e != ("list", "pods", None)]
     + [("patch", "nodes", None), ("create", "events", "default"), ("get", "resourcequotas", "default")]),
])
def test_service_accounts_have_least_privilege(site: Site, account: str, allowed: list, forbidden: list) -> None:
    assert [a for a in allowed if not can(site.cluster, account, a[0], a[1], namespace=a[2])] == []
    assert [f for f in forbidden if can(site.cluster, account, f[0], f[1], namespace=f[2])] == []
    wildcard = client.RbacAuthorizationV1Api(site.cluster.api_client).list_cluster_role(
        label_selector="app.kubernetes.io/part-of=qgpu").items
    assert all("*" not in (r.verbs + r.resources + (r.api_groups or [])) for role in wildcard for r in role.rules)


def test_extender_may_create_bindings(site: Site) -> None:
    assert can(site.cluster, "qgpu-scheduler", "create", "pods", namespace="default", subresource="binding")
    assert not can(site.cluster, "qgpu-manager", "create", "pods", namespace="default", subresource="binding")


def service_account_kubeconfig(cluster: Cluster, account: str, path: Path, node: str | None = None) -> Path:
    """A kubeconfig holding a short-lived token of the ServiceAccount (TokenRequest API). With
    ``node``: bound to a pod of that account on that node, as the kubelet mounts it into the
    manager's pod (the token then carries the node's name, which the admission policy checks)."""
    bound = None
    if node is not None:
        name = f"{account}-token-holder"
        try:
            cluster.api.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
        except ApiException:
            pass
        holder = cluster.api.create_namespaced_pod(NAMESPACE, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "serviceAccountName": account, "automountServiceAccountToken": False,
                     "tolerations": [{"operator": "Exists"}], "containers": [{"name": "c", "image": "x"}]}})
        bound = client.V1BoundObjectReference(kind="Pod", api_version="v1", name=name, uid=holder.metadata.uid)
    token = cluster.api.create_namespaced_service_account_token(
        account, NAMESPACE, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=600, bound_object_ref=bound))).status.token
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "c", "cluster": {"server": cluster.cp.server,
                                               "certificate-authority": str(cluster.cp.ca.cert_path)}}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": account}}],
    }))
    return path


def test_the_manager_code_works_with_its_service_account_and_no_more(site: Site, tmp_path: Path) -> None:
    """The node manager's own API door (KubePodSource), authenticated as the qgpu-manager
    ServiceAccount the role created: every call it makes succeeds; deleting a node or reading a
    secret is refused by the apiserver."""
    cluster = site.cluster
    node = site.pools["qgpu_pool_inference"][0]
    namespace = exempt_namespace(cluster)
    cluster.api.create_namespaced_pod(namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                                                  "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]}})
    kubeconfig = service_account_kubeconfig(cluster, "qgpu-manager", tmp_path / "manager.kubeconfig", node=node)
    source = KubePodSource(str(kubeconfig))
    # the pods on its node: "p" and the pod its token is bound to
    assert sorted(p["metadata"]["name"] for p in source.pods_on_node(node)) == ["p", "qgpu-manager-token-holder"]
    assert source.node_labels(node)["kubernetes.io/hostname"] == node
    source.patch_pod_annotations(namespace, "p", {ASSIGNED: '["c"]'})  # the one pod annotation it writes
    with pytest.raises(PodSourceError, match=f"qgpu-manager-own-node.*annotations {GROUP_MIN_MEMBER} changed"):
        source.patch_pod_annotations(namespace, "p", {GROUP_MIN_MEMBER: "64"})  # the pod owner's, never a node's
    source.patch_node(node, {}, {"qgpu.io/test": "manager"})
    pod_uid = read_pod(cluster.api, namespace, "p")["metadata"]["uid"]
    source.record_event(namespace, "p", pod_uid, "QgpuTest", "the manager may report on pods")
    assert [e["reason"] for e in events_for(cluster.api, namespace, "p")] == ["QgpuTest"]
    assert site.node(node)["metadata"]["annotations"]["qgpu.io/test"] == "manager"
    annotations = read_pod(cluster.api, namespace, "p")["metadata"]["annotations"]
    assert annotations[ASSIGNED] == '["c"]' and GROUP_MIN_MEMBER not in annotations

    core = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    for forbidden in (lambda: core.delete_node(node), lambda: core.list_node(), lambda: core.list_secret_for_all_namespaces(),
                      lambda: core.read_namespaced_secret("qgpu-webhook-tls", NAMESPACE),
                      lambda: core.delete_namespaced_pod("p", namespace)):
        with pytest.raises(ApiException) as refused:
            forbidden()
        assert refused.value.status == 403
    assert site.node(node)["metadata"]["name"] == node
    cluster.api.delete_namespaced_pod("qgpu-manager-token-holder", NAMESPACE, grace_period_seconds=0)


# -- re-runs -------------------------------------------------------------------------------------


def test_a_second_run_changes_nothing(site: Site) -> None:
    second = site.run()
    assert second.returncode == 0, second.output[-6000:]
    assert second.recap_changed() == 0, second.output[-6000:]
    # the first run left the three roles' marks on qgpu's namespace: kube-system is not searched again
    assert "Find this role's objects an earlier release left in" not in second.output, second.output[-6000:]


def test_a_manager_rollout_that_does_not_complete_stops_and_says_why(site: Site, tmp_path: Path) -> None:
    """No controller runs the DaemonSets here, so a rollout that waits never completes: the role
    stops after the wait with the DaemonSets' state instead of a bare timeout. (The manifest is the
    one already applied: nothing in the cluster changes.)"""
    playbook = tmp_path / "roll.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Roll the node managers and wait", "hosts": "qgpu_kube_api", "gather_facts": False,
        "tasks": [{"name": "Deploy the node manager", "ansible.builtin.include_role": {"name": "qgpu_manager"},
                   "vars": {"qgpu_manager_mode": "kubernetes", "qgpu_manager_wait": True, "qgpu_manager_wait_timeout": 2}}]}]))
    run = ansible_playbook("-i", str(site.inventory), str(playbook))
    assert run.returncode != 0
    text = " ".join(run.output.split())
    assert "The node manager rollout did not complete" in text, run.output[-4000:]
    message = text[text.index("The node manager rollout did not complete"):][:3000]
    for policy in ("best-effort", "burst-share", "fixed-share"):  # this control plane runs no controller-manager
        assert (f"DaemonSet qgpu-manager-{policy}: no DaemonSet controller has processed this version yet "
                "(is kube-controller-manager running?)") in message, message
    assert "roll back by running site.yml from the previous checkout" in message, message


def test_a_label_change_in_group_vars_is_reported_and_applied(site: Site) -> None:
    """Runs after the idempotence test on purpose: it edits the inventory. Only the labelling play
    runs, changed and restored (the whole of KUBE_PLAYS ran twice above)."""
    group_vars = site.inventory / "group_vars" / "qgpu_pool_inference.yml"
    original = group_vars.read_text()
    group_vars.write_text(original.replace("qgpu_node_pool_isolation_policy: burst-share",
                                           "qgpu_node_pool_isolation_policy: fixed-share"))
    assert group_vars.read_text() != original, "the example inference pool no longer sets burst-share"
    try:
        changed = site.label_nodes()
        assert changed.returncode == 0, changed.output[-6000:]
        results = task_results(changed, "Apply the pool's labels and taints")
        expected = {h: "changed" for h in site.pools["qgpu_pool_inference"]}
        expected |= {h: "ok" for p in ("qgpu_pool_training", "qgpu_pool_mixed") for h in site.pools[p]}
        assert results == expected, changed.output[-6000:]
        for name in site.pools["qgpu_pool_inference"]:
            assert site.node(name)["metadata"]["labels"]["tke.cloud.tencent.com/qgpu-schedule-policy"] == "fixed-share"
    finally:
        group_vars.write_text(original)
    restored = site.label_nodes()
    assert restored.returncode == 0, restored.output[-6000:]
    assert set(task_results(restored, "Apply the pool's labels and taints").values()) == {"changed", "ok"}
    for name in site.pools["qgpu_pool_inference"]:
        assert site.node(name)["metadata"]["labels"]["tke.cloud.tencent.com/qgpu-schedule-policy"] == "burst-share"


# -- the v1 scheduler config in a real kube-scheduler ------------------------------------------


def extender_requests(cluster: Cluster) -> float:
    ctx = cluster.extender.ssl_context()  # /metrics, like the verbs, needs the scheduler's certificate
    with urllib.request.urlopen(cluster.extender.url + "/metrics", timeout=5, context=ctx) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "qgpu_extender_requests" for sample in family.samples
               if sample.name == "qgpu_extender_requests_total")


def advertise_as_the_manager_daemonset(cluster: Cluster, name: str, inventory: list) -> None:
    """Node capacity for the resources the role's manager DaemonSet serves (its default
    --resources), counted per card as the device plugin advertises them to kubelet."""
    status = cluster.api.read_node_status(name).status
    extended = {r: str(len(CATALOG[r].advertised(inventory))) for r in DEFAULT_RESOURCES}
    capacity = {**status.capacity, **extended}
    cluster.api.patch_node_status(name, {"status": {"capacity": capacity, "allocatable": capacity}})


@pytest.fixture
def role_rendered_v1(cluster: Cluster, tmp_path: Path) -> Path:
    """The role's `auto` choice for the fixture's kube-scheduler version, rendered by the role. Only
    host-specific values are set, as an inventory would: the extender URL and CA, the kubeconfig."""
    version = cluster.cp.bindir.parent.name.lstrip("v")
    run = ansible_playbook("-i", "localhost,", str(REPO / "tests/provisioning/playbooks/render-scheduler-configs.yml"),
                           "-e", json.dumps({
                               "sandbox": str(tmp_path), "versions": [version],
                               "kube_scheduler_extender_url_prefix": cluster.extender.url,
                               "kube_scheduler_extender_tls": {
                                   "insecure": False, "caFile": str(cluster.extender.ca_file),
                                   "certFile": str(cluster.extender.client_cert.cert),
                                   "keyFile": str(cluster.extender.client_cert.key)},
                               "kube_scheduler_extender_kubeconfig": str(cluster.cp.scheduler_kubeconfig),
                           }))
    assert run.returncode == 0, run.output[-4000:]
    path = tmp_path / version / "etc/kubernetes/qgpu/kube-scheduler-config.yaml"
    assert yaml.safe_load(path.read_text())["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    return path


# One pod per dialect (the node-wide T9k resource aside: it would need a node of its own), and the
# kind of node, labelled as qgpu_node_pool labels the example pools, each may land on.
DIALECT_PODS = {
    "qgpu": ({"tke.cloud.tencent.com/qgpu-core": 50, "tke.cloud.tencent.com/qgpu-memory": 8}, {"plain", "sgn"}),
    "vcuda": ({"tencent.com/vcuda-core": 50, "tencent.com/vcuda-memory": 8}, {"plain", "sgn"}),
    "nvidia": ({"nvidia.com/gpu": 1}, {"plain", "sgn"}),
    "t9k-whole": ({"tensorstack.dev/nvidia-gpu": 1}, {"xgn"}),
    "t9k-percent": ({"tensorstack.dev/nvidia-gpu-percent": 25}, {"sgn"}),
}


def test_the_role_manages_every_resource_qgpu_parses() -> None:
    """kube-scheduler calls the extender only for pods asking for a managed resource: a dialect
    left out of the list would be placed without qgpu's bookkeeping."""
    defaults = yaml.safe_load((REPO / "roles/kube_scheduler_extender/defaults/main.yml").read_text())
    assert sorted(defaults["kube_scheduler_extender_managed_resources"]) == sorted(GPU_RESOURCES)


def test_the_role_v1_config_runs_kube_scheduler_through_the_extender(cluster: Cluster, role_rendered_v1: Path) -> None:
    """kube-scheduler loads the role's file (a file it refuses makes it exit, and start fails with
    its log), becomes ready, and places a pod of every dialect through the extender's bind, on nodes
    that advertise exactly what the role's manager DaemonSet serves and are labelled and tainted as
    qgpu_node_pool does it (T9k pods only on nodes of their allocation mode)."""
    config = yaml.safe_load(role_rendered_v1.read_text())
    (extender,) = config["extenders"]
    assert extender["enableHTTPS"] is True and extender["tlsConfig"]["caFile"] == str(cluster.extender.ca_file)
    # the extender answers only the client certificate the role's tlsConfig names
    assert extender["tlsConfig"]["certFile"] == str(cluster.extender.client_cert.cert)
    assert config["leaderElection"] == {"leaderElect": True}

    label = {"qgpu-test": uuid.uuid4().hex[:10]}
    nodes = {kind: f"role-v1-{kind}-{label['qgpu-test']}" for kind in ("plain", "sgn", "xgn")}
    for kind, node in nodes.items():
        inventory = cards(2, "V100", 32768, node=node)
        alloc_mode = {} if kind == "plain" else {"sched.tensorstack.dev/node-alloc-mode": kind}
        gpu_node(cluster.api, node, inventory, labels={**label, **alloc_mode})
        advertise_as_the_manager_daemonset(cluster, node, inventory)
    cluster.api.patch_node(nodes["xgn"], {"spec": {"taints": [XGN_TAINT]}})
    namespace = exempt_namespace(cluster)

    cluster.cp.stop_scheduler()  # one scheduler of default-scheduler pods at a time
    try:
        cluster.cp.start_scheduler_from_file(role_rendered_v1, name="kube-scheduler-role-v1")
        before = extender_requests(cluster)
        for pod, (limits, _) in DIALECT_PODS.items():
            spec = gpu_pod(pod, limits, selector=label)
            # As qgpu's mutating webhook completes it (the whole-card pod's xgn toleration).
            cluster.api.create_namespaced_pod(namespace, patched(spec, mutation(spec, WebhookConfig())))
        placed = {pod: bound_or_reason(cluster, namespace, pod) for pod in DIALECT_PODS}
        assert {pod: placed[pod] in {nodes[k] for k in kinds} for pod, (_, kinds) in DIALECT_PODS.items()} == {
            pod: True for pod in DIALECT_PODS}, placed
        # Only the extender writes the allocation record, and it does so in its bind verb.
        assert all(ALLOCATION in read_pod(cluster.api, namespace, pod)["metadata"]["annotations"] for pod in DIALECT_PODS)
        assert extender_requests(cluster) >= before + 2 * len(DIALECT_PODS)  # filter and bind at least
    finally:
        cluster.cp.stop_scheduler("kube-scheduler-role-v1")
        cluster.cp.start_scheduler(cluster.scheduler_extenders())


def test_pods_of_the_peers_scheduler_names_are_bound_through_the_extender(cluster: Cluster, role_rendered_v1: Path) -> None:
    """T9k's examples set spec.schedulerName t9k-scheduler, KAI's kai-scheduler: with the role's
    config a real kube-scheduler serves both names and the qgpu extender places and binds their pods
    (the allocation record is written only in its bind verb), with no edit by their owner."""
    label = {"qgpu-test": uuid.uuid4().hex[:10]}
    node = f"role-peers-{label['qgpu-test']}"
    inventory = cards(2, "V100", 32768, node=node)
    gpu_node(cluster.api, node, inventory, labels={**label, "sched.tensorstack.dev/node-alloc-mode": "sgn"})
    advertise_as_the_manager_daemonset(cluster, node, inventory)
    namespace = exempt_namespace(cluster)
    pods = {"t9k-percent": ("t9k-scheduler", {"tensorstack.dev/nvidia-gpu-percent": 25}),
            "kai-whole": ("kai-scheduler", {"nvidia.com/gpu": 1})}
    cluster.cp.stop_scheduler()
    try:
        cluster.cp.start_scheduler_from_file(role_rendered_v1, name="kube-scheduler-role-peers")
        for pod, (scheduler, limits) in pods.items():
            cluster.api.create_namespaced_pod(namespace, gpu_pod(pod, limits, selector=label, scheduler_name=scheduler))
        placed = {pod: bound_or_reason(cluster, namespace, pod) for pod in pods}
        assert placed == {pod: node for pod in pods}
        for pod, (scheduler, _) in pods.items():
            got = read_pod(cluster.api, namespace, pod)
            assert got["spec"]["schedulerName"] == scheduler  # served as written, not rewritten
            assert ALLOCATION in got["metadata"]["annotations"]
    finally:
        cluster.cp.stop_scheduler("kube-scheduler-role-peers")
        cluster.cp.start_scheduler(cluster.scheduler_extenders())


def bound_or_reason(cluster: Cluster, namespace: str, pod: str) -> str:
    """The node the pod was bound to, or why kube-scheduler left it pending."""
    try:
        return str(bound(cluster.api, namespace, pod, timeout=30)["spec"]["nodeName"])
    except AssertionError:
        return "; ".join(e["message"] for e in events_for(cluster.api, namespace, pod)) or "pending, no event"


# -- the namespace, and the upgrade from kube-system ---------------------------------------------------


def test_the_roles_create_qgpus_namespace(site: Site) -> None:
    namespace = site.cluster.api.read_namespace(NAMESPACE)
    assert (namespace.metadata.labels or {}).get("app.kubernetes.io/part-of") == "qgpu"


def test_the_run_deleted_what_the_earlier_release_left_in_kube_system_and_nothing_else(site: Site) -> None:
    left = [f"{kind}/{name}" for api_version, kind, name in OLD_QGPU
            if live_object(site.cluster, {"apiVersion": api_version, "kind": kind,
                                          "metadata": {"name": name, "namespace": OLD_NAMESPACE}})]
    assert left == []
    namespace = site.cluster.api.read_namespace(NAMESPACE).metadata.annotations or {}
    assert {k: v for k, v in namespace.items() if k in RETIRED_FROM} == dict.fromkeys(RETIRED_FROM, OLD_NAMESPACE)
    foreign = live_object(site.cluster, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                         "metadata": {"name": NOT_QGPUS, "namespace": OLD_NAMESPACE}})
    assert foreign is not None and foreign["spec"]["holderIdentity"] == "someone-else"
    client.CoordinationV1Api(site.cluster.api_client).delete_namespaced_lease(NOT_QGPUS, OLD_NAMESPACE)
