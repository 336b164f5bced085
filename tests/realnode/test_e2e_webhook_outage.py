"""The admission webhook sees only GPU pods: with the webhook's pod stopped, ordinary pods are
still created (its matchConditions keep them away from it) while GPU pods are refused (it fails
closed for what it guards); once it runs again GPU pods are admitted."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.polling import poll
from tests.realnode import kube
from tests.realnode.localcluster import QGPU_NAMESPACE, LocalCluster
from tests.realnode.test_e2e_dialects import cluster_image

SELECTOR = "app.kubernetes.io/name=qgpu-webhook"


ns = kube.namespace_fixture("outage")


def park_webhook(cluster: LocalCluster, parked: bool) -> None:
    """Take the webhook's pods off the node (or back): its workload no longer matches the node."""
    apps = kube.apps(cluster)
    workloads = apps.list_namespaced_daemon_set(QGPU_NAMESPACE, label_selector=SELECTOR).items
    for ds in workloads:
        selector = {"qgpu.io/parked": "yes" if parked else None}
        apps.patch_namespaced_daemon_set(ds.metadata.name, QGPU_NAMESPACE,
                                         {"spec": {"template": {"spec": {"nodeSelector": selector}}}})
    api = kube.core(cluster)
    if parked:
        poll(lambda: not api.list_namespaced_pod(QGPU_NAMESPACE, label_selector=SELECTOR).items, timeout=60,
             what="the webhook pods gone")
    else:
        poll(lambda: [p for p in api.list_namespaced_pod(QGPU_NAMESPACE, label_selector=SELECTOR).items
                      if any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))],
             timeout=90, what="a webhook pod ready")


def test_a_webhook_outage_blocks_only_gpu_pods(local_cluster: LocalCluster, ns: str) -> None:
    api = kube.core(local_cluster)
    image = cluster_image(local_cluster)
    park_webhook(local_cluster, True)
    try:
        api.create_namespaced_pod(ns, kube.shell_pod("plain", image, "exec sleep 3600"))
        with pytest.raises(client.ApiException) as refused:
            api.create_namespaced_pod(ns, kube.shell_pod("gpu", image, "exec sleep 3600",
                                                         limits={"tke.cloud.tencent.com/qgpu-core": "10",
                                                                 "tke.cloud.tencent.com/qgpu-memory": "1"}))
        assert "failed calling webhook" in str(refused.value.body), refused.value.body
    finally:
        park_webhook(local_cluster, False)
    kube.wait_phase(api, ns, "plain", ("Running",))
    api.create_namespaced_pod(ns, kube.shell_pod("gpu", image, "exec sleep 3600",
                                                 limits={"tke.cloud.tencent.com/qgpu-core": "10",
                                                         "tke.cloud.tencent.com/qgpu-memory": "1"}))
    kube.wait_phase(api, ns, "gpu", ("Running",))
