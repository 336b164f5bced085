"""What the extender and the node manager keep of a pod (kube/podslim.py): not the bulk a tenant
controls and no qgpu component reads, so a few dozen pods near etcd's object limit no longer run
either out of memory."""

from __future__ import annotations

import copy
import gc
import json
import tracemalloc

from qgpu_runtime.extender.podmirror import PodMirror
from qgpu_runtime.kube.podslim import CONTAINER_FIELDS, KEPT_ANNOTATIONS, MAX_KEPT_LABELS, kept
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
    assert container.keys() <= CONTAINER_FIELDS
    assert container == {"name": "c", "resources": pod["spec"]["containers"][0]["resources"]}
    assert slim["spec"]["initContainers"] == [{"name": "i", "resources": {}}]
    assert "volumes" not in slim["spec"] and "managedFields" not in slim["metadata"]
    for field in ("name", "namespace", "uid", "resourceVersion", "labels", "annotations"):
        assert slim["metadata"][field] == pod["metadata"][field]
    assert slim["status"] == pod["status"]
    assert (slim["spec"]["nodeName"], slim["spec"]["schedulerName"]) == (NODE, "qgpu")
    assert parse_pod(slim) == parse_pod(pod)  # the request is read the same
    assert len(json.dumps(slim)) < 2000 < len(HEAVY)


def test_a_pod_with_nothing_to_drop_is_kept_as_it_is_and_each_unread_part_alone_is_dropped():
    slim = kept(heavy(0))
    assert kept(slim) is slim  # kept already: compared on every call, not copied again
    bare = {"metadata": {"name": "p", "labels": {"a": "b"}, "annotations": {"qgpu.io/gpu-model": "T4"}},
            "spec": {"containers": [{"name": "c", "resources": {}}]}, "status": {"phase": "Pending"}}
    assert kept(bare) is bare
    one_each = [
        {"metadata": {"name": "p", "managedFields": [{}]}},
        {"metadata": {"name": "p", "ownerReferences": [{}], "finalizers": ["x"]}},
        {"metadata": {"name": "p", "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}}},
        {"spec": {"volumes": [{"name": "v"}]}},
        {"spec": {"tolerations": [{"key": "k"}] * 3, "hostAliases": [{"ip": "1.2.3.4"}], "affinity": {}}},
        {"spec": {"topologySpreadConstraints": [{}], "readinessGates": [{}], "imagePullSecrets": [{}]}},
        {"spec": {"containers": [{"name": "c", "env": [{"name": "A"}]}]}},
        {"spec": {"containers": [{"name": "c", "image": "i", "ports": [{"containerPort": 1}]}]}},
        {"spec": {"initContainers": [{"name": "c", "args": ["x"], "restartPolicy": "Always"}]}},
        {"spec": {"ephemeralContainers": [{"name": "c", "startupProbe": {}}]}},
        {"status": {"phase": "Running", "conditions": [{}], "podIPs": [{}]}},
        {"metadata": {"name": "p"}, "extra": 1},
    ]
    for pod in one_each:
        before = copy.deepcopy(pod)
        out = kept(pod)
        assert out is not pod and pod == before, pod
        assert out != pod and kept(out) is out, pod
    assert kept(one_each[8])["spec"]["initContainers"] == [{"name": "c", "restartPolicy": "Always"}]  # a sidecar stays one


def test_only_the_annotations_qgpu_reads_are_kept():
    notes = {k: "v" for k in KEPT_ANNOTATIONS} | {f"tenant.example/{i}": "x" * 60 for i in range(2000)}
    slim = kept({"metadata": {"name": "p", "annotations": notes}})
    assert slim["metadata"]["annotations"] == {k: "v" for k in KEPT_ANNOTATIONS}
    for key in ("qgpu.io/allocation", "qgpu.io/allocation-signature", "qgpu.io/bind-time", "qgpu.io/assigned",
                "qgpu.io/group-min-member", "qgpu.io/gpu-model", "tke.cloud.tencent.com/app-class",
                "nvidia.com/use-gputype", "nvidia.com/nouse-gputype", "gpu-fraction", "gpu-memory"):
        assert key in KEPT_ANNOTATIONS, key


def test_labels_are_kept_whole_up_to_the_bound_and_past_it_only_the_group_label():
    group = "scheduler.tensorstack.dev/group-name"
    labels = {f"l{i}": "v" for i in range(MAX_KEPT_LABELS - 1)} | {group: "g"}
    pod = {"metadata": {"name": "p", "labels": labels}}
    assert kept(pod)["metadata"]["labels"] == labels  # at the bound: whole (a budget may name any key)
    many = {"metadata": {"name": "p", "labels": labels | {"one-more": "v"}}}
    assert kept(many)["metadata"]["labels"] == {group: "g"}
    prefix = ("a" * 60 + ".") * 4  # a DNS-subdomain key prefix, as long as one may be
    long = {"metadata": {"name": "p", "labels": {f"{prefix}/k{i}": "v" * 63 for i in range(MAX_KEPT_LABELS - 8)}}}
    assert len(long["metadata"]["labels"]) < MAX_KEPT_LABELS and kept(long)["metadata"]["labels"] == {}
    # a tenant's 1.4 MiB of labels is a few bytes kept
    huge = {"metadata": {"name": "p", "labels": {f"tenant.example/k{i:06d}": "v" * 60 for i in range(16_000)}}}
    assert len(json.dumps(huge)) > 1_300_000 and kept(huge)["metadata"]["labels"] == {}


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
    # what is derived may hold the pod it is derived from (the device plugin's match does): it is
    # given the kept pod, through the watch as through the LIST
    cache = NodePodCache(source, NODE, lambda pod: pod)

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


def labelled(i: int) -> dict:
    """A bound pod carrying ~1.3 MiB of labels (no bound but etcd's object size on their count)."""
    return {"metadata": {"name": f"l-{i}", "namespace": "t", "uid": f"l-{i}", "resourceVersion": "1",
                         "labels": {f"tenant.example/k{j:06d}": "v" * 60 for j in range(16_000)}},
            "spec": {"nodeName": NODE, "containers": [{"name": "c", "resources": {}}]}, "status": {"phase": "Running"}}


def test_the_extender_cache_keeps_what_it_reads_of_every_live_pod_not_its_labels_past_the_bound():
    """Every live pod's labels went into the cache's entry (PodDisruptionBudget matching), from
    the watch's whole pod: twelve label-heavy bound pods held 26 MB (18 KB now)."""
    from tests.extender.test_kube_cache import cache

    c = cache()

    def keep(pods: list[dict]) -> None:
        for i, p in enumerate(pods):
            c.apply_pod("ADDED", labelled(i) if i % 2 else p)

    held = retained(keep)
    assert c._pods.entry("t/l-1").labels == () and c._pods.entry("t/l-1").node_name == NODE
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


def test_a_groups_members_are_listed_a_page_at_a_time_and_kept_slim():
    """The binder's LIST of a T9k group's live members (extender/podapi.py) was one answer decoded
    whole: 64 tenant pods near etcd's limit. It now reads pages under kube/paging.py's cap, keeps
    each member as kept() leaves it, and asks no more than one past the limit."""

    from qgpu_runtime.extender.podapi import PodApi
    from qgpu_runtime.kube.paging import LIST_PAGE_BYTES
    from tests.webhook.test_claim_quota_serving import Response, page

    members = [heavy(i) for i in range(8)]
    asked: list[dict] = []
    answered: list[Response] = []

    class Core:
        def list_namespaced_pod(self, namespace, **kwargs):
            assert namespace == "t" and kwargs["label_selector"] == "g=1"
            asked.append(kwargs)
            answered.append(page(members, **{k: v for k, v in kwargs.items() if k in ("limit", "_continue")}))
            return answered[-1]

    api = PodApi.__new__(PodApi)  # the constructor builds the Binding's client: the parts used, set here
    api.api, api.timeout, api.attempts = Core(), (1, 1), 1
    listed, more = api.list_live("t", "g=1", 64)
    assert (len(listed), more) == (8, False)
    assert [p["metadata"]["name"] for p in listed] == [f"heavy-{i}" for i in range(8)]
    assert all("env" not in p["spec"]["containers"][0] for p in listed)
    assert asked[0]["limit"] == 65 and any(len(r.data) > LIST_PAGE_BYTES for r in answered)
    assert all(r.closed for r in answered if len(r.data) > LIST_PAGE_BYTES)

    asked.clear()
    listed, more = api.list_live("t", "g=1", 5)
    assert (len(listed), more) == (5, True) and asked[0]["limit"] == 6
