"""Preemption under the real kube-scheduler (issue 25 §1, §2): kube-scheduler wired with the preempt
verb, qGPU's node resources checked at node level (ignoredByScheduler: false, as the roles wire
them), so its own dry run finds victims and asks the extender which ones, by card.

No kubelet and no controller-manager run here: the pods have terminationGracePeriodSeconds 0, so
kube-scheduler's deletion of a victim is final at once; a victim still Terminating after a moment is
deleted with grace 0, as its kubelet would once the containers stopped."""

from __future__ import annotations

from kubernetes import client

from tests.k8s.kubeobjects import MANAGED_RESOURCES, bound, cards, gpu_node, gpu_pod, list_pods, read_pod, record, wait_for

QGPU_CORE = "tke.cloud.tencent.com/qgpu-core"
QGPU_MEMORY = "tke.cloud.tencent.com/qgpu-memory"
QGPU_CORE_GREEDY = "tke.cloud.tencent.com/qgpu-core-greedy"
NODE_RESOURCES = (QGPU_CORE, QGPU_MEMORY, QGPU_CORE_GREEDY)
OFFLINE = {"tke.cloud.tencent.com/app-class": "offline"}


def _scheduler_with_preemption(cluster) -> None:
    entry = cluster.extender.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s")
    entry["preemptVerb"] = "preempt"
    for resource in entry["managedResources"]:  # what the node manager advertises (the roles' default)
        resource["ignoredByScheduler"] = resource["name"] not in NODE_RESOURCES
    cluster.cp.start_scheduler([entry])


def _priority_classes(cluster, ns: str, values: dict[str, int]) -> list[str]:
    api = client.SchedulingV1Api(cluster.api_client)
    names = []
    for name, value in values.items():
        full = f"{ns}-{name}"
        api.create_priority_class({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                   "metadata": {"name": full}, "value": value, "preemptionPolicy": "PreemptLowerPriority"})
        names.append(full)
    return names


def _finalize_terminating(cluster, ns: str) -> None:
    """What a kubelet does once a deleted pod's containers stopped: the final, grace-0 delete."""
    for p in list_pods(cluster.api, ns):
        if p["metadata"].get("deletionTimestamp"):
            try:
                cluster.api.delete_namespaced_pod(p["metadata"]["name"], ns, grace_period_seconds=0)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise


def test_the_fewest_offline_pods_of_one_card_are_evicted_where_node_level_arithmetic_would_split_them(cluster, ns, label):
    """Two cards of 32 GiB, four offline pods of 50 % and 16 GiB (two per card). A pod of higher
    priority asking 60 % and 20 GiB arrives: at node level qgpu-memory is short (64 + 20 > 64 GiB;
    the offline pods' compute is qgpu-core-greedy, another node total). kube-scheduler's reprieve
    (highest priority first) would keep f0 and f2 and evict f1 and f3, one per card, which leaves
    no card with 60 % free; qgpu names the two pods of one card, the card whose most valuable pod
    has the lower priority, and the pod runs on that card."""
    node = f"{ns}-a"
    _scheduler_with_preemption(cluster)
    classes = []
    try:
        classes = _priority_classes(cluster, ns, {"p0": 1000, "p1": 1001, "p2": 1002, "p3": 1003, "high": 100000})
        gpu_node(cluster.api, node, cards(2, node=node), {**label, "mixed-qgpu-enable": "enable"})
        resources = {"cpu": "64", "memory": "512Gi", "pods": "250", QGPU_CORE: "200", QGPU_MEMORY: "64",
                     QGPU_CORE_GREEDY: "200"}
        cluster.api.patch_node_status(node, {"status": {"capacity": resources, "allocatable": resources}})
        # f0 and f1 share one card, f2 and f3 the other (binpack fills a card before the next)
        for name, klass in (("f0", "p3"), ("f1", "p1"), ("f2", "p2"), ("f3", "p0")):
            pod = gpu_pod(name, {QGPU_CORE_GREEDY: 50, QGPU_MEMORY: 16}, selector=label, annotations=OFFLINE)
            pod["spec"]["priorityClassName"] = f"{ns}-{klass}"
            cluster.api.create_namespaced_pod(ns, pod)
            bound(cluster.api, ns, name)
        card = {p["metadata"]["name"]: record(p).containers[0].shares[0].index for p in list_pods(cluster.api, ns)}
        assert card["f0"] == card["f1"] != card["f2"] == card["f3"], card

        high = gpu_pod("high", {QGPU_CORE: 60, QGPU_MEMORY: 20}, selector=label)
        high["spec"]["priorityClassName"] = f"{ns}-high"
        cluster.api.create_namespaced_pod(ns, high)

        def placed():
            _finalize_terminating(cluster, ns)
            p = read_pod(cluster.api, ns, "high")
            return p if p["spec"].get("nodeName") else None

        pod = wait_for("the high-priority pod bound after preemption", placed, timeout=120)
        left = {p["metadata"]["name"] for p in list_pods(cluster.api, ns) if not p["metadata"].get("deletionTimestamp")}
        assert left == {"f0", "f1", "high"}, left  # f2 and f3 evicted, nothing else
        (share,) = record(pod).containers[0].shares
        assert share.index == card["f2"] and share.core_milli == 600
        assert cluster.extender.requests_by_verb().get("preempt", 0) >= 1  # the extender chose, not kube-scheduler alone
    finally:
        for name in classes:
            client.SchedulingV1Api(cluster.api_client).delete_priority_class(name)
        cluster.cp.start_scheduler(cluster.scheduler_extenders())
