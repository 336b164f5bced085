"""A DRA pool beside a device-plugin pool, through site.yml's Kubernetes plays against the real
control plane of tests/k8s (issue 13 §3, §6).

`playbooks/node-pools.yml` and `playbooks/cluster.yml` run with an inventory of two pools, one in
each qgpu_pool_mode, against fake Nodes; the dra pool's containerd CDI drop-in is written into the
inventory's sandbox root (containerd 2.x declared, no service restarted). Read back from the
apiserver: the mode label, the DeviceClasses equal to contract.dra.device_classes(), the DRA manager
DaemonSets and RBAC (SubjectAccessReview), and the admission policy refusing a ResourceSlice that a
manager's token writes for another node; the webhook in its DRA mode (--dra, /mutate-dra and the
claim-quota entry, exactly the RBAC it calls).
"""

from __future__ import annotations

import json
import shutil
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from ansible_tools import Run, ansible_playbook
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient
from test_k8s_half import (
    KUBE_PLAYS,
    NAMESPACE,
    advertise_as_the_manager_daemonset,
    bound_or_reason,
    can,
    delete_webhook_configurations,
    exempt_namespace,
    live_object,
    service_account_kubeconfig,
)

from qgpu_runtime.contract import dra, names
from qgpu_runtime.contract.record import ALLOCATION
from qgpu_runtime.webhook.admission import WebhookConfig, mutation
from tests.k8s.conftest import Cluster
from tests.k8s.controlplane import ADMIN_USER, extender_server
from tests.k8s.kubeobjects import cards, gpu_node, gpu_pod, patched, read_pod
from tests.k8s.test_e2e_dra_prioritize import place_one_by_one

pytestmark = pytest.mark.slow

POOLS = {
    "qgpu_pool_plugin": (["gpu-dp-1"], {"qgpu_node_pool_isolation_policy": "fixed-share"}),
    "qgpu_pool_dra": (["gpu-dra-1", "gpu-dra-2"], {
        "qgpu_node_pool_isolation_policy": "burst-share", "qgpu_pool_mode": "dra",
        # this machine runs Debian's containerd 1.6: declare the 2.x a DRA node needs, restart nothing
        "qgpu_node_pool_containerd_version": "2.4.2", "qgpu_node_pool_manage_services": False}),
}
POLICIES = ("best-effort", "fixed-share", "burst-share")


@dataclass
class DraSite:
    cluster: Cluster
    inventory: Path
    root: Path
    first: Run

    def node(self, name: str) -> dict[str, Any]:
        return json.loads(self.cluster.api.read_node(name, _preload_content=False).data)


def write_inventory(path: Path, cluster: Cluster, root: Path) -> None:
    (path / "group_vars").mkdir(parents=True)
    hosts = {"all": {"children": {
        "kube_control_plane": {"hosts": {}},
        "qgpu_standalone": {"hosts": {}},
        "qgpu_kube_api": {"hosts": {"localhost": None}},
        "qgpu_gpu_nodes": {"children": {pool: {"hosts": {h: None for h in names_}} for pool, (names_, _) in POOLS.items()}},
    }}}
    (path / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    (path / "group_vars" / "all.yml").write_text(yaml.safe_dump({
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "qgpu_kubeconfig": str(cluster.cp.admin_kubeconfig),
        "qgpu_namespace": NAMESPACE,
        "qgpu_image": "registry.example.com/qgpu/qgpu-runtime:0.1.0",
        "qgpu_root_prefix": str(root),
        "qgpu_manager_wait": False,
        "qgpu_scheduler_wait": False,
        "qgpu_webhook_wait": False,
        # The session's extender binds as the cluster admin, not as qgpu-scheduler's ServiceAccount:
        # let it write the allocation record past qgpu-pod-annotations.
        "qgpu_scheduler_extra_pod_annotation_writers": [ADMIN_USER],
    }, sort_keys=False))
    for pool, (_, group_vars) in POOLS.items():
        (path / "group_vars" / f"{pool}.yml").write_text(yaml.safe_dump(group_vars, sort_keys=False))


def manifest_docs(root: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((root / "etc/qgpu/manifests/qgpu-manager.yaml").read_text()) if d]


@pytest.fixture(scope="module")
def site(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DraSite]:
    work = tmp_path_factory.mktemp("k8s-dra")
    for names_, _ in POOLS.values():
        for name in names_:
            gpu_node(cluster.api, name, cards(2, "T4", 16384, node=name))
    write_inventory(work / "inventory", cluster, work / "root")
    first = ansible_playbook("-i", str(work / "inventory"), *KUBE_PLAYS)
    if first.returncode != 0:  # what a failed install applied must not reach the next module on this cluster
        ansible_playbook("-i", str(work / "inventory"), "playbooks/teardown.yml")
        delete_webhook_configurations(cluster)
        pytest.fail(first.output[-6000:])
    site = DraSite(cluster, work / "inventory", work / "root", first)
    yield site
    docs = manifest_docs(site.root)
    teardown = ansible_playbook("-i", str(site.inventory), "playbooks/teardown.yml")
    delete_webhook_configurations(cluster)
    for names_, _ in POOLS.values():
        for name in names_:
            cluster.api.delete_node(name)
    assert teardown.returncode == 0, teardown.output[-4000:]
    left = [f"{d['kind']}/{d['metadata']['name']}" for d in docs if live_object(cluster, d)]
    assert left == [], "teardown.yml left these behind"
    shutil.rmtree(work, ignore_errors=True)


def test_each_node_carries_its_pools_mode(site: DraSite) -> None:
    for names_, group_vars in POOLS.values():
        for name in names_:
            assert site.node(name)["metadata"]["labels"][names.POOL_MODE_LABEL] == group_vars.get("qgpu_pool_mode", "device-plugin")


def test_the_dra_nodes_get_cdi_in_containerd(site: DraSite) -> None:
    dropin = tomllib.loads((site.root / "etc/containerd/conf.d/90-qgpu-cdi.toml").read_text())
    assert dropin["plugins"]["io.containerd.cri.v1.runtime"] == {"enable_cdi": True, "cdi_spec_dirs": ["/etc/cdi", "/var/run/cdi"]}


def test_the_live_device_classes_are_the_contracts(site: DraSite) -> None:
    resource = DynamicClient(site.cluster.api_client).resources.get(api_version=dra.API_VERSION, kind="DeviceClass")
    for expected in dra.device_classes():
        live = resource.get(name=expected["metadata"]["name"]).to_dict()
        assert live["spec"] == expected["spec"], expected["metadata"]["name"]
        assert live["metadata"]["labels"]["app.kubernetes.io/part-of"] == "qgpu"


def test_every_rendered_manager_object_is_live(site: DraSite) -> None:
    docs = manifest_docs(site.root)
    assert {f"qgpu-manager-dra-{p}" for p in POLICIES} <= {d["metadata"]["name"] for d in docs if d["kind"] == "DaemonSet"}
    for doc in docs:
        assert live_object(site.cluster, doc) is not None, f"{doc['kind']}/{doc['metadata']['name']}"


def test_the_dra_manager_may_publish_slices_and_not_allocate_claims(site: DraSite) -> None:
    cluster = site.cluster
    for verb in ("create", "get", "list", "watch", "update", "delete"):
        assert can(cluster, "qgpu-manager-dra", verb, "resourceslices", group="resource.k8s.io"), verb
    assert can(cluster, "qgpu-manager-dra", "get", "resourceclaims", namespace="default", group="resource.k8s.io")
    for verb, resource, subresource, namespace in (
            ("update", "resourceclaims", "status", "default"), ("patch", "resourceclaims", "status", "default"),
            ("update", "resourceclaims", None, "default"), ("list", "resourceclaims", None, None),
            ("create", "deviceclasses", None, None), ("deletecollection", "resourceslices", None, None)):
        assert not can(cluster, "qgpu-manager-dra", verb, resource, namespace=namespace, subresource=subresource,
                       group="resource.k8s.io"), (verb, resource, subresource)
    assert not can(cluster, "qgpu-manager-dra", "get", "secrets", namespace=NAMESPACE)
    # the device-plugin manager gains nothing
    assert not can(cluster, "qgpu-manager", "create", "resourceslices", group="resource.k8s.io")


DRA_KINDS = ("resourceslices", "resourceclaims", "resourceclaimtemplates")


def test_the_extender_may_list_and_watch_the_dra_kinds_and_write_none(site: DraSite) -> None:
    """--dra-prioritize (on: a pool is dra) reads qgpu's cards, the claims and their templates; it
    never writes them (kube-scheduler allocates, the manager publishes)."""
    cluster = site.cluster
    for resource in DRA_KINDS:
        for verb in ("list", "watch"):
            assert can(cluster, "qgpu-scheduler", verb, resource, group="resource.k8s.io"), (verb, resource)
        if resource != "resourceslices":
            assert can(cluster, "qgpu-scheduler", "list", resource, namespace="default", group="resource.k8s.io")
        for verb in ("create", "update", "patch", "delete", "deletecollection", "get"):
            namespace = None if resource == "resourceslices" else "default"
            assert not can(cluster, "qgpu-scheduler", verb, resource, namespace=namespace, group="resource.k8s.io"), (
                verb, resource)
    assert not can(cluster, "qgpu-scheduler", "update", "resourceclaims", namespace="default", subresource="status",
                   group="resource.k8s.io")
    assert not can(cluster, "qgpu-scheduler", "list", "deviceclasses", group="resource.k8s.io")


def test_the_role_config_places_claim_pods_through_dra_prioritize(site: DraSite, tmp_path: Path) -> None:
    """The KubeSchedulerConfiguration kube_scheduler_extender renders for this inventory (a dra pool:
    two entries to one extender) loaded by the real kube-scheduler, the extender run with
    --dra-prioritize as the qgpu-scheduler ServiceAccount the role created (its watches of the DRA
    kinds must be allowed, or it never gets ready). Claim pods are packed onto one node through
    dra-prioritize (binpack, as in tests/k8s/test_e2e_dra_prioritize.py),
    and a dialect pod still goes through today's entry: filter and bind, allocation record."""
    cluster = site.cluster
    kubeconfig = service_account_kubeconfig(cluster, "qgpu-scheduler", tmp_path / "extender.kubeconfig")
    extender = extender_server(cluster.cp, kubeconfig=kubeconfig, name="qgpu-extender-role-dra",
                               extra_args=["--dra-prioritize", "--commitment-namespace", NAMESPACE])
    version = cluster.cp.bindir.parent.name.lstrip("v")
    assert extender.client_cert is not None and extender.ca_file is not None
    render = ansible_playbook("-i", str(site.inventory), "tests/provisioning/playbooks/render-scheduler-configs.yml",
                              "-e", json.dumps({
                                  "sandbox": str(tmp_path / "masters"), "versions": [version],
                                  "kube_scheduler_extender_url_prefix": extender.url,
                                  "kube_scheduler_extender_tls": {
                                      "insecure": False, "caFile": str(extender.ca_file),
                                      "certFile": str(extender.client_cert.cert), "keyFile": str(extender.client_cert.key)},
                                  "kube_scheduler_extender_kubeconfig": str(cluster.cp.scheduler_kubeconfig)}))
    assert render.returncode == 0, render.output[-4000:]
    path = tmp_path / "masters" / version / "etc/kubernetes/qgpu/kube-scheduler-config.yaml"
    main, dra_entry = yaml.safe_load(path.read_text())["extenders"]
    assert main["bindVerb"] == "bind" and dra_entry["prioritizeVerb"] == "dra-prioritize"

    label = {"qgpu-test": uuid.uuid4().hex[:10]}
    dialect_node = f"role-dra-dp-{label['qgpu-test']}"
    inventory = cards(2, "V100", 32768, node=dialect_node)
    gpu_node(cluster.api, dialect_node, inventory, labels=label)
    advertise_as_the_manager_daemonset(cluster, dialect_node, inventory)
    namespace = exempt_namespace(cluster)
    extender.start()
    cluster.cp.stop_scheduler()  # one scheduler of default-scheduler pods at a time
    try:
        cluster.cp.start_scheduler_from_file(path, name="kube-scheduler-role-dra")
        nodes = place_one_by_one(cluster, namespace, None)
        assert len(set(nodes)) == 1, nodes
        spec = gpu_pod("dialect", {"tke.cloud.tencent.com/qgpu-core": 50, "tke.cloud.tencent.com/qgpu-memory": 8},
                       selector=label)
        cluster.api.create_namespaced_pod(namespace, patched(spec, mutation(spec, WebhookConfig())))
        assert bound_or_reason(cluster, namespace, "dialect") == dialect_node
        assert ALLOCATION in read_pod(cluster.api, namespace, "dialect")["metadata"]["annotations"]
        counts = extender.requests_by_verb()
        assert counts.get("dra-prioritize", 0) >= len(nodes) and counts.get("bind", 0) >= 1, counts
    finally:
        cluster.cp.stop_scheduler("kube-scheduler-role-dra")
        cluster.cp.start_scheduler(cluster.scheduler_extenders())
        extender.stop()


def slice_for(node: str) -> dict[str, Any]:
    return {"apiVersion": dra.API_VERSION, "kind": "ResourceSlice", "metadata": {"name": dra.slice_name(node)},
            "spec": {"driver": dra.DRIVER, "nodeName": node,
                     "pool": {"name": dra.pool_name(node), "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": dra.device_name(0)}]}}


def message(refusal: ApiException) -> str:
    return str(json.loads(refusal.body)["message"])


def test_the_admission_policy_refuses_a_slice_for_another_node(site: DraSite, tmp_path: Path) -> None:
    cluster = site.cluster
    kubeconfig = service_account_kubeconfig(cluster, "qgpu-manager-dra", tmp_path / "dra.kubeconfig", node="gpu-dra-1")
    slices = DynamicClient(config.new_client_from_config(config_file=str(kubeconfig))).resources.get(
        api_version=dra.API_VERSION, kind="ResourceSlice")
    try:
        own = slices.create(body=slice_for("gpu-dra-1"))
        assert own.spec.nodeName == "gpu-dra-1"
        with pytest.raises(ApiException) as refused:
            slices.create(body=slice_for("gpu-dra-2"))
        assert refused.value.status in (403, 422), refused.value.body
        assert ('qgpu-manager of node gpu-dra-1: ResourceSlice gpu-dra-2-gpu.qgpu.io is for node(s) "gpu-dra-2"; '
                "rule: the node manager writes only ResourceSlices of its own node") in message(refused.value)
        foreign = slice_for("gpu-dra-1") | {"metadata": {"name": "foreign-driver"}}
        foreign["spec"] = foreign["spec"] | {"driver": "gpu.example.com", "pool": {"name": "x", "generation": 1, "resourceSliceCount": 1}}
        with pytest.raises(ApiException) as other_driver:
            slices.create(body=foreign)
        assert 'names driver "gpu.example.com"' in message(other_driver.value)
        slices.delete(name=dra.slice_name("gpu-dra-1"))
    finally:
        cluster.api.delete_namespaced_pod("qgpu-manager-dra-token-holder", NAMESPACE, grace_period_seconds=0)
        admin = DynamicClient(cluster.api_client).resources.get(api_version=dra.API_VERSION, kind="ResourceSlice")
        for name in (dra.slice_name("gpu-dra-1"), dra.slice_name("gpu-dra-2"), "foreign-driver"):
            try:
                admin.delete(name=name)
            except ApiException:
                pass


def webhook_docs(root: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((root / "etc/qgpu/manifests/qgpu-webhook.yaml").read_text()) if d]


def test_a_dra_pool_runs_the_webhook_with_dra_and_its_entries(site: DraSite) -> None:
    docs = webhook_docs(site.root)
    for doc in docs:
        assert live_object(site.cluster, doc) is not None, f"{doc['kind']}/{doc['metadata']['name']}"
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--dra" in args and f"--quota-ledger-namespace={NAMESPACE}" in args
    admission = client.AdmissionregistrationV1Api(site.cluster.api_client)
    mutating = {h.name: h for h in admission.read_mutating_webhook_configuration("qgpu-webhook").webhooks}
    validating = {h.name: h for h in admission.read_validating_webhook_configuration("qgpu-webhook").webhooks}
    assert set(mutating) == {"mutate.qgpu.io", "mutate-dra.qgpu.io"}
    assert mutating["mutate-dra.qgpu.io"].side_effects == "NoneOnDryRun"
    assert set(validating) == {"validate.qgpu.io", "claim-quota.qgpu.io"}
    assert validating["claim-quota.qgpu.io"].failure_policy == "Fail"
    assert admission.read_validating_admission_policy("qgpu-webhook-own-names").spec.validations


def test_the_dra_webhook_has_exactly_the_rbac_it_calls(site: DraSite) -> None:
    cluster = site.cluster
    allowed = [("get", "resourceclaimtemplates", "team-a", "resource.k8s.io"),
               ("create", "resourceclaimtemplates", "team-a", "resource.k8s.io"),
               ("list", "resourceclaims", "team-a", "resource.k8s.io"), ("list", "resourcequotas", "team-a", ""),
               ("list", "pods", "team-a", ""), ("get", "namespaces", None, ""),
               ("list", "resourceslices", None, "resource.k8s.io"),
               ("get", "leases", NAMESPACE, "coordination.k8s.io"), ("create", "leases", NAMESPACE, "coordination.k8s.io"),
               ("update", "leases", NAMESPACE, "coordination.k8s.io")]
    forbidden = [("update", "resourceclaimtemplates", "team-a", "resource.k8s.io"),
                 ("delete", "resourceclaimtemplates", "team-a", "resource.k8s.io"),
                 ("create", "resourceclaims", "team-a", "resource.k8s.io"), ("get", "resourceclaims", "team-a", "resource.k8s.io"),
                 ("watch", "resourceclaims", "team-a", "resource.k8s.io"), ("get", "resourcequotas", "team-a", ""),
                 ("create", "leases", "team-a", "coordination.k8s.io"), ("delete", "leases", NAMESPACE, "coordination.k8s.io"),
                 ("get", "secrets", NAMESPACE, ""), ("get", "pods", "team-a", ""), ("watch", "pods", "team-a", ""),
                 ("list", "namespaces", None, ""), ("create", "resourceslices", None, "resource.k8s.io")]
    assert [a for a in allowed if not can(cluster, "qgpu-webhook", a[0], a[1], namespace=a[2], group=a[3])] == []
    assert [f for f in forbidden if can(cluster, "qgpu-webhook", f[0], f[1], namespace=f[2], group=f[3])] == []


def test_a_second_run_changes_nothing(site: DraSite) -> None:
    again = ansible_playbook("-i", str(site.inventory), *KUBE_PLAYS)
    assert again.returncode == 0, again.output[-6000:]
    assert again.recap_changed() == 0, again.output[-8000:]
