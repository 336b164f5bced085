"""Restarts on the real node: the kubelet restarted (the device plugins register again, running
pods keep their cards), the node manager killed with SIGKILL (nothing double-booked, new pods still
admitted), and a GPU pod deleted while the manager is down (released when it is back)."""

from __future__ import annotations

import os
import re
import signal

from kubernetes import client

from qgpu_runtime.contract.record import ALLOCATION, parse_record
from qgpu_runtime.node.store import Store
from tests.polling import poll
from tests.realnode import kube
from tests.realnode.localcluster import QGPU_NAMESPACE, LocalCluster
from tests.realnode.test_e2e_dialects import cluster_image, delete
from tests.realnode.test_e2e_isolation import host_pid

CORE = "tke.cloud.tencent.com/qgpu-core"
MEMORY = "tke.cloud.tencent.com/qgpu-memory"


ns = kube.namespace_fixture("restarts")


def gpu_pod(cluster: LocalCluster, ns: str, name: str, core: str = "40", memory: str = "4") -> dict:
    api = kube.core(cluster)
    api.create_namespaced_pod(ns, kube.shell_pod(name, cluster_image(cluster), "exec sleep 3600",
                                                 limits={CORE: core, MEMORY: memory}))
    return kube.wait_phase(api, ns, name, ("Running",))


def manager_pod(cluster: LocalCluster) -> dict:
    api = kube.core(cluster)
    (pod,) = api.list_namespaced_pod(QGPU_NAMESPACE, label_selector="app.kubernetes.io/name=qgpu-manager").items
    return api.api_client.sanitize_for_serialization(pod)


def registered(api: client.CoreV1Api, manager: str) -> int:
    """How often the manager has logged a registration with the kubelet (-1 while its log cannot
    be read: the apiserver reads it from the kubelet, which may be restarting)."""
    try:
        text = kube.logs(api, QGPU_NAMESPACE, manager, container="manager")
    except client.ApiException:
        return -1
    return len(re.findall(r"registered .+ with kubelet", text))


def store_shares(cluster: LocalCluster) -> dict[tuple[str, int], int]:
    """Core milli booked per (pod uid, card) in the node's own store (the manager's SQLite file)."""
    store = Store(cluster.dir / "host" / "qgpu" / "meta.db")
    try:
        return {(s.workload_id, s.card_index): s.core_milli for s in store.shares()}
    finally:
        store.close()


def card_load(shares: dict[tuple[str, int], int]) -> dict[int, int]:
    load: dict[int, int] = {}
    for (_, card), milli in shares.items():
        load[card] = load.get(card, 0) + milli
    return load


def test_kubelet_restart_keeps_running_pods_and_the_plugins_register_again(local_cluster: LocalCluster, ns: str) -> None:
    before = gpu_pod(local_cluster, ns, "before")
    api = kube.core(local_cluster)
    manager = manager_pod(local_cluster)["metadata"]["name"]
    registrations = registered(api, manager)
    local_cluster.restart_kubelet()
    # The manager sees the new kubelet socket and registers its plugins again; until then the
    # kubelet holds their devices unhealthy and would refuse a pod (as for every device plugin).
    poll(lambda: registered(api, manager) > registrations, timeout=30, interval=0.5,
         what="the manager's plugins registered with the restarted kubelet")
    # Re-registration shows as a working Allocate for a new pod after the restart.
    after = gpu_pod(local_cluster, ns, "after")
    still = kube.read(api, ns, "before")
    assert still["status"]["phase"] == "Running"
    assert still["status"]["containerStatuses"][0]["containerID"] == before["status"]["containerStatuses"][0]["containerID"]
    assert still["metadata"]["annotations"][ALLOCATION] == before["metadata"]["annotations"][ALLOCATION]
    shares = store_shares(local_cluster)
    assert (before["metadata"]["uid"], parse_record(before["metadata"]["annotations"][ALLOCATION]).containers[0].shares[0].index) in shares
    assert any(uid == after["metadata"]["uid"] for uid, _ in shares)
    delete(local_cluster, ns, "before")
    delete(local_cluster, ns, "after")


def test_manager_sigkill_double_books_nothing_and_new_pods_are_still_admitted(local_cluster: LocalCluster, ns: str) -> None:
    gpu_pod(local_cluster, ns, "a", core="60", memory="8")
    manager = manager_pod(local_cluster)
    restarts = manager["status"]["containerStatuses"][0]["restartCount"]
    os.kill(host_pid(local_cluster, manager), signal.SIGKILL)
    api = kube.core(local_cluster)
    poll(lambda: manager_pod(local_cluster)["status"]["containerStatuses"][0]["restartCount"] > restarts,
         timeout=60, what="the manager container restarted by the kubelet")
    # Until its plugins register again the kubelet holds the devices unhealthy, and a pod bound in
    # that window fails admission (docs/node-manager.md, failure modes): wait for Ready, as a
    # rollout would.
    poll(lambda: manager_pod(local_cluster)["status"]["containerStatuses"][0].get("ready"), timeout=90,
         what="the restarted manager Ready")
    for name in ("b", "c", "d"):
        api.create_namespaced_pod(ns, kube.shell_pod(name, cluster_image(local_cluster), "exec sleep 3600",
                                                     limits={CORE: "60", MEMORY: "8"}))
    # Four pods of 60 % on two cards: exactly one more runs, the others wait for a card.
    phases = poll(lambda: p if (p := sorted(kube.phase(api, ns, n) for n in ("b", "c", "d"))) == ["Pending", "Pending", "Running"]
                  else None, timeout=90, what="one of b, c, d running, two pending")
    assert phases == ["Pending", "Pending", "Running"]
    pending = [n for n in ("b", "c", "d") if kube.phase(api, ns, n) == "Pending"]
    for name in pending:
        assert not kube.read(api, ns, name)["spec"].get("nodeName"), f"{name} was bound with no card left"
    load = card_load(store_shares(local_cluster))
    assert all(milli <= 1000 for milli in load.values()), load
    for name in ("a", "b", "c", "d"):
        delete(local_cluster, ns, name)


def test_a_pod_deleted_while_the_manager_is_down_is_released_when_it_is_back(local_cluster: LocalCluster, ns: str) -> None:
    doomed = gpu_pod(local_cluster, ns, "doomed", core="50", memory="4")
    assert any(uid == doomed["metadata"]["uid"] for uid, _ in store_shares(local_cluster))
    apps = kube.apps(local_cluster)
    # One DaemonSet per isolation policy: the one whose pod runs here.
    owner = manager_pod(local_cluster)["metadata"]["ownerReferences"][0]["name"]
    ds = apps.read_namespaced_daemon_set(owner, QGPU_NAMESPACE)
    selector = dict(ds.spec.template.spec.node_selector or {})
    # The manager leaves the node (its DaemonSet no longer matches it) ...
    apps.patch_namespaced_daemon_set(ds.metadata.name, QGPU_NAMESPACE,
                                     {"spec": {"template": {"spec": {"nodeSelector": {**selector, "qgpu.io/parked": "yes"}}}}})
    api = kube.core(local_cluster)
    poll(lambda: not api.list_namespaced_pod(QGPU_NAMESPACE, label_selector="app.kubernetes.io/name=qgpu-manager").items,
         timeout=60, what="the manager pod gone")
    api.delete_namespaced_pod("doomed", ns, grace_period_seconds=0)
    kube.wait_gone(api, ns, "doomed")
    # ... and comes back: its start-up reconciliation releases the deleted pod's share.
    apps.patch_namespaced_daemon_set(ds.metadata.name, QGPU_NAMESPACE,
                                     {"spec": {"template": {"spec": {"nodeSelector": {**selector, "qgpu.io/parked": None}}}}})
    poll(lambda: manager_pod(local_cluster)["status"].get("phase") == "Running" if
         api.list_namespaced_pod(QGPU_NAMESPACE, label_selector="app.kubernetes.io/name=qgpu-manager").items else False,
         timeout=90, what="the manager pod running again")
    poll(lambda: not any(uid == doomed["metadata"]["uid"] for uid, _ in store_shares(local_cluster)), timeout=60,
         what="the deleted pod's share released from the node's store")


def test_a_pod_deleted_while_the_manager_runs_is_released_from_the_store(local_cluster: LocalCluster, ns: str) -> None:
    pod = gpu_pod(local_cluster, ns, "short-lived", core="20", memory="2")
    uid = pod["metadata"]["uid"]
    assert any(u == uid for u, _ in store_shares(local_cluster))
    delete(local_cluster, ns, "short-lived")
    # The manager's watch loop releases shares of deleted pods every release interval (10 s).
    poll(lambda: not any(u == uid for u, _ in store_shares(local_cluster)), timeout=40,
         what="the deleted pod's share released by the running manager")
