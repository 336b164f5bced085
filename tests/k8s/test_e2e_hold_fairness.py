"""Pods stuck after filter cannot keep another namespace's pods out (issue 21 §5), under the real
kube-scheduler.

Three pods of one namespace mount volumes of a StorageClass whose provisioner never answers (no
controller-manager runs here either): kube-scheduler's VolumeBinding chooses their node, then waits
in PreBind for volumes that never come, and the extender's holds for them last until the assume
timeout. With ``--max-holds 3`` all of them were taken, and another namespace's pod was refused
until they expired (74 s in the issue, 600 s here). Now it takes the oldest hold of the namespace
holding most and is scheduled; the waiting is bounded polling, and the assertion is that it binds.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.k8s.kubeobjects import bound, cards, gpu_node, gpu_pod, read_pod, wait_for

LIMITS = {"tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 4}
SELECTED_NODE = "volume.kubernetes.io/selected-node"  # VolumeBinding's PreBind writes it, then waits


def claim(name: str, storage_class: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": storage_class,
                     "resources": {"requests": {"storage": "1Gi"}}}}


def with_volume(pod: dict[str, Any], claim_name: str) -> dict[str, Any]:
    pod["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim_name}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    return pod


def test_pods_stuck_in_prebind_do_not_keep_another_namespaces_pod_out(cluster, label):
    team_a, team_b = cluster.namespace(), cluster.namespace()
    node = f"{team_a}-n"
    gpu_node(cluster.api, node, cards(2, node=node), label)
    storage = client.StorageV1Api(cluster.api_client)
    never = f"qgpu-never-{team_a}"
    storage.create_storage_class({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": never},
                                  "provisioner": "example.com/never", "volumeBindingMode": "WaitForFirstConsumer"})
    cluster.restart_extender(assume_timeout=600.0, extra_args=("--max-holds", "3", "--max-holds-per-namespace", "3"))
    try:
        for i in range(3):
            cluster.api.create_namespaced_persistent_volume_claim(team_a, claim(f"data-{i}", never))
            cluster.api.create_namespaced_pod(team_a, with_volume(gpu_pod(f"stuck-{i}", LIMITS, selector=label), f"data-{i}"))

        def all_in_prebind() -> bool | None:
            claims = [cluster.api.read_namespaced_persistent_volume_claim(f"data-{i}", team_a) for i in range(3)]
            return all((c.metadata.annotations or {}).get(SELECTED_NODE) == node for c in claims) or None

        wait_for("the three pods of team A past filter and waiting in PreBind", all_in_prebind, timeout=60)
        cluster.api.create_namespaced_pod(team_b, gpu_pod("q", LIMITS, selector=label))
        try:
            pod = bound(cluster.api, team_b, "q", timeout=60)
        except AssertionError as exc:
            scheduler = cluster.cp.processes.get("kube-scheduler")
            raise AssertionError(f"{exc}\n--- extender ---\n{cluster.extender.process.tail(60) if cluster.extender.process else ''}"
                                 f"\n--- kube-scheduler ---\n{scheduler.tail(60) if scheduler else ''}") from None
        assert pod["spec"]["nodeName"] == node
        assert not any(read_pod(cluster.api, team_a, f"stuck-{i}")["spec"].get("nodeName") for i in range(3))
    finally:
        cluster.restart_extender()
        for i in range(3):
            _quietly(lambda: cluster.api.delete_namespaced_pod(f"stuck-{i}", team_a, grace_period_seconds=0))
        _quietly(lambda: storage.delete_storage_class(never))


def _quietly(call: Any) -> None:
    try:
        call()
    except ApiException:
        pass
