"""The extender works with exactly the ClusterRole its deployment template grants.

Everything else under tests/k8s runs the extender as the cluster admin, which hid a call the role
does not allow: binds went to the namespaced ``bindings`` resource, which the role (``pods/binding``)
does not grant, so every bind of a deployed extender failed with 403. This test runs it as a user
bound only to the rendered ClusterRole, and the real kube-scheduler binds a GPU pod through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import yaml
from kubernetes import client

from tests.k8s.controlplane import kubeconfig
from tests.k8s.kubeobjects import bound, cards, gpu_node, gpu_pod, record

ROOT = Path(__file__).resolve().parents[2]


def scheduler_cluster_role() -> dict[str, Any]:
    """The ClusterRole of templates/kubernetes/qgpu-scheduler.yaml.j2 with the role's defaults."""
    defaults = yaml.safe_load((ROOT / "roles" / "qgpu_scheduler" / "defaults" / "main.yml").read_text())
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(ROOT / "templates" / "kubernetes")),
                             undefined=jinja2.StrictUndefined)
    env.filters["to_json"] = json.dumps
    text = env.get_template("qgpu-scheduler.yaml.j2").render(
        **{**defaults, "ansible_managed": "test", "qgpu_scheduler_namespace": "kube-system",
           "qgpu_scheduler_image": "qgpu:test"})
    (role,) = [d for d in yaml.safe_load_all(text) if d and d["kind"] == "ClusterRole"]
    return role


def test_extender_binds_with_exactly_the_clusterrole_of_its_template(tmp_path, cluster, ns, label):
    role = scheduler_cluster_role()
    name = f"qgpu-scheduler-{ns}"
    user = f"qgpu-scheduler-test-{ns}"
    rbac = client.RbacAuthorizationV1Api(cluster.api_client)
    rbac.create_cluster_role({**role, "metadata": {**role["metadata"], "name": name}})
    rbac.create_cluster_role_binding({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})
    cp = cluster.cp
    pair = cp.ca.issue(f"scheduler-{ns}", user, client=True)
    cfg = tmp_path / "extender.kubeconfig"
    cfg.write_text(yaml.safe_dump(kubeconfig(cp.server, cp.ca.cert_path, pair, user)))
    cluster.restart_extender(kubeconfig=cfg)
    try:
        gpu_node(cluster.api, f"{ns}-a", cards(2, node=f"{ns}-a"), label)
        limits = {"tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 5}
        cluster.api.create_namespaced_pod(ns, gpu_pod("p", limits, selector=label))
        pod = bound(cluster.api, ns, "p")
        rec = record(pod)
        assert rec is not None and rec.node == pod["spec"]["nodeName"] == f"{ns}-a"
        log = cluster.extender.process.tail(200) if cluster.extender.process else ""
        assert "403" not in log and "Forbidden" not in log, log
    finally:
        cluster.restart_extender()
        rbac.delete_cluster_role_binding(name)
        rbac.delete_cluster_role(name)
