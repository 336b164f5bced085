"""The GPU pool in DRA mode on the real node (`scripts/local-cluster up --dra`): site.yml deploys the
DeviceClasses and the node manager serving the DRA kubelet plugin; the manager publishes the node's
ResourceSlice; the real kube-scheduler allocates claims with consumable capacity from it; the real
kubelet asks the manager to prepare them; containerd v2 applies the CDI spec the manager wrote. What
the container prints, the claim's allocation, the scheduler's reasons and the node's own store are
checked. Pods carry ResourceClaimTemplates written by hand with contract.dra's names, and pods of
every dialect are converted by the webhook's /mutate-dra in a namespace labelled qgpu.io/gpu-mode=dra."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Iterator

import pytest
from kubernetes import client, config

from qgpu_runtime.contract import dra
from qgpu_runtime.node.store import Store
from tests.polling import poll
from tests.realnode import corpus, kube
from tests.realnode.conftest import running_cluster
from tests.realnode.localcluster import NODE, QGPU_NAMESPACE, LocalCluster
from tests.realnode.test_e2e_dialects import corpus_pod_running
from tests.realnode.test_e2e_isolation import host_pid

pytestmark = pytest.mark.slow

NS = f"dra-{os.getpid()}"  # a cluster kept between runs may still be deleting an earlier run's
PRINT = ("env | grep -E '^(NVIDIA_VISIBLE_DEVICES|QGPU_|T9K_GPU_)' | sort; echo '--- end'; exec sleep 3600")
SLICE = dra.slice_name(NODE)
MANAGER = "app.kubernetes.io/name=qgpu-manager"


@pytest.fixture(scope="module")
def dra_cluster() -> Iterator[LocalCluster]:
    """A fresh cluster with its GPU pool in DRA mode, torn down after this module;
    QGPU_REALNODE_DRA_CLUSTER=<dir> reuses one `scripts/local-cluster up --dra` runs there."""
    yield from running_cluster("QGPU_REALNODE_DRA_CLUSTER", "qgpu-realnode-dra-", dra=True)


@pytest.fixture(scope="module")
def ns(dra_cluster: LocalCluster) -> Iterator[str]:
    api = kube.core(dra_cluster)
    yield kube.namespace(api, NS)
    api.delete_namespace(NS)


def measured(what: str, started: float) -> None:
    """A timing for docs/benchmarks.md, shown with `pytest -s`."""
    print(f"measured: {what}: {time.monotonic() - started:.2f} s", file=sys.stderr, flush=True)


def custom(cluster: LocalCluster) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(config.new_client_from_config(str(cluster.admin_kubeconfig)))


def read_slice(cluster: LocalCluster) -> dict[str, Any] | None:
    try:
        return dict(custom(cluster).get_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", SLICE))
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def manager_pod(cluster: LocalCluster) -> dict[str, Any]:
    api = kube.core(cluster)
    (pod,) = api.list_namespaced_pod(QGPU_NAMESPACE, label_selector=MANAGER).items
    return dict(api.api_client.sanitize_for_serialization(pod))


def image(cluster: LocalCluster) -> str:
    return str(manager_pod(cluster)["spec"]["containers"][0]["image"])


def template(cluster: LocalCluster, ns: str, name: str, *, core: int, memory_mib: int, card: int | None = None) -> None:
    """A ResourceClaimTemplate for one share of a card, as a user writes it (docs/dra.md); ``card``
    pins the card with a CEL selector so that tests can fill one card on purpose."""
    request: dict[str, Any] = {"deviceClassName": dra.SHARED_CLASS,
                               "capacity": {"requests": {dra.CORE: str(core), dra.MEMORY: str(memory_mib)}}}
    if card is not None:
        request["selectors"] = [{"cel": {"expression": f'device.attributes["{dra.DRIVER}"].{dra.ATTR_INDEX} == {card}'}}]
    body = {"apiVersion": dra.API_VERSION, "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}}}
    custom(cluster).create_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaimtemplates", body)


def claim_pod(cluster: LocalCluster, name: str, template_name: str, script: str = PRINT) -> dict[str, Any]:
    pod = kube.shell_pod(name, image(cluster), script)
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template_name}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return pod


def container_env(cluster: LocalCluster, ns: str, name: str) -> dict[str, str]:
    text = kube.wait_log(kube.core(cluster), ns, name, "--- end")
    return dict(line.split("=", 1) for line in text.split("--- end", 1)[0].strip().splitlines())


def pod_claim(cluster: LocalCluster, ns: str, pod: str) -> dict[str, Any]:
    """The claim the resourceclaim-controller made for the pod from its template, once allocated."""
    def probe() -> dict[str, Any] | None:
        statuses = kube.read(kube.core(cluster), ns, pod).get("status", {}).get("resourceClaimStatuses") or []
        if not statuses or not statuses[0].get("resourceClaimName"):
            return None
        claim = custom(cluster).get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims",
                                                             statuses[0]["resourceClaimName"])
        return dict(claim) if claim.get("status", {}).get("allocation") else None

    return poll(probe, timeout=30, interval=0.2, what=f"the allocated claim of pod {ns}/{pod}")


def store_shares(cluster: LocalCluster) -> dict[str, tuple[int, int, int]]:
    """(card, core milli, memory MiB) booked per claim UID in the node's store (the manager's SQLite)."""
    store = Store(cluster.dir / "host" / "qgpu" / "meta.db")
    try:
        return {s.workload_id: (s.card_index, s.core_milli, s.memory_mib) for s in store.shares()}
    finally:
        store.close()


def card_load(cluster: LocalCluster) -> dict[int, int]:
    load: dict[int, int] = {}
    for card, milli, _ in store_shares(cluster).values():
        load[card] = load.get(card, 0) + milli
    return load


def claim_uids(cluster: LocalCluster, ns: str, pod: str) -> set[str]:
    statuses = kube.read(kube.core(cluster), ns, pod).get("status", {}).get("resourceClaimStatuses") or []
    uids = set()
    for status in statuses:
        if status.get("resourceClaimName"):
            claim = custom(cluster).get_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims",
                                                                 status["resourceClaimName"])
            uids.add(claim["metadata"]["uid"])
    return uids


def delete(cluster: LocalCluster, ns: str, *names: str) -> None:
    """Delete the pods and wait until kubelet has unprepared their claims: the node's store no
    longer books them (kubelet unprepares once the containers are gone, after the API object is)."""
    api = kube.core(cluster)
    uids = set().union(*(claim_uids(cluster, ns, name) for name in names))
    for name in names:
        api.delete_namespaced_pod(name, ns, grace_period_seconds=0)
    for name in names:
        kube.wait_gone(api, ns, name)
    poll(lambda: not uids & set(store_shares(cluster)), timeout=30, interval=0.2,
         what=f"the claims of {', '.join(names)} unprepared and released from the node's store")


def unschedulable_reason(cluster: LocalCluster, ns: str, name: str) -> str | None:
    for cond in kube.read(kube.core(cluster), ns, name).get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return str(cond.get("message"))
    return None


def test_the_manager_publishes_the_nodes_slice_and_the_roles_the_device_classes(dra_cluster: LocalCluster) -> None:
    published = poll(lambda: read_slice(dra_cluster), timeout=60, what=f"ResourceSlice {SLICE}")
    assert published["spec"]["driver"] == dra.DRIVER
    assert published["spec"]["nodeName"] == NODE
    assert [d["name"] for d in published["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    classes = custom(dra_cluster).list_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses")["items"]
    assert {dra.SHARED_CLASS, dra.WHOLE_CLASS} <= {c["metadata"]["name"] for c in classes}
    # No device plugin on a DRA pool: the node advertises no qgpu extended resource.
    assert not [r for r in kube.allocatable(kube.core(dra_cluster)) if r.startswith(kube.GPU_RESOURCE_PREFIXES)]
    # The DRA manager, with its own ClusterRole, says whether the node's shares are enforced.
    api = kube.core(dra_cluster)
    condition = poll(lambda: next((c for c in api.api_client.sanitize_for_serialization(api.read_node_status(NODE))
                                   ["status"]["conditions"] if c["type"] == "QGPUSharesEnforced"), None),
                     timeout=60, what="the QGPUSharesEnforced condition")
    assert (condition["status"], condition["reason"]) == ("False", "SimulatedGPUs"), condition


def test_a_share_runs_and_its_container_sees_card_and_share_from_the_cdi_spec(dra_cluster: LocalCluster, ns: str) -> None:
    template(dra_cluster, ns, "share-30", core=300, memory_mib=4096)
    api = kube.core(dra_cluster)
    started = time.monotonic()
    api.create_namespaced_pod(ns, claim_pod(dra_cluster, "share", "share-30"))
    kube.wait_phase(api, ns, "share", ("Running",))
    measured("DRA pod create -> Running (claim from template, allocation, prepare, CDI)", started)
    claim = pod_claim(dra_cluster, ns, "share")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == (dra.DRIVER, NODE)
    assert (result["consumedCapacity"][dra.CORE], result["consumedCapacity"][dra.MEMORY]) == ("300", "4096")
    devices = {d["name"]: d for d in read_slice(dra_cluster)["spec"]["devices"]}  # type: ignore[index]
    uuid = devices[result["device"]]["attributes"][dra.ATTR_UUID]["string"]
    env = container_env(dra_cluster, ns, "share")
    assert env["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert (env["QGPU_CORE_MILLI"], env["QGPU_MEMORY_MIB"]) == ("300", "4096")
    assert store_shares(dra_cluster)[claim["metadata"]["uid"]] == (dra.card_index(result["device"]), 300, 4096)
    delete(dra_cluster, ns, "share")


def test_two_pods_share_a_card_a_third_waits_and_runs_once_one_is_deleted(dra_cluster: LocalCluster, ns: str) -> None:
    template(dra_cluster, ns, "card0-40", core=400, memory_mib=8192, card=0)
    api = kube.core(dra_cluster)
    for name in ("a", "b"):
        api.create_namespaced_pod(ns, claim_pod(dra_cluster, name, "card0-40"))
    for name in ("a", "b"):
        kube.wait_phase(api, ns, name, ("Running",))
    claims = {name: pod_claim(dra_cluster, ns, name) for name in ("a", "b")}
    for claim in claims.values():
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["device"] == "gpu-0"
    # Distinct shares of one card (consumable capacity), both booked on card 0 by the node.
    assert len({c["status"]["allocation"]["devices"]["results"][0].get("shareID") for c in claims.values()}) == 2
    assert card_load(dra_cluster) == {0: 800}
    assert {name: container_env(dra_cluster, ns, name)["QGPU_CORE_MILLI"] for name in ("a", "b")} == {"a": "400", "b": "400"}

    api.create_namespaced_pod(ns, claim_pod(dra_cluster, "c", "card0-40"))
    reason = poll(lambda: unschedulable_reason(dra_cluster, ns, "c"), timeout=30, what="c unschedulable")
    print(f"scheduler on the third pod: {reason}", file=sys.stderr, flush=True)
    assert "cannot allocate all claims" in reason, reason
    assert kube.phase(api, ns, "c") == "Pending" and not kube.read(api, ns, "c")["spec"].get("nodeName")

    a_claim = claims["a"]["metadata"]["uid"]
    deleted = time.monotonic()
    delete(dra_cluster, ns, "a")
    measured("pod delete -> its share released from the node's store", deleted)
    # Unprepared by kubelet: the share is gone from the node's store ...
    poll(lambda: a_claim not in store_shares(dra_cluster), timeout=30, what="a's share released from the store")
    # ... and the scheduler, retrying, finds room for c on card 0.
    kube.wait_phase(api, ns, "c", ("Running",))
    measured("pod delete -> the pending pod Running in its place", deleted)
    assert card_load(dra_cluster) == {0: 800}
    delete(dra_cluster, ns, "b", "c")
    assert card_load(dra_cluster) == {}


def test_the_manager_killed_while_a_pod_is_prepared_loses_nothing(dra_cluster: LocalCluster, ns: str) -> None:
    template(dra_cluster, ns, "share-60", core=600, memory_mib=8192)
    api = kube.core(dra_cluster)
    manager = manager_pod(dra_cluster)
    restarts = manager["status"]["containerStatuses"][0]["restartCount"]
    api.create_namespaced_pod(ns, claim_pod(dra_cluster, "during", "share-60"))
    # Killed as soon as kube-scheduler has bound the pod: kubelet's prepare finds no plugin, or a
    # plugin dying mid-call, and retries until the restarted manager answers.
    poll(lambda: kube.read(api, ns, "during")["spec"].get("nodeName"), timeout=30, interval=0.05,
         what="the pod bound")
    killed = time.monotonic()
    os.kill(host_pid(dra_cluster, manager), signal.SIGKILL)
    poll(lambda: manager_pod(dra_cluster)["status"]["containerStatuses"][0]["restartCount"] > restarts,
         timeout=60, what="the manager container restarted by the kubelet")
    kube.wait_phase(api, ns, "during", ("Running",), timeout=120)
    measured("manager SIGKILL -> the pod it was preparing Running", killed)
    claim = pod_claim(dra_cluster, ns, "during")
    assert container_env(dra_cluster, ns, "during")["QGPU_CORE_MILLI"] == "600"
    # Booked exactly once; a second pod of 60 % goes to the other card, a third does not fit.
    assert list(store_shares(dra_cluster)) == [claim["metadata"]["uid"]]
    for name in ("after-1", "after-2"):
        api.create_namespaced_pod(ns, claim_pod(dra_cluster, name, "share-60"))
    phases = poll(lambda: p if (p := sorted(kube.phase(api, ns, n) for n in ("after-1", "after-2"))) == ["Pending", "Running"]
                  else None, timeout=60, what="one of after-1, after-2 running, the other pending")
    assert phases == ["Pending", "Running"]
    assert sorted(card_load(dra_cluster).values()) == [600, 600]
    delete(dra_cluster, ns, "during", "after-1", "after-2")


def test_kubelet_restart_wipes_the_slice_and_the_manager_publishes_it_again(dra_cluster: LocalCluster, ns: str) -> None:
    template(dra_cluster, ns, "share-20", core=200, memory_mib=2048)
    before = poll(lambda: read_slice(dra_cluster), timeout=30, what=f"ResourceSlice {SLICE}")
    restarted = time.monotonic()
    dra_cluster.restart_kubelet()
    # kubelet deletes its node's slices at start (reference/real-node.md, pitfall 8): a new one.
    again = poll(lambda: s if (s := read_slice(dra_cluster)) and s["metadata"]["uid"] != before["metadata"]["uid"] else None,
                 timeout=60, interval=0.5, what="the slice published again after the kubelet restart")
    measured("kubelet restart -> slice published again", restarted)
    assert [d["name"] for d in again["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    api = kube.core(dra_cluster)
    api.create_namespaced_pod(ns, claim_pod(dra_cluster, "after-kubelet", "share-20"))
    kube.wait_phase(api, ns, "after-kubelet", ("Running",))
    assert container_env(dra_cluster, ns, "after-kubelet")["QGPU_CORE_MILLI"] == "200"
    delete(dra_cluster, ns, "after-kubelet")


# ---- every dialect through the webhook's DRA conversion (where the roles deploy it) --------------
GPU_MODE = "qgpu.io/gpu-mode"


def webhook_converts(cluster: LocalCluster) -> bool:
    """Whether site.yml runs the webhook with --dra (the roles do once a pool is in DRA mode)."""
    (ds,) = kube.apps(cluster).list_namespaced_daemon_set(QGPU_NAMESPACE, label_selector="app.kubernetes.io/name=qgpu-webhook").items
    container = ds.spec.template.spec.containers[0]
    return "--dra" in [*(container.command or []), *(container.args or [])]


@pytest.fixture(scope="module")
def dialect_ns(dra_cluster: LocalCluster) -> Iterator[str]:
    if not webhook_converts(dra_cluster):
        pytest.skip("the roles deploy the webhook without --dra: dialect pods are not converted into claims")
    api = kube.core(dra_cluster)
    name = f"dra-dialects-{os.getpid()}"
    api.create_namespace({"metadata": {"name": name, "labels": {GPU_MODE: "dra"}}})
    poll(lambda: any(sa.metadata.name == "default" for sa in api.list_namespaced_service_account(name).items),
         timeout=30, what=f"the default ServiceAccount of namespace {name}")
    yield name
    api.delete_namespace(name)


@pytest.mark.parametrize(("limits", "core", "memory"), [
    ({"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "2"}, "300", "2048"),
    ({"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "8"}, "500", "2048"),
    ({"tensorstack.dev/nvidia-gpu": "1"}, "1000", "32768"),
    # A percent asks memory only: the claim takes the smallest core step, and its ShareConfig
    # (memoryOnly) has the node book core 0, as on device-plugin pools (docs/dra.md).
    ({"tensorstack.dev/nvidia-gpu-percent": "25"}, "0", "8192"),
], ids=["qgpu", "vcuda", "t9k-gpu", "t9k-percent"])
def test_a_dialect_pod_becomes_a_claim_and_runs_with_its_share(dra_cluster: LocalCluster, dialect_ns: str,
                                                               limits: dict[str, str], core: str, memory: str) -> None:
    api = kube.core(dra_cluster)
    name = "dialect-" + next(iter(limits)).rsplit("/", 1)[1]
    api.create_namespaced_pod(dialect_ns, kube.shell_pod(name, image(dra_cluster), PRINT, limits=limits))
    pod = kube.wait_phase(api, dialect_ns, name, ("Running",))
    container = pod["spec"]["containers"][0]
    assert not [r for r in container["resources"].get("limits", {}) if r.startswith(kube.GPU_RESOURCE_PREFIXES)]
    env = container_env(dra_cluster, dialect_ns, name)
    assert (env["QGPU_CORE_MILLI"], env["QGPU_MEMORY_MIB"]) == (core, memory)
    assert env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
    delete(dra_cluster, dialect_ns, name)


def test_an_unchanged_nvidia_gpu_pod_gets_a_whole_card_through_the_device_class(dra_cluster: LocalCluster, ns: str) -> None:
    api = kube.core(dra_cluster)
    api.create_namespaced_pod(ns, kube.shell_pod("nvidia", image(dra_cluster), PRINT, limits={"nvidia.com/gpu": "1"}))
    try:
        kube.wait_phase(api, ns, "nvidia", ("Running",), timeout=30)
        env = container_env(dra_cluster, ns, "nvidia")
        assert (env["QGPU_CORE_MILLI"], env["QGPU_MEMORY_MIB"]) == ("1000", "32768")
    finally:
        api.delete_namespaced_pod("nvidia", ns, grace_period_seconds=0)
        kube.wait_gone(api, ns, "nvidia")


@pytest.mark.parametrize("example", corpus.CORPUS, ids=[e.id for e in corpus.CORPUS])
def test_the_peers_documented_pod_runs_unchanged_on_the_dra_pool_with_its_share(dra_cluster: LocalCluster, dialect_ns: str,
                                                                                example: corpus.Example) -> None:
    """tests/realnode/corpus.py in a namespace served by /mutate-dra: each peer's pod as written
    becomes claims (nvidia.com/gpu through the whole-card DeviceClass) and sees its dialect's share."""
    with corpus_pod_running(dra_cluster, dialect_ns, example, image(dra_cluster), dra=True, delete_pod=delete) as (pod, _):
        claims = [c["name"] for c in pod["spec"].get("resourceClaims") or []]
        # Every GPU pod becomes claims but NVIDIA's, which the whole-card DeviceClass maps as it is.
        assert bool(claims) == (example.share is not None and example.peer != "nvidia"), claims


def taint_effects(cluster: LocalCluster, device: str) -> list[str]:
    devices = ((read_slice(cluster) or {}).get("spec") or {}).get("devices") or []
    return [t.get("effect") for d in devices if d.get("name") == device for t in d.get("taints") or []]


def test_a_failed_cards_pods_are_evicted_with_no_execute_and_the_card_returns_after_its_reset(
        dra_cluster: LocalCluster, ns: str) -> None:
    """The cluster's pool runs with qgpu_manager_dra_unhealthy_effect NoExecute (localcluster.py):
    XID 79 on the card a claim pod uses taints the card's device NoExecute, and kube-controller-
    manager's device taint eviction controller deletes the pod; once the card is reset (dropped
    from the control file) the taint goes, from the same manager."""
    template(dra_cluster, ns, "card1-30", core=300, memory_mib=4096, card=1)
    api = kube.core(dra_cluster)
    api.create_namespaced_pod(ns, claim_pod(dra_cluster, "victim", "card1-30"))
    kube.wait_phase(api, ns, "victim", ("Running",))
    manager_uid = manager_pod(dra_cluster)["metadata"]["uid"]
    started = time.monotonic()
    dra_cluster.simulated_control().write_text(json.dumps({"unhealthy": {"1": "XID 79: GPU has fallen off the bus"}}))
    try:
        poll(lambda: taint_effects(dra_cluster, "gpu-1") == ["NoExecute"], timeout=30, interval=0.2,
             what="card 1's device tainted NoExecute in the slice")
        measured("XID 79 -> NoExecute taint in the slice", started)

        def evicted() -> bool:
            try:
                pod = api.read_namespaced_pod("victim", ns)
            except client.ApiException as exc:
                return exc.status == 404
            return pod.metadata.deletion_timestamp is not None

        poll(evicted, timeout=90, interval=0.2, what="the pod on card 1 evicted by the device taint eviction controller")
        measured("XID 79 -> the pod on the card being deleted", started)
        assert taint_effects(dra_cluster, "gpu-0") == []
    finally:
        dra_cluster.simulated_control().write_text("{}\n")
    reset = time.monotonic()
    poll(lambda: taint_effects(dra_cluster, "gpu-1") == [], timeout=30, interval=0.2, what="card 1's taint gone after its reset")
    measured("reset -> the taint gone", reset)
    assert manager_pod(dra_cluster)["metadata"]["uid"] == manager_uid
    kube.wait_gone(api, ns, "victim", timeout=90)
