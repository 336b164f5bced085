"""A card fails on the real node (issue 26 §4): the simulated backend raises XID 79 for the card a
running GPU pod holds a share of (its control file, as NVML would report the event). Within one
health period the card's units leave the kubelet's allocatable, the node's `qgpu.io/gpus`
annotation marks it unhealthy, the running pods get the Warning Event `GPUCardUnhealthy`, the
extender (deployed with `qgpu_scheduler_evict_unhealthy_cards`, localcluster.py) evicts the pod that
does not tolerate `gpu.qgpu.io/unhealthy` while the one that does keeps running in the same container
(docs/operations.md, "A card fails"), and a new pod is placed on the healthy card only.
Then the card is reset (the control file no longer lists it): its units come back into the
allocatable without a manager restart."""

from __future__ import annotations

import json
import time
import urllib.request

from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract.inventory import parse_inventory
from qgpu_runtime.contract.names import ALLOCATION, INVENTORY
from qgpu_runtime.contract.record import parse_record
from tests.polling import poll
from tests.realnode import kube
from tests.realnode.localcluster import LocalCluster
from tests.realnode.test_e2e_dialects import delete
from tests.realnode.test_e2e_restarts import CORE, MEMORY, cluster_image, gpu_pod, manager_pod

ns = kube.namespace_fixture("cardfail")


def allocatable(cluster: LocalCluster) -> tuple[int, int]:
    status = kube.core(cluster).read_node("localhost").status
    return int(status.allocatable.get(CORE, "0")), int(status.allocatable.get(MEMORY, "0"))


def card_of(pod: dict) -> int:
    return parse_record(pod["metadata"]["annotations"][ALLOCATION]).containers[0].shares[0].index


def test_a_failed_card_leaves_the_pool_its_pods_are_told_and_new_pods_go_elsewhere(local_cluster: LocalCluster, ns: str) -> None:
    cluster = local_cluster
    api = kube.core(cluster)
    cards = parse_inventory("localhost", api.read_node("localhost").metadata.annotations[INVENTORY])
    core_before, memory_before = allocatable(cluster)
    card_core, card_memory = core_before // len(cards), memory_before // len(cards)
    # the pod that stays tolerates the failed card (as it would a NoExecute taint); the other does not
    tolerant = kube.shell_pod("on-card", cluster_image(cluster), "exec sleep 3600", limits={CORE: "30", MEMORY: "4"})
    tolerant["spec"]["tolerations"] = [{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists", "effect": "NoExecute"}]
    api.create_namespaced_pod(ns, tolerant)
    victim = kube.wait_phase(api, ns, "on-card", ("Running",))
    failed = card_of(victim)
    evicted = gpu_pod(cluster, ns, "evicted", core="30", memory="4")
    assert card_of(evicted) == failed  # binpack: the fuller card
    started = time.monotonic()
    cluster.simulated_control().write_text(json.dumps({"unhealthy": {str(failed): "XID 79: GPU has fallen off the bus"}}))
    try:
        poll(lambda: allocatable(cluster) == (core_before - card_core, memory_before - card_memory), timeout=60, interval=0.2,
             what=f"card {failed}'s {card_core} core and {card_memory} memory units out of the node's allocatable")
        gone = time.monotonic() - started
        (card,) = [c for c in parse_inventory("localhost", api.read_node("localhost").metadata.annotations[INVENTORY])
                   if c.index == failed]
        assert not card.healthy and "XID 79" in card.reason

        def warned() -> list | None:
            events = api.list_namespaced_event(ns, field_selector="involvedObject.kind=Pod,involvedObject.name=on-card").items
            return [e for e in events if e.reason == "GPUCardUnhealthy"] or None

        (event,) = poll(warned, timeout=30, what="the GPUCardUnhealthy Event on the pod")
        assert event.type == "Warning" and "XID 79" in event.message and f"card {failed}" in event.message

        def leaving() -> dict | None:
            try:
                pod = kube.read(api, ns, "evicted")
            except ApiException as exc:
                return {"gone": True} if exc.status == 404 else None
            return pod if pod["metadata"].get("deletionTimestamp") else None

        out = poll(leaving, timeout=60, interval=0.2, what="the pod without the toleration evicted by the extender")
        evicted_after = time.monotonic() - started
        if "gone" not in out:  # the Eviction API marks why it deleted the pod
            (condition,) = [c for c in out["status"].get("conditions") or [] if c["type"] == "DisruptionTarget"]
            assert condition["reason"] == "EvictionByEvictionAPI"
        # the extender counts it (its /metrics: plain HTTP on loopback in this cluster)
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port('extender')}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert 'qgpu_extender_unhealthy_card_evictions_total{result="evicted"} 1.0' in metrics
        still = kube.read(api, ns, "on-card")
        assert still["status"]["phase"] == "Running"
        assert still["status"]["containerStatuses"][0]["containerID"] == victim["status"]["containerStatuses"][0]["containerID"]
        # a new pod that the failed card could have held lands on the healthy one
        assert card_of(gpu_pod(cluster, ns, "after", core="60", memory="8")) != failed
        print(f"card {failed} out of the allocatable {gone:.1f} s after XID 79; pod evicted {evicted_after:.1f} s after it")
    finally:
        cluster.simulated_control().write_text("{}\n")
    # the card was reset (the control file no longer lists it): back in the pool, the same manager
    manager_uid = manager_pod(cluster)["metadata"]["uid"]
    started = time.monotonic()
    poll(lambda: allocatable(cluster) == (core_before, memory_before), timeout=60, interval=0.2,
         what="the card's units back in the allocatable without a manager restart")
    print(f"card {failed} back in the allocatable {time.monotonic() - started:.1f} s after its reset")
    assert manager_pod(cluster)["metadata"]["uid"] == manager_uid
    assert all(c.healthy for c in parse_inventory("localhost", api.read_node("localhost").metadata.annotations[INVENTORY]))
    delete(cluster, ns, "on-card")
    delete(cluster, ns, "after")

