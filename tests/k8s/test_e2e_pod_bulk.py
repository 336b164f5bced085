"""A tenant's pod as large as the apiserver serves it, against the real kube-apiserver and the
extender's own LIST: etcd bounds the stored object (1.5 MiB), not the JSON served for it, and the
apiserver's JSON writes ``<`` as ``\\u003c``. A pod of 0.9 MB of ``<`` in one env value is accepted
and served past 4 MiB; with kube/paging.py's 4 MiB page cap for a page of one object too,
the extender's pod LIST could not be read, its restart never became ready and every bind was
refused (the LIST retried for ever)."""

from __future__ import annotations

import json

from kubernetes.client.exceptions import ApiException

from qgpu_runtime.kube.paging import LIST_PAGE_BYTES
from qgpu_runtime.kube.podslim import MAX_KEPT_POD_ENTRIES
from tests.k8s.kubeobjects import PAUSE, cards, gpu_node, gpu_pod, read_pod, scheduling_failure, wait_for


def test_a_pod_served_past_the_page_cap_stops_neither_the_extenders_list_nor_its_binds(cluster, ns, label):
    bulky = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "escaped"}, "spec": {
        "schedulerName": "no-such-scheduler",  # unbound for ever: the extender keeps it (its mirror)
        "terminationGracePeriodSeconds": 0, "automountServiceAccountToken": False,
        "containers": [{"name": "c", "image": PAUSE, "env": [{"name": "X", "value": "<" * 900_000}]}]}}
    cluster.api.create_namespaced_pod(ns, bulky, _preload_content=False)
    try:
        served = cluster.api.read_namespaced_pod("escaped", ns, _preload_content=False).data
        assert len(served) > LIST_PAGE_BYTES and b"\\u003c" in served[:1_000_000], len(served)
        cluster.restart_extender()  # its first LIST reads every live pod, this one among them
        gpu_node(cluster.api, f"{ns}-n", cards(1, node=f"{ns}-n"), label)
        cluster.api.create_namespaced_pod(ns, gpu_pod("after", {"tke.cloud.tencent.com/qgpu-core": 30,
                                                                "tke.cloud.tencent.com/qgpu-memory": 1}, selector=label),
                                          _preload_content=False)
        bound = wait_for("the GPU pod bound", lambda: read_pod(cluster.api, ns, "after")["spec"].get("nodeName"))
        assert bound == f"{ns}-n"
        assert json.loads(served)["spec"]["containers"][0]["env"][0]["value"] == "<" * 900_000
    finally:
        cluster.api.delete_namespaced_pod("escaped", ns, grace_period_seconds=0, _preload_content=False)
        try:
            cluster.api.delete_node(f"{ns}-n", _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:
                raise
        if cluster.extender.process is None or cluster.extender.process.popen.poll() is not None:
            cluster.restart_extender()


def test_a_gpu_pod_past_the_entries_qgpu_keeps_is_refused_by_name_and_the_next_pod_is_placed(cluster, ns, label):
    """kube-apiserver bounds a pod's containers only by the object's size (v1.37.2 took 10,000):
    a GPU pod with 600 more containers is admitted. The extender keeps it without them
    (kube/podslim.py MAX_KEPT_POD_ENTRIES), so its filter refuses it, and kube-scheduler's event
    names the pod, the list, its length and the bound; the next GPU pod is placed."""
    gpu = {"tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 1}
    wide = gpu_pod("wide", gpu, selector=label)
    wide["spec"]["containers"] += [{"name": f"w{i}", "image": PAUSE} for i in range(600)]
    try:
        gpu_node(cluster.api, f"{ns}-n", cards(1, node=f"{ns}-n"), label)
        cluster.api.create_namespaced_pod(ns, wide, _preload_content=False)
        event = scheduling_failure(cluster.api, ns, "wide", f"pod {ns}/wide lists 601 spec.containers (")
        assert f"past the {MAX_KEPT_POD_ENTRIES} entries qgpu keeps of one pod's spec" in event["message"], event["message"]
        cluster.api.create_namespaced_pod(ns, gpu_pod("after", gpu, selector=label), _preload_content=False)
        assert wait_for("the GPU pod bound", lambda: read_pod(cluster.api, ns, "after")["spec"].get("nodeName")) == f"{ns}-n"
        assert not read_pod(cluster.api, ns, "wide")["spec"].get("nodeName")
    finally:
        try:
            cluster.api.delete_node(f"{ns}-n", _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:
                raise
