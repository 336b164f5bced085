"""playbooks/node-pool-rollout.yml on the real node: pods that really run are drained through the
eviction API, a PodDisruptionBudget is respected (the drain stops, the node stays cordoned, the
protected pod keeps running), and without the blocking budget the pods are evicted, the node is
uncordoned and the workloads (a GPU one among them) run again."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterator

import pytest
from kubernetes import client, config

from tests.polling import poll
from tests.realnode import kube
from tests.realnode.localcluster import ROOT, LocalCluster
from tests.realnode.test_e2e_dialects import cluster_image

NS = "rollout"


@pytest.fixture(scope="module")
def ns(local_cluster: LocalCluster) -> Iterator[str]:
    api = kube.core(local_cluster)
    yield kube.namespace(api, NS)
    api.delete_namespace(NS)
    api.patch_node("localhost", {"spec": {"unschedulable": None}})


def rollout(cluster: LocalCluster) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0"}
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", str(ROOT / "inventories" / "local-cluster"),
                           "-e", f"@{cluster.dir / 'inventory-vars.yml'}", "-e", "qgpu_rollout_drain_timeout=20",
                           str(ROOT / "playbooks" / "node-pool-rollout.yml")],
                          cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def deployment(cluster: LocalCluster, name: str, limits: dict[str, str]) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"terminationGracePeriodSeconds": 1, "automountServiceAccountToken": False,
                                           "containers": [{"name": "main", "image": cluster_image(cluster),
                                                           "imagePullPolicy": "Never", "command": ["sleep", "3600"],
                                                           "resources": {"limits": limits}}]}}}}


def running_pod(api: client.CoreV1Api, app: str) -> str | None:
    pods = api.list_namespaced_pod(NS, label_selector=f"app={app}").items
    running = [p.metadata.name for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
    return running[0] if running else None


def test_a_disruption_budget_stops_the_drain_and_the_node_stays_cordoned(local_cluster: LocalCluster, ns: str) -> None:
    api = kube.core(local_cluster)
    apps = kube.apps(local_cluster)
    apps.create_namespaced_deployment(ns, deployment(local_cluster, "web", {"cpu": "100m"}))
    apps.create_namespaced_deployment(ns, deployment(local_cluster, "trainer", {"tke.cloud.tencent.com/qgpu-core": "30",
                                                                               "tke.cloud.tencent.com/qgpu-memory": "2"}))
    web = poll(lambda: running_pod(api, "web"), timeout=90, what="web running")
    poll(lambda: running_pod(api, "trainer"), timeout=90, what="trainer running")
    policy = client.PolicyV1Api(config.new_client_from_config(str(local_cluster.admin_kubeconfig)))
    policy.create_namespaced_pod_disruption_budget(ns, {"metadata": {"name": "web"},
                                                        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}}})
    out = rollout(local_cluster)
    assert out.returncode != 0, out.stdout[-3000:]
    assert "node localhost failed in \"Drain the node" in out.stdout, out.stdout[-3000:]
    assert api.read_node("localhost").spec.unschedulable is True
    assert running_pod(api, "web") == web  # the budget held: never evicted
    # The operator lifts the budget and the cordon, as the failure message tells them to.
    policy.delete_namespaced_pod_disruption_budget("web", ns)
    api.patch_node("localhost", {"spec": {"unschedulable": None}})


def test_without_a_blocking_budget_real_pods_are_evicted_and_run_again_after_uncordon(local_cluster: LocalCluster, ns: str) -> None:
    api = kube.core(local_cluster)
    before = {app: poll(lambda: running_pod(api, app), timeout=90, what=f"{app} running") for app in ("web", "trainer")}
    out = rollout(local_cluster)
    assert out.returncode == 0, out.stdout[-4000:]
    assert not api.read_node("localhost").spec.unschedulable
    for app, old in before.items():
        def replaced(app: str = app, old: str = old) -> str | None:
            name = running_pod(api, app)
            return name if name and name != old else None

        assert poll(replaced, timeout=120, what=f"{app} replaced by a new running pod") != old
