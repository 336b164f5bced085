"""Preemption under the real kube-scheduler (issue 25 §1, §2): kube-scheduler wired with the preempt
verb, qGPU's node resources checked at node level (ignoredByScheduler: false, as the roles wire
them), so its own dry run finds victims and asks the extender which ones, by card.

No kubelet and no controller-manager run here: the pods have terminationGracePeriodSeconds 0, so
kube-scheduler's deletion of a victim is final at once; a victim still Terminating after a moment is
deleted with grace 0, as its kubelet would once the containers stopped."""

from __future__ import annotations

import time

from kubernetes import client

from tests.k8s.kubeobjects import MANAGED_RESOURCES, bound, cards, gpu_node, gpu_pod, list_pods, read_pod, record, scheduling_failure, wait_for

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


def _full_node(cluster, ns: str, label: dict, fillers: list[tuple[str, str]], n_cards: int = 2,
               offline: bool = True, labels: dict[str, dict[str, str]] | None = None) -> dict[str, int]:
    """One node of ``n_cards`` 32 GiB cards advertising qGPU's node totals, filled with pods of 50 %
    and 16 GiB (name, priority class) in that order, offline (qgpu-core-greedy) unless told; each
    pod's card index. ``labels``: pod name -> its labels."""
    node = f"{ns}-a"
    gpu_node(cluster.api, node, cards(n_cards, node=node), {**label, "mixed-qgpu-enable": "enable"},
             extended={QGPU_CORE: str(100 * n_cards), QGPU_MEMORY: str(32 * n_cards), QGPU_CORE_GREEDY: str(100 * n_cards)})
    for name, klass in fillers:
        pod = gpu_pod(name, {QGPU_CORE_GREEDY if offline else QGPU_CORE: 50, QGPU_MEMORY: 16}, selector=label,
                      annotations=OFFLINE if offline else None)
        pod["spec"]["priorityClassName"] = f"{ns}-{klass}"
        pod["metadata"]["labels"] = (labels or {}).get(name, {})
        cluster.api.create_namespaced_pod(ns, pod)
        bound(cluster.api, ns, name)
    return {p["metadata"]["name"]: record(p).containers[0].shares[0].index for p in list_pods(cluster.api, ns)}


def _create_high(cluster, ns: str, label: dict, limits: dict | None = None) -> None:
    """The preemptor: 60 % and 20 GiB of one card unless told, priority class ``high``."""
    high = gpu_pod("high", limits or {QGPU_CORE: 60, QGPU_MEMORY: 20}, selector=label)
    high["spec"]["priorityClassName"] = f"{ns}-high"
    cluster.api.create_namespaced_pod(ns, high)


def _high_bound(cluster, ns: str) -> dict:
    def placed():
        _finalize_terminating(cluster, ns)
        p = read_pod(cluster.api, ns, "high")
        return p if p["spec"].get("nodeName") else None

    return wait_for("the high-priority pod bound after preemption", placed, timeout=120)


def _left(cluster, ns: str) -> set[str]:
    return {p["metadata"]["name"] for p in list_pods(cluster.api, ns) if not p["metadata"].get("deletionTimestamp")}


def test_the_fewest_offline_pods_of_one_card_are_evicted_where_node_level_arithmetic_would_split_them(cluster, ns, label):
    """Two cards of 32 GiB, four offline pods of 50 % and 16 GiB (two per card). A pod of higher
    priority asking 60 % and 20 GiB arrives: at node level qgpu-memory is short (64 + 20 > 64 GiB;
    the offline pods' compute is qgpu-core-greedy, another node total). kube-scheduler's reprieve
    (highest priority first) would keep f0 and f2 and evict f1 and f3, one per card, which leaves
    no card with 60 % free; qgpu names the two pods of one card, the card whose most valuable pod
    has the lower priority, and the pod runs on that card."""
    _scheduler_with_preemption(cluster)
    classes = []
    try:
        classes = _priority_classes(cluster, ns, {"p0": 1000, "p1": 1001, "p2": 1002, "p3": 1003, "high": 100000})
        # f0 and f1 share one card, f2 and f3 the other (binpack fills a card before the next)
        card = _full_node(cluster, ns, label, [("f0", "p3"), ("f1", "p1"), ("f2", "p2"), ("f3", "p0")])
        assert card["f0"] == card["f1"] != card["f2"] == card["f3"], card
        _create_high(cluster, ns, label)
        pod = _high_bound(cluster, ns)
        assert _left(cluster, ns) == {"f0", "f1", "high"}  # f2 and f3 evicted, nothing else
        (share,) = record(pod).containers[0].shares
        assert share.index == card["f2"] and share.core_milli == 600
        assert cluster.extender.requests_by_verb().get("preempt", 0) >= 1  # the extender chose, not kube-scheduler alone
    finally:
        for name in classes:
            client.SchedulingV1Api(cluster.api_client).delete_priority_class(name)
        cluster.cp.start_scheduler(cluster.scheduler_extenders())


def test_where_no_eviction_frees_a_usable_card_none_happens(cluster, ns, label):
    """Each card holds one low-priority offline pod and one of the preemptor's own priority (50 %
    and 16 GiB each). At node level, evicting both low-priority pods makes room (64 - 32 + 20 GiB);
    at card level no card would have 60 % free, so the extender drops the node: nothing is evicted
    and the pod stays pending."""
    _scheduler_with_preemption(cluster)
    classes = []
    try:
        classes = _priority_classes(cluster, ns, {"p0": 1000, "p1": 1001, "high": 100000})
        card = _full_node(cluster, ns, label, [("f0", "p0"), ("g0", "high"), ("f1", "p1"), ("g1", "high")])
        assert card["f0"] == card["g0"] != card["f1"] == card["g1"], card
        before = cluster.extender.requests_by_verb().get("preempt", 0)
        _create_high(cluster, ns, label)
        wait_for("kube-scheduler asking the extender to preempt",
                 lambda: cluster.extender.requests_by_verb().get("preempt", 0) > before)
        scheduling_failure(cluster.api, ns, "high", "preemption")
        time.sleep(3)  # room for a deletion that must not come
        pods = {p["metadata"]["name"]: p for p in list_pods(cluster.api, ns)}
        assert set(pods) == {"f0", "f1", "g0", "g1", "high"}, set(pods)
        assert not any(p["metadata"].get("deletionTimestamp") for p in pods.values())
        assert not pods["high"]["spec"].get("nodeName")
    finally:
        for name in classes:
            client.SchedulingV1Api(cluster.api_client).delete_priority_class(name)
        cluster.cp.start_scheduler(cluster.scheduler_extenders())


def test_a_pod_a_disruption_budget_protects_is_spared_where_an_unprotected_card_helps(cluster, ns, label):
    """Card 0: f0 and f1 (the lowest priority), card 1: g0 and g1. Without a budget the extender
    names f0 and f1 (the previous test's rule). A PodDisruptionBudget with maxUnavailable 0 selects
    f0: the extender reads it through its watch (the rendered ClusterRole's list/watch in the RBAC
    tests), spares f0's card and names g0 and g1, with no violation counted; f0 and f1 run on."""
    _scheduler_with_preemption(cluster)
    classes = []
    try:
        classes = _priority_classes(cluster, ns, {"p0": 1000, "p1": 1001, "high": 100000})
        client.PolicyV1Api(cluster.api_client).create_namespaced_pod_disruption_budget(ns, {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "keep-f0"},
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "f0"}}}})
        card = _full_node(cluster, ns, label, [("f0", "p0"), ("f1", "p0"), ("g0", "p1"), ("g1", "p1")],
                          labels={"f0": {"app": "f0"}})
        assert card["f0"] == card["f1"] != card["g0"] == card["g1"], card
        _create_high(cluster, ns, label)
        pod = _high_bound(cluster, ns)
        assert _left(cluster, ns) == {"f0", "f1", "high"}
        (share,) = record(pod).containers[0].shares
        assert share.index == card["g0"]
    finally:
        for name in classes:
            client.SchedulingV1Api(cluster.api_client).delete_priority_class(name)
        cluster.cp.start_scheduler(cluster.scheduler_extenders())


def test_a_two_card_pod_gets_two_whole_cards(cluster, ns, label):
    """Three cards, two pods of 50 % on each (qgpu-core, so the node-level total is short: 300 %
    booked, 200 % asked). kube-scheduler's reprieve (highest priority first) keeps a1 (p5) and c1
    (p4) and would evict a0, b0, b1 and c0: card 1 whole, half of cards 0 and 2, no second whole
    card. The extender names the four pods of the two cards whose most valuable pod is the
    cheapest, cards 1 and 2 (b0, b1, c0, c1), and the pod runs on both, whole."""
    _scheduler_with_preemption(cluster)
    classes = []
    try:
        classes = _priority_classes(cluster, ns, {f"p{i}": 1000 + i for i in range(6)} | {"high": 100000})
        card = _full_node(cluster, ns, label, [("a0", "p0"), ("a1", "p5"), ("b0", "p1"), ("b1", "p2"),
                                               ("c0", "p3"), ("c1", "p4")], n_cards=3, offline=False)
        assert card["a0"] == card["a1"] and card["b0"] == card["b1"] and card["c0"] == card["c1"], card
        assert len({card["a0"], card["b0"], card["c0"]}) == 3, card
        _create_high(cluster, ns, label, {QGPU_CORE: 200})
        pod = _high_bound(cluster, ns)
        assert _left(cluster, ns) == {"a0", "a1", "high"}
        shares = record(pod).containers[0].shares
        assert sorted(s.index for s in shares) == sorted([card["b0"], card["c0"]])
        assert all(s.core_milli == 1000 for s in shares)
    finally:
        for name in classes:
            client.SchedulingV1Api(cluster.api_client).delete_priority_class(name)
        cluster.cp.start_scheduler(cluster.scheduler_extenders())
