"""What the node manager's and the extender's ServiceAccounts can write, with real bound tokens.

The RBAC rules, ServiceAccounts and ValidatingAdmissionPolicies come from the deployment templates
(templates/kubernetes/), rendered with the roles' defaults. Tokens are real: TokenRequests bound to
a pod on a node, as the kubelet mounts them, so they carry the node name
(``authentication.kubernetes.io/node-name``) the manager's policy keys on. Issue 11 §4 found the
manager able to change a kube-system pod's image and lift a control-plane taint, and the extender
able to patch every pod: each of those is refused here, while the writes their code really makes
pass.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from qgpu_runtime.contract.names import ALLOCATION_SIGNATURE, GROUP_LABEL, GROUP_MIN_MEMBER
from qgpu_runtime.contract.names import INVENTORY as ANNOTATION_CARDS
from qgpu_runtime.contract.names import LABEL_GPU_COUNT as LABEL_COUNT
from qgpu_runtime.contract.names import LABEL_GPU_MEMORY as LABEL_MEMORY
from qgpu_runtime.contract.names import LABEL_GPU_MODEL as LABEL_MODEL
from qgpu_runtime.contract.names import NODE_ISOLATION_POLICY as ANNOTATION_POLICY
from qgpu_runtime.contract.record import ALLOCATION, ASSIGNED, BIND_TIME
from qgpu_runtime.model.requests import KAI_ANNOTATIONS, KAI_SCHEDULER
from qgpu_runtime.webhook.podquota import CHARGE_ANNOTATIONS
from tests.k8s.conftest import Cluster
from tests.k8s.controlplane import kubeconfig
from tests.k8s.kubeobjects import bound, cards, events_for, gpu_node, gpu_pod, read_pod, record, wait_for
from tests.k8s.nodemanager import ManagedNode, bare_node, bind_with_record, read_node
from tests.k8s.rbac import edit_user, render_template, wait_pod_policies_lifted, wait_policies_enforced
from tests.polling import poll

PAUSE = "registry.k8s.io/pause:3.10"
CONTROL_PLANE_TAINT = {"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}
MERGE = "application/merge-patch+json"


class Identities:
    """The rendered objects applied to the cluster, the nodes and pods of the scenario, and a client
    per identity, authenticated with a token bound to that identity's pod."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.api = cluster.api
        self.ns = cluster.namespace()  # the ServiceAccounts' namespace (kube-system in production)
        tag = self.ns
        self.node_a, self.node_b, self.control_plane = f"{tag}-a", f"{tag}-b", f"{tag}-cp"
        self.applied: list[dict[str, Any]] = []
        self.created_pods: list[tuple[str, str]] = []
        self.cluster_role_bindings: list[str] = []

    # -- set-up ------------------------------------------------------------------------------------
    def apply_templates(self) -> None:
        dynamic = DynamicClient(self.cluster.api_client)
        docs = (render_template("qgpu-manager.yaml.j2", qgpu_manager_namespace=self.ns, qgpu_manager_profiles=[])
                + render_template("qgpu-scheduler.yaml.j2", qgpu_scheduler_namespace=self.ns,
                                  qgpu_scheduler_manager_namespace=self.ns))  # kube-system in production
        for doc in docs:
            if doc["kind"] in ("DaemonSet", "Deployment"):
                continue  # the workloads themselves: these tests act with their identities directly
            resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            resource.create(body=doc, namespace=doc["metadata"].get("namespace"))
            self.applied.append(doc)

    def node(self, name: str, taints: list[dict[str, str]] | None = None) -> None:
        self.api.create_node({"apiVersion": "v1", "kind": "Node",
                              "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                              "spec": {"taints": taints or []}})

    def pod(self, namespace: str, name: str, node: str | None, service_account: str = "default",
            labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
        # Nobody schedules these (the session's kube-scheduler would bind the unbound ones elsewhere).
        spec: dict[str, Any] = {"serviceAccountName": service_account, "automountServiceAccountToken": False,
                                "schedulerName": "qgpu-test-nobody",
                                "tolerations": [{"operator": "Exists"}],
                                "containers": [{"name": "c", "image": PAUSE}]}
        if node:
            spec["nodeName"] = node
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels or {}, "annotations": annotations or {}}
        doc = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
        created = json.loads(self.api.create_namespaced_pod(namespace, doc, _preload_content=False).data)
        self.created_pods.append((namespace, name))
        return created

    def bound_token(self, service_account: str, pod: dict[str, Any] | None) -> str:
        """A TokenRequest for ``service_account``, bound to ``pod`` as the kubelet asks for it (None: unbound)."""
        spec: dict[str, Any] = {"expirationSeconds": 600}
        if pod is not None:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                      "uid": pod["metadata"]["uid"]}
        out = self.api.create_namespaced_service_account_token(service_account, self.ns, {"spec": spec})
        return str(out.status.token)

    def kubelet_client(self, node: str, path: Path) -> client.CoreV1Api:
        """The node's kubelet: a client certificate for ``system:node:<node>`` in group ``system:nodes``,
        holding the built-in ``system:node`` ClusterRole (this control plane authorizes by RBAC alone;
        in a cluster the Node authorizer grants the same writes, pods/status among them, for pods
        bound to the node)."""
        from kubernetes import config

        user = f"system:node:{node}"
        binding = f"qgpu-test-kubelet-{node}"
        rbac = client.RbacAuthorizationV1Api(self.cluster.api_client)
        rbac.create_cluster_role_binding({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": binding},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})
        self.cluster_role_bindings.append(binding)
        cp = self.cluster.cp
        pair = cp.ca.issue(f"kubelet-{node}", user, organization="system:nodes", client=True)
        path.write_text(yaml.safe_dump(kubeconfig(cp.server, cp.ca.cert_path, pair, user)))
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {
            "user": user, "groups": ["system:nodes"],
            "resourceAttributes": {"verb": "patch", "resource": "pods", "subresource": "status"}}}
        authz = client.AuthorizationV1Api(self.cluster.api_client)
        poll(lambda: authz.create_subject_access_review(review).status.allowed, timeout=30,
             what=f"the RBAC authorizer to see {binding}")
        return client.CoreV1Api(config.new_client_from_config(config_file=str(path)))

    def client_for(self, token: str) -> client.CoreV1Api:
        cp = self.cluster.cp
        conf = client.Configuration()
        conf.host = cp.server
        conf.ssl_ca_cert = str(cp.ca.cert_path)
        conf.api_key = {"authorization": f"Bearer {token}"}
        return client.CoreV1Api(client.ApiClient(conf))

    # -- tear-down ---------------------------------------------------------------------------------
    def close(self) -> None:
        for namespace, name in self.created_pods:
            _quietly(lambda: self.api.delete_namespaced_pod(name, namespace, grace_period_seconds=0))
        for node in (self.node_a, self.node_b, self.control_plane):
            _quietly(lambda: self.api.delete_node(node))
        rbac = client.RbacAuthorizationV1Api(self.cluster.api_client)
        for binding in self.cluster_role_bindings:
            _quietly(lambda: rbac.delete_cluster_role_binding(binding))
        dynamic = DynamicClient(self.cluster.api_client)
        for doc in reversed(self.applied):
            resource = dynamic.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            _quietly(lambda: resource.delete(name=doc["metadata"]["name"], namespace=doc["metadata"].get("namespace")))
        wait_pod_policies_lifted(self.api, self.ns)


def _quietly(call: Callable[[], Any]) -> None:
    try:
        call()
    except ApiException:
        pass


def refusal(call: Callable[[], Any]) -> str:
    """The apiserver's message for a refused write; fails the test when the write goes through."""
    try:
        call()
    except ApiException as exc:
        assert exc.status in (403, 422), f"{exc.status}: {exc.body}"
        return str(json.loads(exc.body or "{}").get("message", exc.body))
    raise AssertionError("the write was allowed")


def metadata_patch(labels: dict[str, Any] | None = None, annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    return {"metadata": meta}


@pytest.fixture(scope="module")
def world(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Identities]:
    w = Identities(cluster)
    try:
        w.apply_templates()
        w.node(w.node_a, taints=[{"key": "qgpu.io/test", "value": "x", "effect": "NoSchedule"}])
        w.node(w.node_b)
        w.node(w.control_plane, taints=[CONTROL_PLANE_TAINT])
        suffix = uuid.uuid4().hex[:6]
        w.manager_pod = w.pod(w.ns, f"qgpu-manager-{suffix}", w.node_a, service_account="qgpu-manager")
        w.extender_pod = w.pod(w.ns, f"qgpu-scheduler-{suffix}", w.control_plane, service_account="qgpu-scheduler")
        w.manager = w.client_for(w.bound_token("qgpu-manager", w.manager_pod))
        w.extender = w.client_for(w.bound_token("qgpu-scheduler", w.extender_pod))
        w.kubelet = w.kubelet_client(w.node_a, tmp_path_factory.mktemp("kubelet") / "kubeconfig")
        # Victims: kube-system pods on the manager's node, on another node, and not yet bound.
        w.system_pod_here = w.pod("kube-system", f"sys-a-{suffix}", w.node_a)
        w.system_pod_there = w.pod("kube-system", f"sys-b-{suffix}", w.node_b)
        w.gpu_pod_here = w.pod(w.ns, f"gpu-a-{suffix}", w.node_a)
        w.unbound_pod = w.pod(w.ns, f"pending-{suffix}", None)
        wait_until_enforced(w)
        yield w
    finally:
        w.close()


def wait_until_enforced(w: Identities, timeout: float = 30.0) -> None:
    """Poll a dry-run escalation per admission policy (nothing is changed) until each is refused."""
    wait_policies_enforced({
        "qgpu-manager-own-node": lambda: w.manager.patch_node(
            w.node_b, metadata_patch(annotations={ANNOTATION_POLICY: "x"}), dry_run="All", _content_type=MERGE),
        "qgpu-scheduler-allocation-only": lambda: w.extender.patch_namespaced_pod(
            w.gpu_pod_here["metadata"]["name"], w.ns, metadata_patch(labels={"probe": "x"}), dry_run="All",
            _content_type=MERGE),
        "qgpu-pod-annotations": lambda: w.api.patch_namespaced_pod(
            w.gpu_pod_here["metadata"]["name"], w.ns, metadata_patch(annotations={BIND_TIME: "1"}), dry_run="All",
            _content_type=MERGE),
        "qgpu-pod-request-annotations": lambda: w.api.patch_namespaced_pod(
            w.gpu_pod_here["metadata"]["name"], w.ns, metadata_patch(annotations={"tke.cloud.tencent.com/app-class": "offline"}), dry_run="All",
            _content_type=MERGE),
        "qgpu-pod-placed-by-extender": lambda: w.api.create_namespaced_pod(
            w.ns, bound_gpu_pod("probe-bound", w.node_a), dry_run="All"),
        "qgpu-kubelet-pod-annotations": lambda: w.kubelet.patch_namespaced_pod_status(
            w.gpu_pod_here["metadata"]["name"], w.ns, metadata_patch(annotations={GROUP_MIN_MEMBER: "64"}), dry_run="All",
            _content_type=MERGE),
    }, timeout)


def bound_gpu_pod(name_: str, node: str, resources: dict[str, str] | None = None, *, init: bool = False) -> dict[str, Any]:
    """A pod created already bound to ``node`` (spec.nodeName) asking for a GPU resource."""
    container = {"name": "c", "image": PAUSE, "resources": {"limits": resources or {"tke.cloud.tencent.com/qgpu-core": "30"}}}
    spec: dict[str, Any] = {"nodeName": node, "automountServiceAccountToken": False, "tolerations": [{"operator": "Exists"}],
                            "containers": [{"name": "main", "image": PAUSE}, container] if not init else [{"name": "main", "image": PAUSE}]}
    if init:
        spec["initContainers"] = [container]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name_}, "spec": spec}


def name(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["name"])


# ---- the node manager -----------------------------------------------------------------------------

def test_manager_cannot_change_the_image_of_a_kube_system_pod_on_another_node(world):
    patch = {"spec": {"containers": [{"name": "c", "image": "evil.example/miner:1"}]}}
    message = refusal(lambda: world.manager.patch_namespaced_pod(name(world.system_pod_there), "kube-system", patch))
    assert f"bound to node \"{world.node_b}\"" in message and "only pods bound to its node" in message, message


def test_manager_cannot_change_the_image_of_a_pod_on_its_own_node(world):
    patch = {"spec": {"containers": [{"name": "c", "image": "evil.example/miner:1"}]}}
    message = refusal(lambda: world.manager.patch_namespaced_pod(name(world.system_pod_here), "kube-system", patch))
    assert "spec changed" in message, message


def test_manager_cannot_remove_a_control_plane_nodes_noschedule_taint(world):
    message = refusal(lambda: world.manager.patch_node(world.control_plane, {"spec": {"taints": []}}))
    assert f"Node {world.control_plane} is not its own" in message, message
    node = world.api.read_node(world.control_plane)
    assert [(t.key, t.effect) for t in node.spec.taints] == [(CONTROL_PLANE_TAINT["key"], "NoSchedule")]


def test_manager_cannot_remove_a_taint_of_its_own_node(world):
    message = refusal(lambda: world.manager.patch_node(world.node_a, {"spec": {"taints": []}}))
    assert "spec changed" in message, message


def test_manager_cannot_write_another_nodes_annotations(world):
    message = refusal(lambda: world.manager.patch_node(
        world.node_b, metadata_patch(annotations={ANNOTATION_CARDS: "[]"}), _content_type=MERGE))
    assert f"Node {world.node_b} is not its own" in message, message


def test_manager_cannot_write_foreign_labels_or_annotations_on_its_own_node(world):
    message = refusal(lambda: world.manager.patch_node(
        world.node_a, metadata_patch(labels={"node-role.kubernetes.io/control-plane": ""}), _content_type=MERGE))
    assert "labels node-role.kubernetes.io/control-plane changed" in message, message
    message = refusal(lambda: world.manager.patch_node(
        world.node_a, metadata_patch(annotations={"node.alpha.kubernetes.io/ttl": "0"}), _content_type=MERGE))
    assert "annotations node.alpha.kubernetes.io/ttl changed" in message, message


def test_manager_writes_its_own_nodes_qgpu_labels_and_annotations(world):
    labels = {LABEL_COUNT: "2", LABEL_MODEL: "T4", LABEL_MEMORY: "15360"}
    annotations = {ANNOTATION_CARDS: "[]", ANNOTATION_POLICY: "fixed-share"}
    world.manager.patch_node(world.node_a, metadata_patch(labels=labels, annotations=annotations), _content_type=MERGE)
    meta = world.api.read_node(world.node_a).metadata
    assert {k: meta.labels[k] for k in labels} == labels
    assert {k: meta.annotations[k] for k in annotations} == annotations


def test_manager_writes_hamis_share_sizes_into_its_own_nodes_capacity_and_nothing_else_of_its_status(world):
    """node/nodeinfo.py share_size_capacity, as the manager's PodSource writes it (a merge patch of
    status capacity and allocatable); another node's status, another capacity (nvidia.com/gpu, cpu)
    and another status field are refused by the policy."""
    sizes = {"nvidia.com/gpumem": "30720", "nvidia.com/gpumem-percentage": "200", "nvidia.com/gpucores": "200"}
    status = {"status": {"capacity": sizes, "allocatable": sizes}}
    world.manager.patch_node_status(world.node_a, status, _content_type=MERGE)
    capacity = world.api.read_node_status(world.node_a).status.capacity
    assert {k: capacity[k] for k in sizes} == sizes
    message = refusal(lambda: world.manager.patch_node_status(world.node_b, status, _content_type=MERGE))
    assert f"Node {world.node_b} is not its own" in message, message
    for forged in ({"nvidia.com/gpu": "64"}, {"cpu": "512"}):
        message = refusal(lambda: world.manager.patch_node_status(
            world.node_a, {"status": {"capacity": forged, "allocatable": forged}}, _content_type=MERGE))
        assert f"status capacity/allocatable {next(iter(forged))}" in message, message
    message = refusal(lambda: world.manager.patch_node_status(
        world.node_a, {"status": {"addresses": [{"type": "InternalIP", "address": "10.9.9.9"}]}}, _content_type=MERGE))
    assert "status changed beyond its capacity" in message, message


STRATEGIC = "application/strategic-merge-patch+json"


def test_manager_sets_its_own_nodes_shares_enforced_condition_and_no_other(world):
    """The QGPUSharesEnforced condition, as node/kube_client.py writes it (a strategic merge of one
    condition); the kubelet's conditions stay its own, another node's status is refused."""
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status"}
    world.api.patch_node_status(world.node_a, {"status": {"conditions": [ready]}}, _content_type=STRATEGIC)  # as the kubelet
    ours = {"type": "QGPUSharesEnforced", "status": "False", "reason": "PolicyBestEffort", "message": "policy best-effort"}
    world.manager.patch_node_status(world.node_a, {"status": {"conditions": [ours]}}, _content_type=STRATEGIC)
    world.manager.patch_node_status(world.node_a, {"status": {"conditions": [{**ours, "status": "True", "reason": "Enforced"}]}},
                                    _content_type=STRATEGIC)
    got = {c.type: (c.status, c.reason) for c in world.api.read_node_status(world.node_a).status.conditions}
    assert got == {"Ready": ("True", "KubeletReady"), "QGPUSharesEnforced": ("True", "Enforced")}
    for forged in ({**ready, "status": "False"}, {"type": "MemoryPressure", "status": "False"}):
        message = refusal(lambda: world.manager.patch_node_status(
            world.node_a, {"status": {"conditions": [forged]}}, _content_type=STRATEGIC))
        assert "status changed beyond its capacity" in message and "QGPUSharesEnforced" in message, message
    message = refusal(lambda: world.manager.patch_node_status(world.node_b, {"status": {"conditions": [ours]}},
                                                              _content_type=STRATEGIC))
    assert f"Node {world.node_b} is not its own" in message, message


def test_manager_writes_the_assigned_annotation_of_a_pod_bound_to_its_node(world):
    world.manager.patch_namespaced_pod(name(world.gpu_pod_here), world.ns,
                                       metadata_patch(annotations={ASSIGNED: '["c"]'}), _content_type=MERGE)
    pod = world.api.read_namespaced_pod(name(world.gpu_pod_here), world.ns)
    assert pod.metadata.annotations[ASSIGNED] == '["c"]'


def test_manager_cannot_annotate_a_pod_on_another_node(world):
    message = refusal(lambda: world.manager.patch_namespaced_pod(
        name(world.system_pod_there), "kube-system", metadata_patch(annotations={ASSIGNED: "[]"}), _content_type=MERGE))
    assert "only pods bound to its node" in message, message


def test_manager_token_without_a_node_writes_nothing(world):
    """A token of the manager's ServiceAccount that is not bound to a pod on a node (e.g. a legacy
    Secret token copied off a node) cannot even write its "own" node."""
    unbound = world.client_for(world.bound_token("qgpu-manager", None))
    message = refusal(lambda: unbound.patch_node(
        world.node_a, metadata_patch(annotations={ANNOTATION_POLICY: "x"}), _content_type=MERGE))
    assert "names no node" in message, message


# ---- a compromised node and another namespace's T9k group ------------------------------------------

@pytest.fixture(scope="module")
def victim(world: Identities) -> str:
    """Another namespace, whose T9k group has members bound to the manager's node (node A)."""
    return world.cluster.namespace()


def group_member(world: Identities, namespace: str, size: str | None) -> dict[str, Any]:
    annotations = {GROUP_MIN_MEMBER: size} if size else {}
    return world.pod(namespace, f"member-{uuid.uuid4().hex[:6]}", world.node_a, labels={GROUP_LABEL: "train"},
                     annotations=annotations)


def test_manager_cannot_add_change_or_remove_a_pods_group_min_member_on_its_own_node(world, victim):
    """qgpu.io/group-min-member raised to 64 on one bound member of a victim's T9k group held the
    group's members on every other node until --group-timeout (docs/security.md); the manager's token
    wrote it because it may write qgpu.io/ annotations on the pods of its node. It writes only
    qgpu.io/assigned there now; the size stays what the pod's owner set at create."""
    sized, unsized = group_member(world, victim, "2"), group_member(world, victim, None)
    for pod, value in ((sized, "64"), (sized, None), (unsized, "64")):
        message = refusal(lambda pod=pod, value=value: world.manager.patch_namespaced_pod(
            name(pod), victim, metadata_patch(annotations={GROUP_MIN_MEMBER: value}), _content_type=MERGE))
        assert "ValidatingAdmissionPolicy 'qgpu-manager-own-node'" in message, message
        assert f"qgpu-manager of node {world.node_a}: Pod {victim}/{name(pod)}: annotations {GROUP_MIN_MEMBER} changed" in message, message
        assert "rule: on a pod the node manager changes only qgpu.io/assigned (the containers it served)" in message, message
    # nor does it move the pod into another group (the group's label is not under qgpu.io/)
    message = refusal(lambda: world.manager.patch_namespaced_pod(
        name(sized), victim, metadata_patch(labels={GROUP_LABEL: "other"}), _content_type=MERGE))
    assert f"labels {GROUP_LABEL} changed; rule: the node manager changes only labels under qgpu.io/" in message, message
    # what the manager writes there still passes, beside the owner's size
    world.manager.patch_namespaced_pod(name(sized), victim, metadata_patch(annotations={ASSIGNED: '["c"]'}),
                                       _content_type=MERGE)
    annotations = world.api.read_namespaced_pod(name(sized), victim).metadata.annotations
    assert (annotations[GROUP_MIN_MEMBER], annotations[ASSIGNED]) == ("2", '["c"]')
    assert GROUP_MIN_MEMBER not in (world.api.read_namespaced_pod(name(unsized), victim).metadata.annotations or {})


@pytest.mark.parametrize("annotation", [ALLOCATION, ALLOCATION_SIGNATURE, BIND_TIME])
def test_manager_cannot_write_the_extenders_record_on_a_pod_of_its_own_node(world, annotation):
    message = refusal(lambda: world.manager.patch_namespaced_pod(
        name(world.gpu_pod_here), world.ns, metadata_patch(annotations={annotation: "1"}), _content_type=MERGE))
    assert "ValidatingAdmissionPolicy 'qgpu-manager-own-node'" in message, message
    assert f"annotations {annotation} changed; rule: on a pod the node manager changes only qgpu.io/assigned" in message, message


def test_a_nodes_kubelet_cannot_change_a_pods_qgpu_annotations_through_its_status(world, victim):
    """The kubelet's credentials update the status of the pods bound to its node, and a pods/status
    write carries the pod's metadata: NodeRestriction refuses a label changed there, not an
    annotation. So a compromised node could still raise a victim's group size with them."""
    pod = group_member(world, victim, "2")
    # the hole: an annotation outside qgpu.io/ changes through pods/status
    world.kubelet.patch_namespaced_pod_status(name(pod), victim, metadata_patch(annotations={"example.com/x": "y"}),
                                              _content_type=MERGE)
    assert world.api.read_namespaced_pod(name(pod), victim).metadata.annotations["example.com/x"] == "y"
    for annotation, value in ((GROUP_MIN_MEMBER, "64"), (GROUP_MIN_MEMBER, None), (ALLOCATION, "{}")):
        message = refusal(lambda annotation=annotation, value=value: world.kubelet.patch_namespaced_pod_status(
            name(pod), victim, metadata_patch(annotations={annotation: value}), _content_type=MERGE))
        assert "ValidatingAdmissionPolicy 'qgpu-kubelet-pod-annotations'" in message, message
        assert (f"Pod {victim}/{name(pod)}: annotations {annotation} changed by system:node:{world.node_a} "
                "through pods/status; rule: a node's kubelet changes no qgpu.io/ annotation of a pod") in message, message
    # its own work, the pod's status, still passes
    world.kubelet.patch_namespaced_pod_status(
        name(pod), victim, {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "ContainersNotReady"}]}},
        _content_type=STRATEGIC)
    live = world.api.read_namespaced_pod(name(pod), victim)
    assert [(c.type, c.status) for c in live.status.conditions] == [("Ready", "False")]
    assert live.metadata.annotations[GROUP_MIN_MEMBER] == "2" and ALLOCATION not in live.metadata.annotations


# ---- the extender ---------------------------------------------------------------------------------

def test_extender_cannot_change_a_pods_image(world):
    patch = {"spec": {"containers": [{"name": "c", "image": "evil.example/miner:1"}]}}
    message = refusal(lambda: world.extender.patch_namespaced_pod(name(world.system_pod_there), "kube-system", patch))
    assert "spec, finalizers or ownerReferences changed" in message, message


def test_extender_cannot_change_a_pods_spec_labels_or_foreign_annotations(world):
    pod = name(world.unbound_pod)
    message = refusal(lambda: world.extender.patch_namespaced_pod(
        pod, world.ns, {"spec": {"activeDeadlineSeconds": 1}}))
    assert "spec, finalizers or ownerReferences changed" in message, message
    message = refusal(lambda: world.extender.patch_namespaced_pod(
        pod, world.ns, metadata_patch(labels={"app": "x"}), _content_type=MERGE))
    assert "labels set" in message, message
    message = refusal(lambda: world.extender.patch_namespaced_pod(
        pod, world.ns, metadata_patch(annotations={"example.com/x": "y"}), _content_type=MERGE))
    assert "annotations example.com/x changed" in message, message


def test_extender_writes_and_removes_the_allocation_annotation(world):
    pod = name(world.unbound_pod)
    world.extender.patch_namespaced_pod(pod, world.ns, metadata_patch(annotations={ALLOCATION: "{}", BIND_TIME: "1"}),
                                        _content_type=MERGE)
    assert world.api.read_namespaced_pod(pod, world.ns).metadata.annotations[ALLOCATION] == "{}"
    world.extender.patch_namespaced_pod(pod, world.ns, metadata_patch(annotations={ALLOCATION: None, BIND_TIME: None}),
                                        _content_type=MERGE)
    assert ALLOCATION not in (world.api.read_namespaced_pod(pod, world.ns).metadata.annotations or {})


def test_extender_reads_disruption_budgets_and_writes_none(world):
    """preempt's PodDisruptionBudgets: list and watch, no write (templates' ClusterRole)."""
    policy = client.PolicyV1Api(world.extender.api_client)
    policy.list_pod_disruption_budget_for_all_namespaces(limit=1)
    body = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "x"},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "x"}}}}
    message = refusal(lambda: policy.create_namespaced_pod_disruption_budget(world.ns, body))
    assert "forbidden" in message, message


def test_extender_binding_may_carry_only_qgpu_annotations(world):
    pod = world.pod(world.ns, f"bind-{uuid.uuid4().hex[:6]}", None)

    def bind(annotations: dict[str, str]) -> None:
        body = client.V1Binding(metadata=client.V1ObjectMeta(name=name(pod), namespace=world.ns, annotations=annotations),
                                target=client.V1ObjectReference(api_version="v1", kind="Node", name=world.node_b))
        world.extender.create_namespaced_pod_binding(name(pod), world.ns, body, _preload_content=False)

    message = refusal(lambda: bind({ALLOCATION: "{}", "example.com/x": "y"}))
    assert "annotations example.com/x in a Binding" in message, message
    bind({ALLOCATION: "{}", BIND_TIME: "1"})
    bound = world.api.read_namespaced_pod(name(pod), world.ns)
    assert bound.spec.node_name == world.node_b and bound.metadata.annotations[ALLOCATION] == "{}"


# ---- a tenant (issue 21): nothing it writes is qgpu state ----------------------------------------

def tenant_pod(name_: str, annotations: dict[str, str] | None = None, node: str | None = None,
               scheduler: str = "qgpu-test-nobody") -> dict[str, Any]:
    spec: dict[str, Any] = {"schedulerName": scheduler, "automountServiceAccountToken": False,
                            "tolerations": [{"operator": "Exists"}], "containers": [{"name": "c", "image": PAUSE}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name_, "annotations": annotations or {}}, "spec": spec}


@pytest.fixture(scope="module")
def tenant(world: Identities, tmp_path_factory: pytest.TempPathFactory) -> tuple[client.CoreV1Api, str]:
    """A user with the built-in `edit` role in a namespace of its own, and that namespace."""
    namespace = world.cluster.namespace()
    return edit_user(world.cluster, namespace, tmp_path_factory.mktemp("tenant") / "kubeconfig"), namespace


def _create_as_tenant(world: Identities, tenant: tuple[client.CoreV1Api, str], doc: dict[str, Any]) -> None:
    api, namespace = tenant
    api.create_namespaced_pod(namespace, doc, _preload_content=False)
    world.created_pods.append((namespace, doc["metadata"]["name"]))


@pytest.mark.parametrize("annotation", [ALLOCATION, BIND_TIME, ALLOCATION_SIGNATURE, ASSIGNED, "qgpu.io/anything-new"])
def test_a_tenant_cannot_create_a_pod_carrying_qgpu_state(world, tenant, annotation):
    """The attack of issue 21: a pod created with spec.nodeName and its own allocation record."""
    doc = tenant_pod(f"forged-{uuid.uuid4().hex[:6]}", {annotation: "9000000000000000000"}, node=world.node_b)
    message = refusal(lambda: _create_as_tenant(world, tenant, doc))
    assert f"annotation {annotation} set, changed or removed by tenant-" in message, message
    assert "rule: qgpu.io/ annotations on pods are qgpu state" in message, message


@pytest.mark.parametrize("resources, init", [
    ({"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "4"}, False),
    ({"nvidia.com/gpu": "1"}, False),
    ({"tensorstack.dev/nvidia-gpu-percent": "50"}, False),
    ({"tke.cloud.tencent.com/qgpu-core": "10"}, True),  # an init container's devices are allocated too
    ({"tke.cloud.tencent.com/qgpu-memory": "4", "tencent.com/vcuda-core": "10", "nvidia.com/gpu": "1"}, False),
])
def test_a_tenant_cannot_create_a_gpu_pod_already_bound_to_a_node(world, tenant, resources, init):
    """Kubelet's Allocate names devices, not the pod: a pod created with spec.nodeName and a GPU
    resource carries no allocation record, and the node manager matched its Allocate to another
    pending pod of the same size, granting that pod's cards to the stranger (helper audit, 2026-12-01)."""
    name_ = f"bound-{uuid.uuid4().hex[:6]}"
    message = refusal(lambda: _create_as_tenant(world, tenant, bound_gpu_pod(name_, world.node_b, resources, init=init)))
    # the policy names the first GPU resource asked in name order (a map's keys come in no fixed order)
    assert f"{name_}: created with spec.nodeName {world.node_b} and GPU resource {min(resources)} by " in message, message
    assert "rule: a pod asking for GPU resources is placed by kube-scheduler through the qgpu extender" in message, message


def test_a_gpu_pod_left_to_the_scheduler_and_a_bound_pod_without_gpus_are_admitted(world, tenant):
    gpu = tenant_pod(f"unbound-{uuid.uuid4().hex[:6]}")
    gpu["spec"]["containers"][0]["resources"] = {"limits": {"tke.cloud.tencent.com/qgpu-core": "30"}}
    _create_as_tenant(world, tenant, gpu)
    _create_as_tenant(world, tenant, tenant_pod(f"bound-cpu-{uuid.uuid4().hex[:6]}", node=world.node_b))


def test_a_tenant_writes_its_claims_and_never_their_allocation(world, tenant):
    """The DRA node believes a claim's status.allocation (its devices and consumedCapacity), which
    only kube-scheduler and the resourceclaim controller may write: a tenant with `edit` creates
    and changes claims, never their status (docs/security.md)."""
    _, namespace = tenant
    authz = client.AuthorizationV1Api(world.cluster.api_client)

    def allowed(verb: str, resource: str, subresource: str = "") -> bool:
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {
            "user": f"tenant-{namespace}", "resourceAttributes": {
                "namespace": namespace, "verb": verb, "group": "resource.k8s.io", "resource": resource,
                "subresource": subresource}}}
        return bool(authz.create_subject_access_review(review).status.allowed)

    for resource in ("resourceclaims", "resourceclaimtemplates"):
        assert allowed("create", resource) and allowed("update", resource), resource
    for verb in ("update", "patch"):
        assert not allowed(verb, "resourceclaims", "status"), verb


def test_a_tenant_still_writes_the_annotations_meant_for_users(world, tenant):
    _create_as_tenant(world, tenant, tenant_pod(f"models-{uuid.uuid4().hex[:6]}", {"qgpu.io/gpu-model": "V100|T4"}))
    # a T9k group's minimum size is the owner's request for its own group (docs/extender.md, Groups)
    group = f"group-{uuid.uuid4().hex[:6]}"
    _create_as_tenant(world, tenant, tenant_pod(group, {GROUP_MIN_MEMBER: "3"}))
    # and it may resize its own group later: the group is the label within its namespace, so only its
    # own pods wait the longer (a node's identities may not: test_manager_cannot_add_change_or_remove_...)
    api, namespace = tenant
    api.patch_namespaced_pod(group, namespace, metadata_patch(annotations={GROUP_MIN_MEMBER: "4"}), _content_type=MERGE)


def test_a_tenant_cannot_add_change_or_remove_qgpu_state_on_its_own_pod(world, tenant):
    api, namespace = tenant
    pod = f"mine-{uuid.uuid4().hex[:6]}"
    _create_as_tenant(world, tenant, tenant_pod(pod))
    added = refusal(lambda: api.patch_namespaced_pod(pod, namespace, metadata_patch(annotations={BIND_TIME: "1"}),
                                                     _content_type=MERGE))
    assert f"annotation {BIND_TIME} set, changed or removed" in added, added
    # the extender binds it with a record (its own write passes) ...
    body = client.V1Binding(metadata=client.V1ObjectMeta(name=pod, namespace=namespace, annotations={ALLOCATION: "{}"}),
                            target=client.V1ObjectReference(api_version="v1", kind="Node", name=world.node_b))
    world.extender.create_namespaced_pod_binding(pod, namespace, body, _preload_content=False)
    # ... and the tenant can neither change nor remove that record
    changed = refusal(lambda: api.patch_namespaced_pod(pod, namespace, metadata_patch(annotations={ALLOCATION: "[]"}),
                                                       _content_type=MERGE))
    removed = refusal(lambda: api.patch_namespaced_pod(pod, namespace, metadata_patch(annotations={ALLOCATION: None}),
                                                       _content_type=MERGE))
    assert f"annotation {ALLOCATION} set, changed or removed" in changed and ALLOCATION in removed, (changed, removed)
    # its other edits are its own business
    api.patch_namespaced_pod(pod, namespace, metadata_patch(labels={"team": "a"}, annotations={"example.com/x": "y"}),
                             _content_type=MERGE)


# ---- a tenant (issue F1/F2): what a pod is charged by is fixed once it exists -----------------------

# A value each annotation could carry at CREATE (no webhook runs in this module: only the policies judge).
REQUEST_VALUES = {"tke.cloud.tencent.com/app-class": "offline", "qgpu.io/gpu-model": "V100|T4", "nvidia.com/use-gputype": "V100",
                  "nvidia.com/nouse-gputype": "T4", "gpu-fraction": "0.9", "gpu-memory": "4096", "gpu-fraction-num-devices": "4",
                  "gpu-fraction-container-name": "c", "qgpu.io/gpu-mode": "device-plugin"}


def test_every_annotation_a_pod_is_charged_by_has_a_value_here():
    assert set(REQUEST_VALUES) == set(CHARGE_ANNOTATIONS)


@pytest.mark.parametrize("annotation", CHARGE_ANNOTATIONS)
def test_a_tenant_sets_what_its_pod_is_charged_by_at_create_and_never_after(world, tenant, annotation):
    """`kubectl annotate pod big tke.cloud.tencent.com/app-class=x` took an 8-card pod's charge to one
    card; removing `qgpu.io/gpu-mode: device-plugin` in a DRA namespace took it to none; a KAI share
    lowered after its bind, or raised before it, was charged what it no longer is."""
    api, namespace = tenant
    # KAI's keys are read (and fixed) only on KAI's pods
    scheduler = KAI_SCHEDULER if annotation in KAI_ANNOTATIONS else "qgpu-test-nobody"
    created = f"fixed-{uuid.uuid4().hex[:6]}"
    _create_as_tenant(world, tenant, tenant_pod(created, {annotation: REQUEST_VALUES[annotation]}, scheduler=scheduler))
    bare = f"bare-{uuid.uuid4().hex[:6]}"
    _create_as_tenant(world, tenant, tenant_pod(bare, scheduler=scheduler))
    for pod, value in ((created, "0.01"), (created, None), (bare, REQUEST_VALUES[annotation])):
        patch = metadata_patch(annotations={annotation: value})
        message = refusal(lambda pod=pod, patch=patch: api.patch_namespaced_pod(pod, namespace, patch, _content_type=MERGE))
        assert f"Pod {namespace}/{pod}: annotation {annotation} added, changed or removed by tenant-" in message, message
        assert "rule: the annotations that a pod is placed and charged GPU quota by are fixed when the pod is created" in message
    # the same value again is no change, and every other annotation and label stays the owner's to edit
    api.patch_namespaced_pod(created, namespace, metadata_patch(
        labels={"team": "a"}, annotations={annotation: REQUEST_VALUES[annotation], "example.com/x": "y"}), _content_type=MERGE)
    api.patch_namespaced_pod(bare, namespace, metadata_patch(annotations={"example.com/x": None, "gpu-fraction-x": "1"}),
                             _content_type=MERGE)
    assert world.api.read_namespaced_pod(created, namespace).metadata.annotations[annotation] == REQUEST_VALUES[annotation]


def test_kais_unprefixed_keys_stay_writable_on_pods_kai_does_not_schedule(world, tenant):
    """`gpu-memory` is any software's name on any other pod: only a kai-scheduler pod is charged by it."""
    api, namespace = tenant
    other = f"other-{uuid.uuid4().hex[:6]}"
    _create_as_tenant(world, tenant, tenant_pod(other, {"gpu-memory": "1"}))
    api.patch_namespaced_pod(other, namespace, metadata_patch(annotations={"gpu-memory": "2", "gpu-fraction": "0.5"}),
                             _content_type=MERGE)
    api.patch_namespaced_pod(other, namespace, metadata_patch(annotations={"gpu-memory": None}), _content_type=MERGE)
    assert "gpu-memory" not in (world.api.read_namespaced_pod(other, namespace).metadata.annotations or {})


def test_no_binding_carries_an_annotation_a_pod_is_charged_by(world):
    """A Binding's annotations are copied onto its pod: even the extender, which may write qgpu.io/
    annotations there, cannot change a pod's qgpu.io/gpu-mode or gpu-model through one."""
    pod = world.pod(world.ns, f"bind-mode-{uuid.uuid4().hex[:6]}", None)

    def bind(annotations: dict[str, str]) -> None:
        body = client.V1Binding(metadata=client.V1ObjectMeta(name=name(pod), namespace=world.ns, annotations=annotations),
                                target=client.V1ObjectReference(api_version="v1", kind="Node", name=world.node_b))
        world.extender.create_namespaced_pod_binding(name(pod), world.ns, body, _preload_content=False)

    message = refusal(lambda: bind({ALLOCATION: "{}", "qgpu.io/gpu-mode": "device-plugin"}))
    assert f"Binding of pod {world.ns}/{name(pod)}: annotation qgpu.io/gpu-mode in a Binding" in message, message
    bind({ALLOCATION: "{}"})
    assert world.api.read_namespaced_pod(name(pod), world.ns).spec.node_name == world.node_b


# ---- the real components, doing their real work with their bound tokens ---------------------------

def token_kubeconfig(world: Identities, token: str, path) -> str:
    cp = world.cluster.cp
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": cp.server, "certificate-authority": str(cp.ca.cert_path)}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "sa"}}], "current-context": "c"}))
    return str(path)


def test_node_manager_publishes_its_node_and_serves_allocate_with_its_bound_token(world, tmp_path, label):
    """`qgpu manager serve` with the token of a pod on its node: labels and inventory on its Node,
    the qgpu.io/assigned annotation on the pod it serves; nothing refused."""
    node = ManagedNode(f"lp-{uuid.uuid4().hex[:8]}", "1xT4-16G", world.cluster.cp.admin_kubeconfig)
    try:
        bare_node(world.api, node.name, label)
        manager_pod = world.pod(world.ns, f"qgpu-manager-{node.name}", node.name, service_account="qgpu-manager")
        kubeconfig = token_kubeconfig(world, world.bound_token("qgpu-manager", manager_pod), tmp_path / "kubeconfig")
        limits = {"tke.cloud.tencent.com/qgpu-core": 20, "tke.cloud.tencent.com/qgpu-memory": 2}
        world.api.create_namespaced_pod(world.ns, gpu_pod("served", limits, scheduler_name="qgpu-test-nobody"))
        world.created_pods.append((world.ns, "served"))
        # as the extender: no one else may write qgpu.io/ annotations (qgpu-pod-annotations)
        bind_with_record(world.extender, world.ns, "served", node.name, [(0, node.cards[0].uuid, 200, 2048)], time.time_ns())
        node.start(kubeconfig=kubeconfig)
        wait_for("the manager's labels on its node",
                 lambda: read_node(world.api, node.name)["metadata"].get("labels", {}).get(LABEL_COUNT) == "1")
        assert node.kubelet.admit(read_pod(world.api, world.ns, "served"))["c0"]["NVIDIA_VISIBLE_DEVICES"] == node.cards[0].uuid
        # written after Allocate returned (node/annotationwriter.py), off the admission path: it lands soon
        notes = wait_for("the manager's qgpu.io/assigned on the pod", lambda: (
            n := read_pod(world.api, world.ns, "served")["metadata"]["annotations"]) and ASSIGNED in n and n)
        assert json.loads(notes[ASSIGNED]) == ["c0"]
        # simulated cards: the node says its shares are not enforced, and why, in its status and an Event
        condition = wait_for("the manager's condition on its node", lambda: next(
            (c for c in read_node(world.api, node.name).get("status", {}).get("conditions") or []
             if c["type"] == "QGPUSharesEnforced"), None))
        assert (condition["status"], condition["reason"]) == ("False", "SimulatedGPUs"), condition
        (event,) = wait_for("the manager's Event on its node", lambda: [
            e for e in events_for(world.api, "default", node.name) if e["reason"] == "SharesNotEnforced"])
        assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "Node", event
        assert event["message"].startswith("SimulatedGPUs: the cards are simulated"), event
        assert "forbidden" not in node.log().lower(), node.log()  # RBAC's and the policy's refusals say so
    finally:
        node.close()
        _quietly(lambda: world.api.delete_node(node.name))


def test_extender_binds_through_kube_scheduler_with_its_bound_token(world, tmp_path, label):
    """The real kube-scheduler binds a GPU pod through `qgpu extender serve` running with the token
    of its pod: the Binding carrying the allocation record passes the policy."""
    kubeconfig = token_kubeconfig(world, world.bound_token("qgpu-scheduler", world.extender_pod), tmp_path / "kubeconfig")
    cluster = world.cluster
    # its node commitment Leases live in its own namespace, where the template's Role lets it write them
    cluster.restart_extender(kubeconfig=kubeconfig, extra_args=("--commitment-namespace", world.ns))
    node = f"{world.ns}-gpu"
    try:
        gpu_node(world.api, node, cards(2, node=node), label)
        limits = {"tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 5}
        world.api.create_namespaced_pod(world.ns, gpu_pod("placed", limits, selector=label))
        world.created_pods.append((world.ns, "placed"))
        pod = bound(world.api, world.ns, "placed")
        rec = record(pod)
        assert rec is not None and rec.node == pod["spec"]["nodeName"] == node
        log = cluster.extender.process.tail(200) if cluster.extender.process else ""
        assert "forbidden" not in log.lower(), log  # not "403": log timestamps have milliseconds
    finally:
        cluster.restart_extender()
        _quietly(lambda: world.api.delete_node(node))
