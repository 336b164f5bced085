"""Preemption on the real node (issue 25): the roles wired kube-scheduler's preemptVerb to the
extender; a higher-priority online pod arrives on a node whose two cards' memory offline pods hold.
kube-scheduler asks the extender, deletes the victim it names, the real kubelet stops it, the node
manager releases its share from the node's store, and the online pod runs on the freed card, its
container seeing its share."""

from __future__ import annotations

from datetime import datetime

from kubernetes import client

from qgpu_runtime.contract.record import ALLOCATION, parse_record
from tests.polling import poll
from tests.realnode import kube
from tests.realnode.localcluster import LocalCluster
from tests.realnode.test_e2e_dialects import assert_matches_record, cluster_image, delete, run_and_read
from tests.realnode.test_e2e_restarts import store_shares

GREEDY = "tke.cloud.tencent.com/qgpu-core-greedy"
MEMORY = "tke.cloud.tencent.com/qgpu-memory"
APP_CLASS = "tke.cloud.tencent.com/app-class"
MIXED = "mixed-qgpu-enable"

ns = kube.namespace_fixture("preemption")


def _stamp(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_an_online_pod_of_higher_priority_evicts_one_offline_pod_and_runs_on_its_card(local_cluster: LocalCluster, ns: str) -> None:
    api = kube.core(local_cluster)
    scheduling = client.SchedulingV1Api(api.api_client)
    poll(lambda: not store_shares(local_cluster), timeout=90, what="no share booked on the node before the test")
    classes = {"preempt-low": 1000, "preempt-lower": 999, "preempt-high": 100000}
    # online/offline co-location is a node's choice (docs/placement.md): this test's node makes it
    mixed = (api.read_node("localhost").metadata.labels or {}).get(MIXED)
    api.patch_node("localhost", {"metadata": {"labels": {MIXED: "enable"}}})
    for name, value in classes.items():
        scheduling.create_priority_class({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                          "metadata": {"name": name}, "value": value})
    try:
        image = cluster_image(local_cluster)
        # Each offline pod holds a whole card's memory (32 GiB of a V100-32G): qgpu-memory is full
        # at node level, so kube-scheduler's dry run finds victims and asks the extender.
        cards = {}
        for name, klass in (("off-a", "preempt-lower"), ("off-b", "preempt-low")):
            pod = kube.shell_pod(name, image, "exec sleep 3600", limits={GREEDY: "50", MEMORY: "32"},
                                 annotations={APP_CLASS: "offline"})
            pod["spec"]["priorityClassName"] = klass
            api.create_namespaced_pod(ns, pod)
            running = kube.wait_phase(api, ns, name, ("Running",))
            (placed,) = parse_record(running["metadata"]["annotations"][ALLOCATION]).containers
            cards[name] = (running["metadata"]["uid"], placed.shares[0].index, placed.shares[0].uuid)
        assert cards["off-a"][1] != cards["off-b"][1], cards

        def online(pod: dict) -> dict:
            pod["metadata"]["annotations"][APP_CLASS] = "online"
            pod["spec"]["priorityClassName"] = "preempt-high"
            return pod

        env, quota, pod = run_and_read(local_cluster, ns, "online", {MEMORY: "8"}, online)
        # the lowest-priority offline pod went, the other runs on
        kube.wait_gone(api, ns, "off-a")
        assert kube.phase(api, ns, "off-b") == "Running"
        victim_uid, victim_card, victim_uuid = cards["off-a"]
        # the node manager released the victim's share from its store; the online pod holds the card
        def released() -> dict | None:
            booked = store_shares(local_cluster)
            return None if any(uid == victim_uid for uid, _ in booked) else booked

        shares = poll(released, timeout=60, what="the evicted pod's share released from the node's store")
        assert {card for (uid, card) in shares if uid == pod["metadata"]["uid"]} == {victim_card}, shares

        assert (env["QGPU_CLASS"], env["QGPU_MEMORY_MIB"], env["NVIDIA_VISIBLE_DEVICES"]) == ("online", "8192", victim_uuid)
        assert_matches_record(env, quota, pod)
        started = pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
        seconds = (_stamp(started) - _stamp(pod["metadata"]["creationTimestamp"])).total_seconds()
        print(f"online pod: created -> container started {seconds:.0f} s (one eviction, grace 1 s)")
    finally:
        for name in ("online", "off-a", "off-b"):
            try:
                delete(local_cluster, ns, name)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        for name in classes:
            scheduling.delete_priority_class(name)
        api.patch_node("localhost", {"metadata": {"labels": {MIXED: mixed}}})
