"""The extender works with exactly the ClusterRole its deployment template grants.

Everything else under tests/k8s runs the extender as the cluster admin, which hid a call the role
does not allow: binds went to the namespaced ``bindings`` resource, which the role (``pods/binding``)
does not grant, so every bind of a deployed extender failed with 403. This test runs it as a user
bound only to the rendered ClusterRole, and the real kube-scheduler binds a GPU pod through it.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.k8s.conftest import QGPU_NAMESPACE
from tests.k8s.kubeobjects import bound, cards, gpu_node, gpu_pod, record
from tests.k8s.rbac import bind_roles, kubeconfig_bound_to, template_cluster_role, template_roles, unbind, unbind_roles

ROOT = Path(__file__).resolve().parents[2]


def test_extender_binds_with_exactly_the_clusterrole_of_its_template(tmp_path, cluster, ns, label):
    defaults = yaml.safe_load((ROOT / "roles" / "qgpu_scheduler" / "defaults" / "main.yml").read_text())
    variables = {**defaults, "qgpu_scheduler_namespace": QGPU_NAMESPACE, "qgpu_scheduler_image": "qgpu:test"}
    role = template_cluster_role("qgpu-scheduler.yaml.j2", **variables)
    # node commitments (on by default): the Lease Role of the same template, in the extender's namespace
    lease_roles = template_roles("qgpu-scheduler.yaml.j2", **variables)
    assert lease_roles, "the template grants no Role for the node commitment Leases"
    name = f"qgpu-scheduler-{ns}"
    kubeconfig = kubeconfig_bound_to(cluster, role, name, tmp_path / "extender.kubeconfig")
    bind_roles(cluster, lease_roles, name)
    cluster.restart_extender(kubeconfig=kubeconfig)
    try:
        gpu_node(cluster.api, f"{ns}-a", cards(2, node=f"{ns}-a"), label)
        limits = {"tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 5}
        cluster.api.create_namespaced_pod(ns, gpu_pod("p", limits, selector=label))
        pod = bound(cluster.api, ns, "p")
        rec = record(pod)
        assert rec is not None and rec.node == pod["spec"]["nodeName"] == f"{ns}-a"
        log = cluster.extender.process.tail(200) if cluster.extender.process else ""
        # RBAC's refusals say "forbidden"; "403" also matches a log timestamp's milliseconds.
        assert "forbidden" not in log.lower(), log
    finally:
        cluster.restart_extender()
        unbind(cluster, name)
        unbind_roles(cluster, lease_roles, name)
