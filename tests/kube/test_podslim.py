"""What the extender and the node manager keep of a pod (kube/podslim.py): not the bulk a tenant
controls and no qgpu component reads, so a few dozen pods near etcd's object limit no longer run
either out of memory."""

from __future__ import annotations

import copy
import gc
import json
import tracemalloc

import pytest

from qgpu_runtime.extender.podmirror import PodMirror
from qgpu_runtime.kube.podslim import (
    CONTAINER_FIELDS,
    KEPT_ANNOTATIONS,
    MAX_KEPT_LABELS,
    MAX_KEPT_POD_ENTRIES,
    MAX_KEPT_UNKNOWN_QGPU_NAMES,
    MIRROR_ANNOTATION,
    OVERSIZED,
    Oversize,
    kept,
    oversized,
)
from qgpu_runtime.model.requests import RequestError, parse_pod, pod_compute
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
        {"spec": {"containers": [{"name": "c", "resources": {"limits": {"cpu": "1", "example.com/foo": "1"}}}]}},
        {"spec": {"initContainers": [{"name": "c", "resources": {"requests": {"ephemeral-storage": "1Gi"}}}]}},
        {"spec": {"resources": {"limits": {"hugepages-2Mi": "2Mi"}}, "overhead": {"cpu": "1", "example.com/x": "1"}}},
        {"spec": {"resourceClaims": [{"name": "g", "resourceClaimName": "c", "x": 1}]}},
        {"spec": {"containers": [{"name": "c", "resources": {"claims": [{"name": "g", "x": 1}]}}]}},
        {"status": {"containerStatuses": [{"name": "c", "containerID": "x", "state": {}}]}},
        {"status": {"resourceClaimStatuses": [{"name": "g", "resourceClaimName": "c", "x": 1}]}},
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


# --- resources: only the names a reader reads ---------------------------------------------------

def _extended(size: int) -> dict[str, str]:
    """Extended resource names of ``size`` bytes of JSON, as a tenant may list them (`1a/r: "1"`)."""
    names, n, total = {}, 0, 0
    while total < size:
        key = f"{n:x}/r"
        names[key] = "1"
        n, total = n + 1, total + len(key) + 6
    return names


def _measured(body: bytes, copies: int = 3) -> tuple[list[dict], float]:
    """``copies`` pods decoded afresh from ``body`` and kept, and the bytes each holds."""
    gc.collect()
    tracemalloc.start()
    try:
        held = [kept(json.loads(body)) for _ in range(copies)]
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return held, current / copies


def test_a_pod_of_tens_of_thousands_of_extended_resources_is_kept_in_a_few_hundred_bytes():
    """A pod asking no GPU with ~50k extended resources in its limits (requests defaulted from
    them) is ~1.4 MB in etcd and never fits a node, so it stays unbound and the extender keeps it:
    kept whole in its resources it held 6.3 MiB, and ~130 of them ran the 800 Mi extender out of
    memory."""
    names = _extended(650_000)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "big", "namespace": "t", "uid": "u", "resourceVersion": "1"},
           "spec": {"containers": [{"name": "c", "image": "busybox", "resources": {
               "limits": names | {"cpu": "1", "memory": "1Gi"}, "requests": names | {"cpu": "500m", "memory": "1Gi"}}}]},
           "status": {"phase": "Pending"}}
    body = json.dumps(pod, separators=(",", ":")).encode()
    assert 1_300_000 < len(body) < 1_500_000 and len(names) > 45_000
    held, per_pod = _measured(body)
    slim = held[0]
    assert slim["spec"]["containers"][0]["resources"] == {"limits": {"cpu": "1", "memory": "1Gi"},
                                                          "requests": {"cpu": "500m", "memory": "1Gi"}}
    assert len(json.dumps(slim)) < 400 and per_pod < 16 * 1024, per_pod
    assert kept(slim) is slim
    assert parse_pod(slim) == parse_pod(pod) and pod_compute(slim) == pod_compute(pod) == (500, 1024)

    mirror = PodMirror()
    gc.collect()
    tracemalloc.start()
    try:
        for i in range(8):  # as the watch delivers each unbound pod: decoded afresh
            mirror.set_unbound(f"u{i}", json.loads(body))
        gc.collect()
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert mirror.unbound("u7") is not None and current < 8 * 16 * 1024, current


EXTRA = {"ephemeral-storage": "1Gi", "hugepages-2Mi": "2Mi", "example.com/foo": "3", "1a/r": "1",
         "tke.cloud.tencent.com/app-class": "1"}  # not a resource of the prefix: an annotation's name
"""Resource names no reader of qgpu reads, beside those it does."""
COMPUTE = {"cpu": "250m", "memory": "512Mi"}

DIALECT_PODS = {
    "qgpu": ({"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "4"}, {}, None),
    "qgpu-online": ({"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "4"},
                    {"tke.cloud.tencent.com/app-class": "online"}, None),
    "qgpu-greedy": ({"tke.cloud.tencent.com/qgpu-core-greedy": "50", "tke.cloud.tencent.com/qgpu-memory": "2"},
                    {"tke.cloud.tencent.com/app-class": "offline"}, None),
    "vcuda": ({"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "8"}, {}, None),
    "t9k": ({"tensorstack.dev/nvidia-gpu": "2"}, {}, None),
    "t9k-percent": ({"tensorstack.dev/nvidia-gpu-percent": "50"}, {}, None),
    "t9k-node": ({"tensorstack.dev/nvidia-gpu-node": "1"}, {}, None),
    "nvidia": ({"nvidia.com/gpu": "2"}, {"qgpu.io/gpu-model": "A100|H100"}, None),
    "hami": ({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30"},
             {"nvidia.com/use-gputype": "A100", "nvidia.com/nouse-gputype": "T4"}, None),
    "hami-percent": ({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "25"}, {}, None),
    "kai": ({}, {"gpu-fraction": "0.5", "gpu-fraction-container-name": "main"}, "kai-scheduler"),
    "kai-memory": ({"nvidia.com/gpu": "2"}, {"gpu-memory": "2048", "gpu-fraction-num-devices": "2"}, "kai-scheduler"),
    "nano": ({"nano-gpu/gpu-percent": "20"}, {}, None),
    "nano-core": ({"nano-gpu.io/gpu-core": "20", "nano-gpu.io/gpu-memory": "2"}, {}, None),
    "elastic": ({"elasticgpu.io/gpu-core": "30", "elasticgpu.io/gpu-memory": "4"}, {}, None),
    # refused pods are refused alike, naming the same problems
    "unknown-qgpu": ({"tke.cloud.tencent.com/qgpu-cores": "30", "tke.cloud.tencent.com/qgpu-memory": "4"}, {}, None),
    "mixed": ({"nvidia.com/gpu": "1", "tencent.com/vcuda-core": "50"}, {}, None),
    "online-nvidia": ({"nvidia.com/gpu": "1"}, {"tke.cloud.tencent.com/app-class": "online"}, None),
    "no-gpu": ({}, {}, None),
}


def _dialect_pod(asked: dict[str, str], notes: dict[str, str], scheduler: str | None, *, unequal: bool = False) -> dict:
    requests = dict(asked) | COMPUTE | EXTRA
    if unequal and asked:  # requests must equal limits for GPU resources
        requests[next(iter(asked))] = "7"
    spec = {
        "containers": [
            {"name": "main", "image": "i", "env": [{"name": "A", "value": "b"}],
             "resources": {"limits": dict(asked) | COMPUTE | EXTRA, "requests": requests}},
            {"name": "helper", "image": "i", "resources": {"limits": {"memory": "64Mi"} | EXTRA}},
        ],
        "initContainers": [
            {"name": "sidecar", "image": "i", "restartPolicy": "Always", "resources": {"requests": {"cpu": "2"} | EXTRA}},
            {"name": "setup", "image": "i", "resources": {"limits": {"cpu": "4", "memory": "1Gi", "example.com/foo": "1"}}},
        ],
        "resources": {"limits": {"cpu": "8", "memory": "8Gi", "hugepages-2Mi": "2Mi"}},
        "overhead": {"cpu": "100m", "memory": "64Mi", "example.com/foo": "1"},
    }
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"metadata": {"name": "p", "namespace": "t", "uid": "u", "annotations": {**notes, "tenant.example/x": "y"}},
            "spec": spec, "status": {"phase": "Pending"}}


def _read(pod: dict):
    try:
        return parse_pod(pod)
    except RequestError as exc:
        return exc.problems


def _resource_names_kept(pod: dict) -> set[str]:
    spec = pod["spec"]
    maps = [spec.get("overhead") or {}, *(spec.get("resources") or {}).values()]
    for c in [*spec.get("containers", []), *spec.get("initContainers", [])]:
        maps += [(c.get("resources") or {}).get(side) or {} for side in ("limits", "requests")]
    return {name for m in maps for name in m}


@pytest.mark.parametrize("unequal", [False, True], ids=["", "requests-differ"])
@pytest.mark.parametrize("dialect", sorted(DIALECT_PODS))
def test_the_request_parser_reads_the_kept_form_as_the_whole_pod_for_every_dialect(dialect, unequal):
    """The kept pod keeps of each resources map only cpu, memory and the GPU names of the parser's
    dialects: what it reads of the pod (its GPU request, or every problem of a refused one, and
    the CPU and memory node fit counts) is what it reads of the whole pod."""
    pod = _dialect_pod(*DIALECT_PODS[dialect], unequal=unequal)
    slim = kept(pod)
    assert _read(slim) == _read(pod)
    assert pod_compute(slim) == pod_compute(pod)
    assert kept(slim) is slim
    assert not _resource_names_kept(slim) & (EXTRA.keys() - DIALECT_PODS[dialect][0].keys())
    assert _resource_names_kept(slim) >= {"cpu", "memory", *DIALECT_PODS[dialect][0]}
    if dialect in ("qgpu", "vcuda", "t9k", "nvidia", "hami", "kai", "elastic") and not unequal:
        assert parse_pod(slim).wants_gpu, dialect


def test_a_pod_of_many_unknown_qgpu_names_is_refused_from_the_kept_form_with_the_first_of_its_problems():
    """A name of the qGPU prefix the parser does not know is a problem it reports, so those names
    are kept, but only the first few of a container's (in the parser's order): a pod of 20,000 of
    them is refused from the kept form too, naming the first of them."""
    unknown = {f"tke.cloud.tencent.com/qgpu-x{i:05d}": "1" for i in range(20_000)}
    pod = {"metadata": {"name": "p", "namespace": "t", "uid": "u"},
           "spec": {"containers": [{"name": "c", "resources": {"limits": unknown | {"tke.cloud.tencent.com/qgpu-core": "30"},
                                                               "requests": dict(unknown)}}],
                    "initContainers": [{"name": "i", "resources": {"limits": dict(unknown)}}]}}
    slim = kept(pod)
    assert len(json.dumps(slim)) < 4000
    with pytest.raises(RequestError) as whole:
        parse_pod(pod)
    with pytest.raises(RequestError) as small:
        parse_pod(slim)
    of_c = [p for p in whole.value.problems if p.container == "c"]
    unknown_problems = [p for p in of_c if p.rule.startswith("unknown qGPU resource")]
    assert len(unknown_problems) == 20_000 and unknown_problems[0].resource == "tke.cloud.tencent.com/qgpu-x00000"
    rest = [p for p in of_c if not p.rule.startswith("unknown qGPU resource")]  # the known names' own (qgpu-core without memory)
    assert [p for p in small.value.problems if p.container == "c"] == unknown_problems[:MAX_KEPT_UNKNOWN_QGPU_NAMES] + rest
    assert {p.container for p in small.value.problems} == {"c", "i"}  # the init container's GPU names too
    assert kept(slim) is slim


# --- claims, statuses, owners --------------------------------------------------------------------

def test_claims_keep_the_fields_read_and_a_containers_references_are_bounded_to_the_whole_claims():
    from qgpu_runtime.node.tenants import tenants_of
    from tests.node.test_tenants import _claim, _row

    rows = [_row("c1", "multi", "train", 0, 300), _row("c1", "multi", "infer", 1, 200)]
    pod = {"metadata": {"uid": "p1", "name": "p", "namespace": "ns"},
           "spec": {"resourceClaims": [{"name": "g", "resourceClaimName": "multi", "tenant": "x" * 1000}],
                    "containers": [{"name": "a", "resources": {"claims": [{"name": "g", "request": "train", "x": "y" * 1000}]}},
                                   {"name": "b", "resources": {"claims": [{"name": "g", "request": "infer"}]}}]},
           "status": {"resourceClaimStatuses": [{"name": "g", "resourceClaimName": "multi", "extra": "z" * 1000}]}}
    slim = kept(pod)
    assert slim["spec"]["resourceClaims"] == [{"name": "g", "resourceClaimName": "multi"}]
    assert slim["spec"]["containers"][0]["resources"]["claims"] == [{"name": "g", "request": "train"}]
    assert slim["status"]["resourceClaimStatuses"] == [{"name": "g", "resourceClaimName": "multi"}]
    assert tenants_of(rows, [_claim("c1", "multi")], {"p1": slim}) == tenants_of(rows, [_claim("c1", "multi")], {"p1": pod})

    # tens of thousands of references of one container (the apiserver checks no request name
    # against the claim): past the bound one reference per claim, the whole of it, never less
    many = [{"name": "g", "request": f"r{i}"} for i in range(40_000)] + [{"name": "g", "request": "train"}]
    pod["spec"]["containers"][0]["resources"]["claims"] = many
    slim = kept(pod)
    assert slim["spec"]["containers"][0]["resources"]["claims"] == [{"name": "g"}] and kept(slim) is slim
    assert len(json.dumps(slim)) < 1000 < 1_000_000 < len(json.dumps(pod))
    whole = tenants_of(rows, [_claim("c1", "multi")], {"p1": pod})
    (reached,) = [w for ref, w in tenants_of(rows, [_claim("c1", "multi")], {"p1": slim}).values()
                  if "a" in ref.container.split("+")]
    assert {q.index for _, w in whole.values() for q in w.cards} <= {q.index for q in reached.cards}
    # a name or request longer than a DNS label is none the apiserver accepts
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "g", "request": "r" * 64}, {"name": "g"}]
    assert kept(pod)["spec"]["containers"][0]["resources"]["claims"] == [{"name": "g"}]


def test_a_containers_status_keeps_which_container_a_runtime_id_is():
    """node/metrics.py and node/containers.py read a status's name and container ID; its state,
    image, resources (the kubelet copies the container's requests there) are not kept."""
    status = {"name": "c", "containerID": "containerd://abc", "image": "i", "imageID": "sha256:x", "ready": True,
              "state": {"terminated": {"message": "m" * 4096}}, "allocatedResources": _extended(10_000),
              "resources": {"limits": _extended(10_000)}, "volumeMounts": [{"name": "v", "mountPath": "/v"}]}
    pod = {"metadata": {"name": "p"}, "status": {"phase": "Running", "containerStatuses": [status],
                                                  "initContainerStatuses": [dict(status, name="i")]}}
    slim = kept(pod)
    assert slim["status"] == {"phase": "Running", "containerStatuses": [{"name": "c", "containerID": "containerd://abc"}],
                              "initContainerStatuses": [{"name": "i", "containerID": "containerd://abc"}]}
    assert kept(slim) is slim


def test_a_mirror_pods_annotation_and_node_owner_are_kept():
    """A static pod's mirror carries ``kubernetes.io/config.mirror`` and one owner reference, to
    its Node: both are kept (a reader tells mirror pods by them). Other owners are not, and a
    tenant's copies of either are bounded."""
    node_owner = {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "n-uid", "controller": True}
    mirror = {"metadata": {"name": f"etcd-{NODE}", "namespace": "kube-system", "ownerReferences": [node_owner],
                           "annotations": {"kubernetes.io/config.mirror": "0123456789abcdef0123456789abcdef",
                                           "kubernetes.io/config.hash": "0123456789abcdef0123456789abcdef",
                                           "kubernetes.io/config.source": "file"}},
              "spec": {"nodeName": NODE, "containers": [{"name": "etcd", "resources": {}}]}}
    slim = kept(mirror)
    assert slim["metadata"]["ownerReferences"] == [node_owner]
    assert slim["metadata"]["annotations"] == {"kubernetes.io/config.mirror": "0123456789abcdef0123456789abcdef"}
    assert MIRROR_ANNOTATION == "kubernetes.io/config.mirror" and kept(slim) is slim

    many = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "r"}] + \
        [dict(node_owner, name=f"n{i}", extra="x" * 100) for i in range(10_000)]
    tenant = {"metadata": {"name": "p", "ownerReferences": many, "annotations": {"kubernetes.io/config.mirror": "x" * 200_000}}}
    slim = kept(tenant)
    assert slim["metadata"]["ownerReferences"] == [dict(node_owner, name="n0"), dict(node_owner, name="n1")]
    assert slim["metadata"]["annotations"] == {"kubernetes.io/config.mirror": ""}  # present: what is read of it
    assert len(json.dumps(slim)) < 1000 and kept(slim) is slim
    assert "ownerReferences" not in kept({"metadata": {"name": "p", "ownerReferences": many[:1]}})["metadata"]


# --- how many entries: a budget per pod ----------------------------------------------------------

def _pod_of(spec: dict, status: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "big", "namespace": "t", "uid": "u", "resourceVersion": "1",
                         "annotations": {"qgpu.io/gpu-model": "T4"}, "labels": {"app": "x"}},
            "spec": {"nodeName": NODE, "schedulerName": "qgpu", "priority": 7, **spec},
            "status": status or {"phase": "Pending"}}


def _claim_entries(n: int) -> dict:
    return {"containers": [{"name": "c", "image": "i"}],
            "resourceClaims": [{"name": f"c{i}", "resourceClaimName": f"claim-{i}"} for i in range(n)]}


def _cpu_containers(n: int) -> dict:
    return {"containers": [{"name": f"c{i}", "image": "i", "resources": {"requests": {"cpu": "1m"}, "limits": {"cpu": "1m"}}}
                           for i in range(n)]}


@pytest.mark.parametrize("spec, field, count, entries", [
    (_claim_entries(30_000), "spec.resourceClaims", 30_000, 30_001),
    (_cpu_containers(5_000), "spec.containers", 5_000, 15_000),  # each: itself, cpu in limits and requests
], ids=["30000-claim-entries", "5000-containers"])
def test_a_pod_of_tens_of_thousands_of_claims_or_thousands_of_containers_is_kept_oversized_in_a_few_kilobytes(
        spec, field, count, entries):
    """Each entry bounded, not their number: 30,000 ``spec.resourceClaims`` entries (1.5 MB of JSON)
    were kept as 8.8 MiB and 5,000 containers asking ``cpu: 1m`` as 4.3 MiB, each read by the
    extender, so a few hundred such unbound pods ran it out of memory. Past MAX_KEPT_POD_ENTRIES the
    pod is kept oversized: what qgpu reads of it without its lists, and why."""
    pod = _pod_of(spec)
    body = json.dumps(pod, separators=(",", ":")).encode()
    assert len(body) > 400_000
    held, per_pod = _measured(body)
    slim = held[0]
    assert per_pod < 16 * 1024, per_pod  # 8.8 MiB and 4.3 MiB before
    assert len(json.dumps(slim)) < 600 and kept(slim) is slim
    assert oversized(pod) == oversized(slim) == Oversize(field, count, entries, ())
    assert slim["metadata"] == kept(pod)["metadata"] == {k: pod["metadata"][k] for k in
                                                         ("name", "namespace", "uid", "resourceVersion", "annotations", "labels")}
    assert {k: slim["spec"][k] for k in ("nodeName", "schedulerName", "priority")} == {"nodeName": NODE, "schedulerName": "qgpu",
                                                                                       "priority": 7}
    assert not slim["spec"].keys() & {"containers", "initContainers", "resourceClaims", "overhead"}
    assert pod_compute(slim) == pod_compute(pod)  # node fit reads the same CPU and memory
    assert f"{count} {field} ({entries} entries" in oversized(pod).describe()
    assert str(MAX_KEPT_POD_ENTRIES) in oversized(pod).describe()


def test_a_pod_at_the_budget_is_kept_whole_and_one_entry_more_is_kept_oversized():
    """The budget counts the kept form's entries of the spec (containers, init containers, claim
    entries, each container's resource names and claim references) and, apart, of the status; a
    normal pod's kept form does not change, and at the budget a pod costs a few hundred KiB at most."""
    refs = [{"name": "g"}]
    # 1 claim entry + 3 containers of 1 + 2 names + 1 reference + init containers of 1 each
    spec = {"resourceClaims": [{"name": "g", "resourceClaimName": "x"}],
            "containers": [{"name": f"c{i}", "resources": {"limits": {"cpu": "1"}, "requests": {"cpu": "1"}, "claims": refs}}
                           for i in range(3)],
            "initContainers": [{"name": f"i{i}"} for i in range(MAX_KEPT_POD_ENTRIES - 1 - 3 * 4)]}
    at = _pod_of(spec)
    assert kept(at)["spec"]["initContainers"] == spec["initContainers"] and oversized(at) is None
    statuses = [{"name": f"i{i}", "containerID": f"containerd://{i}"} for i in range(MAX_KEPT_POD_ENTRIES)]
    running = _pod_of(spec, {"phase": "Running", "initContainerStatuses": statuses})
    assert oversized(running) is None and kept(kept(running)) is kept(running)

    over = _pod_of({**spec, "initContainers": [*spec["initContainers"], {"name": "one-more"}]})
    assert oversized(over) == Oversize("spec.initContainers", MAX_KEPT_POD_ENTRIES - 12, MAX_KEPT_POD_ENTRIES + 1)
    more_statuses = _pod_of(spec, {"phase": "Running", "initContainerStatuses": [*statuses, {"name": "x"}]})
    assert oversized(more_statuses) == Oversize("status.initContainerStatuses", MAX_KEPT_POD_ENTRIES + 1,
                                                MAX_KEPT_POD_ENTRIES + 1)
    assert kept(more_statuses)["status"] == {"phase": "Running"}

    # the most a pod at the budget keeps: claim entries of the longest names the apiserver takes,
    # and as many container statuses of the longest names
    longest = _pod_of({"resourceClaims": [{"name": f"{i:05d}" + "a" * 58, "resourceClaimName": f"{i:05d}" + "b" * 248}
                                          for i in range(MAX_KEPT_POD_ENTRIES)]},
                      {"phase": "Running", "containerStatuses": [{"name": f"{i:05d}" + "a" * 58, "containerID": "containerd://" + "f" * 64}
                                                                 for i in range(MAX_KEPT_POD_ENTRIES)]})
    assert oversized(longest) is None
    _, per_pod = _measured(json.dumps(longest).encode(), copies=2)
    assert per_pod < 600 * 1024, per_pod


def test_an_oversized_form_keeps_node_fit_and_the_gpu_names_its_containers_list():
    """Node fit (model/requests.py pod_compute: containers, sidecars, the largest init container,
    pod-level resources, overhead) is kept as one pod-level request; the GPU resource names any
    container lists are kept for the node manager's matcher (rule 5)."""
    spec = {"containers": [{"name": f"c{i}", "resources": {"requests": {"cpu": "250m", "memory": "64Mi"},
                                                           "limits": {"nvidia.com/gpu": "1", "example.com/x": "1"}}}
                           for i in range(300)],
            "initContainers": [{"name": "side", "restartPolicy": "Always", "resources": {"requests": {"cpu": "2", "memory": "1Gi"}}},
                               {"name": "setup", "resources": {"requests": {"cpu": "100", "memory": "1Mi"}}},
                               {"name": "t9k", "resources": {"limits": {"tensorstack.dev/nvidia-gpu": "0"}}}],
            "overhead": {"cpu": "100m", "memory": "10Mi"}}
    pod = _pod_of(spec)
    slim = kept(pod)
    assert oversized(pod) == Oversize("spec.containers", 300, 300 * 4 + 3 + 3 + 2, ("nvidia.com/gpu", "tensorstack.dev/nvidia-gpu"))
    assert pod_compute(slim) == pod_compute(pod) == (102_100, 300 * 64 + 1024 + 10)
    assert slim["spec"]["resources"] == {"requests": {"cpu": "102100m", "memory": f"{300 * 64 + 1034}Mi"}}
    with_level = _pod_of({**spec, "resources": {"requests": {"cpu": "3", "memory": "5Gi"}, "limits": {"hugepages-2Mi": "2Mi"}}})
    assert pod_compute(kept(with_level)) == pod_compute(with_level) == (3100, 5 * 1024 + 10)
    assert parse_pod(slim).containers == ()  # its requests are not read from it: every reader asks oversized() first


def test_an_oversized_marker_is_believed_only_as_kept_writes_it():
    """The marker is a top-level key no Pod of the apiserver carries; on a pod that lists what it
    counts, or in any other shape, it is not ours and is dropped (the pod is judged as it is)."""
    small = _pod_of({"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]})
    forged = {**small, OVERSIZED: {"field": "spec.containers", "count": 9, "entries": 9, "gpuResources": []}}
    assert OVERSIZED not in kept(forged) and oversized(forged) is None
    assert kept(forged)["spec"]["containers"] == small["spec"]["containers"]
    bare = {"metadata": {"name": "p"}, "spec": {"nodeName": NODE}}
    for marker in ("x", {"field": "spec.containers"}, {"field": "spec.volumes", "count": 9, "entries": 9, "gpuResources": []},
                   {"field": "f", "count": True, "entries": 9, "gpuResources": []},
                   {"field": "f", "count": 9, "entries": 9, "gpuResources": ["example.com/x"]}):
        assert OVERSIZED not in kept({**bare, OVERSIZED: marker}), marker
    slim = kept(_pod_of(_cpu_containers(600)))
    assert OVERSIZED in slim and kept(slim) is slim and kept(copy.deepcopy(slim)) == slim
    assert kept(json.loads(json.dumps(slim))) == slim  # what the marker says survives a copy
