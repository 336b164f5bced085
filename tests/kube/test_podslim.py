"""What the extender and the node manager keep of a pod (kube/podslim.py): not the bulk a tenant
controls and no qgpu component reads, so a few dozen pods near etcd's object limit no longer run
either out of memory."""

from __future__ import annotations

import copy
import gc
import json
import tracemalloc

from qgpu_runtime.extender.podmirror import PodMirror
from qgpu_runtime.kube.podslim import BULK_CONTAINER_FIELDS, kept
from qgpu_runtime.model.requests import parse_pod
from qgpu_runtime.node.podwatch import NodePodCache

NODE = "gpu-node-1"
# ~0.9 MiB of JSON in one container's environment, as a tenant can make it
HEAVY = json.dumps({
    "metadata": {"name": "heavy", "namespace": "t", "uid": "u", "resourceVersion": "1", "labels": {"app": "x"},
                 "annotations": {"qgpu.io/gpu-model": "T4"}, "managedFields": [{"manager": "kubectl"}]},
    "spec": {"nodeName": NODE, "schedulerName": "qgpu", "volumes": [{"name": "v", "emptyDir": {}}],
             "containers": [{"name": "c", "image": "i", "env": [{"name": f"E{i:05d}", "value": "v" * 24} for i in range(20_000)],
                             "command": ["sleep"], "args": ["1"], "volumeMounts": [{"name": "v", "mountPath": "/v"}],
                             "readinessProbe": {"exec": {"command": ["true"]}},
                             "resources": {"limits": {"tke.cloud.tencent.com/qgpu-core": "30",
                                                      "tke.cloud.tencent.com/qgpu-memory": "4"}}}],
             "initContainers": [{"name": "i", "image": "i", "env": [{"name": "A", "value": "b"}], "resources": {}}]},
    "status": {"phase": "Running", "containerStatuses": [{"name": "c", "containerID": "containerd://abc"}]},
})


def heavy(i: int) -> dict:
    pod = json.loads(HEAVY)  # decoded afresh, as each watch event is
    pod["metadata"]["name"] = pod["metadata"]["uid"] = f"heavy-{i}"
    return pod


def test_kept_drops_the_bulk_and_keeps_what_qgpu_reads():
    pod = heavy(0)
    before = copy.deepcopy(pod)
    slim = kept(pod)
    assert pod == before  # the event's pod is not changed
    (container,) = slim["spec"]["containers"]
    assert not BULK_CONTAINER_FIELDS & container.keys()
    assert container == {"name": "c", "image": "i", "resources": pod["spec"]["containers"][0]["resources"]}
    assert slim["spec"]["initContainers"] == [{"name": "i", "image": "i", "resources": {}}]
    assert "volumes" not in slim["spec"] and "managedFields" not in slim["metadata"]
    for field in ("name", "namespace", "uid", "resourceVersion", "labels", "annotations"):
        assert slim["metadata"][field] == pod["metadata"][field]
    assert slim["status"] == pod["status"]
    assert (slim["spec"]["nodeName"], slim["spec"]["schedulerName"]) == (NODE, "qgpu")
    assert parse_pod(slim) == parse_pod(pod)  # the request is read the same
    assert len(json.dumps(slim)) < 2000 < len(HEAVY)


def test_a_pod_with_nothing_to_drop_is_kept_as_it_is_and_each_bulky_part_alone_is_dropped():
    slim = kept(heavy(0))
    assert kept(slim) is slim  # kept already: compared on every call, not copied again
    bare = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    assert kept(bare) is bare
    assert kept({"metadata": {"name": "p"}}) == {"metadata": {"name": "p"}}
    one_each = [
        {"metadata": {"name": "p", "managedFields": [{}]}},
        {"spec": {"volumes": [{"name": "v"}]}},
        {"spec": {"containers": [{"name": "c", "env": [{"name": "A"}]}]}},
        {"spec": {"initContainers": [{"name": "c", "args": ["x"]}]}},
        {"spec": {"ephemeralContainers": [{"name": "c", "startupProbe": {}}]}},
    ]
    for pod in one_each:
        before = copy.deepcopy(pod)
        out = kept(pod)
        assert out is not pod and pod == before, pod
        assert out != pod, pod


def retained(keep) -> int:
    """Bytes still allocated after ``keep`` took twelve heavy pods and the caller dropped them."""
    gc.collect()
    tracemalloc.start()
    try:
        keep([heavy(i) for i in range(12)])
        gc.collect()
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return current


class Source:
    def __init__(self) -> None:
        self.pods: list[dict] = []

    def list_pods_on_node(self, node: str) -> tuple[list[dict], str]:
        pods, self.pods = self.pods, []
        return pods, "1"


def test_a_node_manager_keeps_a_page_of_bytes_not_the_pods_environments():
    source = Source()
    cache = NodePodCache(source, NODE, lambda pod: None)

    def keep(pods: list[dict]) -> None:
        source.pods = pods[:6]
        cache.relist()  # six through the LIST
        for pod in pods[6:]:
            cache.apply("ADDED", pod)  # six through the watch

    held = retained(keep)
    snapshot = cache.snapshot()
    assert snapshot is not None and len(snapshot.pods) == 12
    assert held < len(HEAVY), held  # twelve pods held whole were about 12 x 6 MiB decoded


def test_the_extender_keeps_the_unbound_and_seen_pods_without_their_bulk():
    mirror = PodMirror()

    def keep(pods: list[dict]) -> None:
        for pod in pods:
            mirror.set_unbound(pod["metadata"]["uid"], pod)
            mirror.saw(pod["metadata"]["uid"], pod)

    held = retained(keep)
    assert mirror.unbound("heavy-0") is not None and mirror.seen("heavy-11") is not None
    assert held < len(HEAVY), held


def test_the_node_managers_list_is_paged_and_keeps_only_what_it_reads():
    """The manager's LIST of its node's pods (node/kube_client.py) reads a page at a time under
    kube/paging.py's cap; a page past it is asked again with fewer items."""
    from kubernetes import client as kube

    from qgpu_runtime.kube.paging import LIST_PAGE_BYTES
    from qgpu_runtime.node.kube_client import KubePodSource
    from tests.webhook.test_claim_quota_serving import Response, page

    pods = [heavy(i) for i in range(6)] + [kept(heavy(i)) for i in range(6, 250)]
    answered: list[Response] = []

    class Core:
        def list_pod_for_all_namespaces(self, **kwargs):
            assert kwargs["field_selector"] == f"spec.nodeName={NODE}"
            answered.append(page(pods, **{k: v for k, v in kwargs.items() if k in ("limit", "_continue")}))
            return answered[-1]

    from qgpu_runtime.kube.reader import ApiCaller

    source = KubePodSource.__new__(KubePodSource)  # the constructor needs a kubeconfig: the parts used, set here
    source._calls = ApiCaller(kube.ApiClient(), timeout=(1, 1), attempts=1)
    source._core = Core()
    source._timeout = (1, 1)
    listed, _ = source.list_pods_on_node(NODE)
    assert [p["metadata"]["uid"] for p in listed] == [p["metadata"]["uid"] for p in pods]
    assert all("env" not in p["spec"]["containers"][0] for p in listed)
    assert len(answered) > 3 and any(len(r.data) > LIST_PAGE_BYTES for r in answered)
    assert all(r.closed for r in answered if len(r.data) > LIST_PAGE_BYTES)


def test_the_extenders_list_is_paged_and_keeps_pods_without_their_bulk():
    """The extender's LIST of every live pod (extender/watch.py) reads a page at a time under
    kube/paging.py's cap and keeps each pod as kept() leaves it until the cache takes them."""
    from kubernetes import client as kube

    from qgpu_runtime.extender.watch import CacheFeeder
    from qgpu_runtime.kube.paging import LIST_PAGE_BYTES
    from tests.extender.test_kube_cache import cache
    from tests.webhook.test_claim_quota_serving import Response, page

    pods = [heavy(i) for i in range(6)] + [kept(heavy(i)) for i in range(6, 250)]
    for p in pods:
        p["metadata"]["namespace"] = "t"
    answered: list[Response] = []
    replaced: list[list[dict]] = []

    def list_pods(**kwargs):
        assert kwargs["field_selector"] == "status.phase!=Succeeded,status.phase!=Failed"
        answered.append(page(pods, **{k: v for k, v in kwargs.items() if k in ("limit", "_continue")}))
        return answered[-1]

    feeder = CacheFeeder(kube.CoreV1Api(kube.ApiClient()), cache(), policy_api=kube.PolicyV1Api(kube.ApiClient()))
    (kind,) = [k for k in feeder.kinds if k.name == "pods"]
    kind.list_call = list_pods
    kind.replace = replaced.append
    feeder._list(kind)
    (listed,) = replaced
    assert [p["metadata"]["uid"] for p in listed] == [p["metadata"]["uid"] for p in pods]
    assert all("env" not in p["spec"]["containers"][0] for p in listed)
    assert len(answered) > 3 and all(r.closed for r in answered if len(r.data) > LIST_PAGE_BYTES)
