"""Pods of every dialect on the real node: admitted by the webhook, placed by the extender (through
the real kube-scheduler), allocated by the real kubelet through qgpu's device plugins, run by
containerd, and what the container itself prints is checked: visible devices, QGPU_*, T9K_GPU_*
and the quota file, which must agree with the allocation record on the pod."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest

from qgpu_runtime.contract.record import ALLOCATION, parse_record
from tests.realnode import corpus, kube
from tests.realnode.localcluster import NODE, QGPU_NAMESPACE, LocalCluster

ALLOC_MODE = "sched.tensorstack.dev/node-alloc-mode"
PRINT = ("env | grep -E '^(NVIDIA_VISIBLE_DEVICES|QGPU_|T9K_GPU_)' | sort; echo '--- quota'; "
         "cat /etc/qgpu/quota.json | tr -d '\\n'; echo; echo '--- end'; sleep 3600")


ns = kube.namespace_fixture("dialects")


def run_and_read(cluster: LocalCluster, ns: str, name: str, limits: dict[str, str],
                 edit: Callable[[dict], dict] = lambda pod: pod) -> tuple[dict[str, str], dict[str, Any], dict]:
    """(container env, quota.json, pod) of a pod asking for ``limits``, as its container printed them."""
    api = kube.core(cluster)
    api.create_namespaced_pod(ns, edit(kube.shell_pod(name, cluster_image(cluster), PRINT, limits=limits)))
    kube.wait_phase(api, ns, name, ("Running",))
    text = kube.wait_log(api, ns, name, "--- end")
    env_part, quota_part = text.split("--- quota", 1)
    env = dict(line.split("=", 1) for line in env_part.strip().splitlines())
    quota = json.loads(quota_part.split("--- end", 1)[0].strip())
    return env, quota, kube.read(api, ns, name)


def cluster_image(cluster: LocalCluster) -> str:
    (ds,) = kube.apps(cluster).list_namespaced_daemon_set(QGPU_NAMESPACE, label_selector="app.kubernetes.io/name=qgpu-scheduler").items
    return str(ds.spec.template.spec.containers[0].image)


def assert_matches_record(env: dict[str, str], quota: dict[str, Any], pod: dict) -> None:
    record = parse_record(pod["metadata"]["annotations"][ALLOCATION])
    (placed,) = record.containers
    uuids = [c.uuid for c in placed.shares]
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(uuids)
    assert env["QGPU_CORE_MILLI"] == ",".join(str(c.core_milli) for c in placed.shares)
    assert env["QGPU_MEMORY_MIB"] == ",".join(str(c.memory_mib) for c in placed.shares)
    assert [c["uuid"] for c in quota["cards"]] == uuids
    assert quota["pod"] == f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
    assert pod["spec"]["nodeName"] == "localhost"


def delete(cluster: LocalCluster, ns: str, name: str) -> None:
    """Free the cards for the next test: the pod gone from the API (its grant released by the node)."""
    api = kube.core(cluster)
    api.delete_namespaced_pod(name, ns, grace_period_seconds=0)
    kube.wait_gone(api, ns, name)


def set_alloc_mode(cluster: LocalCluster, mode: str | None) -> str | None:
    """Label the node as a T9k ``mode`` node (None: no label); returns the label it had."""
    api = kube.core(cluster)
    before = (api.read_node("localhost").metadata.labels or {}).get(ALLOC_MODE)
    api.patch_node("localhost", {"metadata": {"labels": {ALLOC_MODE: mode}}})
    return before


def test_the_real_nodes_capacity_carries_hamis_share_sizes_beside_the_kubelets(local_cluster: LocalCluster) -> None:
    """The manager's status patch (node/nodeinfo.py share_size_capacity) on a Node the real kubelet
    keeps updating: both its two V100-32G and the kubelet's own figures are there."""
    api = kube.core(local_cluster)
    deadline = time.monotonic() + 60
    while True:
        capacity = api.read_node_status("localhost").status.capacity or {}
        if "nvidia.com/gpumem" in capacity or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {k: capacity.get(k) for k in ("nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores")} == \
        {"nvidia.com/gpumem": "65536", "nvidia.com/gpumem-percentage": "200", "nvidia.com/gpucores": "200"}, capacity
    assert capacity.get("tke.cloud.tencent.com/qgpu-core") == "200" and "cpu" in capacity


def test_qgpu_core_and_memory(local_cluster: LocalCluster, ns: str) -> None:
    env, quota, pod = run_and_read(local_cluster, ns, "qgpu", {"tke.cloud.tencent.com/qgpu-core": "30",
                                                               "tke.cloud.tencent.com/qgpu-memory": "2"})
    assert (env["QGPU_CORE_MILLI"], env["QGPU_MEMORY_MIB"], env["QGPU_POLICY"]) == ("300", "2048", "fixed-share")
    assert env["QGPU_CLASS"] == "normal"
    assert_matches_record(env, quota, pod)
    delete(local_cluster, ns, "qgpu")


def test_vcuda_core_and_memory(local_cluster: LocalCluster, ns: str) -> None:
    env, quota, pod = run_and_read(local_cluster, ns, "vcuda", {"tencent.com/vcuda-core": "50",
                                                                "tencent.com/vcuda-memory": "8"})
    assert (env["QGPU_CORE_MILLI"], env["QGPU_MEMORY_MIB"]) == ("500", "2048")  # 8 units of 256 MiB
    assert_matches_record(env, quota, pod)
    delete(local_cluster, ns, "vcuda")


def test_nvidia_gpu_gets_a_whole_card(local_cluster: LocalCluster, ns: str) -> None:
    env, quota, pod = run_and_read(local_cluster, ns, "nvidia", {"nvidia.com/gpu": "1"})
    assert (env["QGPU_CORE_MILLI"], env["QGPU_MEMORY_MIB"]) == ("1000", "32768")
    assert_matches_record(env, quota, pod)
    delete(local_cluster, ns, "nvidia")


def run_on_alloc_mode(cluster: LocalCluster, ns: str, mode: str, name: str, limits: dict[str, str]) -> tuple[dict[str, str], dict[str, Any], dict]:
    """``run_and_read`` with the node labelled as a T9k ``mode`` (xgn/sgn) node while the pod lands."""
    before = set_alloc_mode(cluster, mode)
    try:
        return run_and_read(cluster, ns, name, limits)
    finally:
        set_alloc_mode(cluster, before)  # the pool's own label (qgpu_node_pool_alloc_mode, sgn by default)


def as_t9k_writes_it(pod: dict) -> dict:
    """T9k's guide: every pod names t9k-scheduler and a group; nothing qgpu-specific is added."""
    pod["spec"]["schedulerName"] = "t9k-scheduler"
    pod["metadata"]["labels"] = {"scheduler.tensorstack.dev/group-name": "demo"}
    return pod


def test_t9k_percent_as_t9k_writes_it_runs_on_the_default_pool(local_cluster: LocalCluster, ns: str) -> None:
    """scripts/local-cluster's pool at the role defaults is a shared pool: T9k's percent pod, with
    its own scheduler name, runs there without relabelling the node (issue 22 §2)."""
    assert (kube.core(local_cluster).read_node("localhost").metadata.labels or {}).get(ALLOC_MODE) == "sgn"
    env, quota, pod = run_and_read(local_cluster, ns, "t9k-as-written", {"tensorstack.dev/nvidia-gpu-percent": "25"},
                                   as_t9k_writes_it)
    assert pod["spec"]["schedulerName"] == "t9k-scheduler"
    assert (env["T9K_GPU_MODE"], env["T9K_GPU_PERCENT"], env["T9K_GPU_MEMORY"]) == ("sgn", "25", "8192")
    assert_matches_record(env, quota, pod)
    delete(local_cluster, ns, "t9k-as-written")


def test_t9k_whole_node_on_an_xgn_node_sees_every_card(local_cluster: LocalCluster, ns: str) -> None:
    env, quota, pod = run_on_alloc_mode(local_cluster, ns, "xgn", "t9k-node", {"tensorstack.dev/nvidia-gpu-node": "1"})
    (placed,) = parse_record(pod["metadata"]["annotations"][ALLOCATION]).containers
    assert len(placed.shares) == 2  # the local cluster's 2xV100-32G: every card of the node
    assert (env["T9K_GPU_MODE"], env["T9K_GPU_COUNT"]) == ("node", "2")
    assert_matches_record(env, quota, pod)
    delete(local_cluster, ns, "t9k-node")


def test_t9k_percent_on_an_sgn_node(local_cluster: LocalCluster, ns: str) -> None:
    env, quota, pod = run_on_alloc_mode(local_cluster, ns, "sgn", "t9k-percent", {"tensorstack.dev/nvidia-gpu-percent": "25"})
    assert env["T9K_GPU_PERCENT"] == "25"
    assert env["T9K_GPU_MEMORY"] == "8192"  # 25 % of a 32 GiB card
    assert env["T9K_GPU_MODE"] == "sgn"
    assert_matches_record(env, quota, pod)
    delete(local_cluster, ns, "t9k-percent")


def test_t9k_whole_card_on_an_xgn_node(local_cluster: LocalCluster, ns: str) -> None:
    env, quota, pod = run_on_alloc_mode(local_cluster, ns, "xgn", "t9k-gpu", {"tensorstack.dev/nvidia-gpu": "1"})
    assert (env["QGPU_CORE_MILLI"], env["QGPU_MEMORY_MIB"]) == ("1000", "32768")
    assert (env["T9K_GPU_MODE"], env["T9K_GPU_COUNT"]) == ("xgn", "1")
    assert_matches_record(env, quota, pod)
    delete(local_cluster, ns, "t9k-gpu")


# ---- the peers' corpus (tests/realnode/corpus.py), unchanged, one pod after the other -----------

@contextmanager
def corpus_pod_running(cluster: LocalCluster, ns: str, example: corpus.Example, image: str, *, dra: bool,
                       delete_pod: Callable[[LocalCluster, str, str], None]) -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
    """The corpus pod created as its peer writes it (the node labelled with its T9k mode meanwhile),
    Running on the node, its container's environment checked against the corpus; yields (pod, env)
    for the door's own checks, then deletes it with ``delete_pod`` and restores the label."""
    api = kube.core(cluster)
    before = set_alloc_mode(cluster, example.alloc_mode) if example.alloc_mode else None
    try:
        api.create_namespaced_pod(ns, example.pod(image))
        pod = kube.wait_phase(api, ns, example.id, ("Running",))
        env = corpus.read_env(kube.wait_log(api, ns, example.id, "--- end"))
        assert pod["spec"]["nodeName"] == NODE
        corpus.check(example, env, dra=dra)
        yield pod, env
    finally:
        if example.alloc_mode:
            set_alloc_mode(cluster, before)
        delete_pod(cluster, ns, example.id)


@pytest.mark.parametrize("example", corpus.CORPUS, ids=[e.id for e in corpus.CORPUS])
def test_the_peers_documented_pod_runs_unchanged_with_its_share(local_cluster: LocalCluster, ns: str,
                                                                example: corpus.Example) -> None:
    with corpus_pod_running(local_cluster, ns, example, cluster_image(local_cluster), dra=False, delete_pod=delete) as (pod, env):
        record = (pod["metadata"].get("annotations") or {}).get(ALLOCATION)
        if example.share is None:
            assert record is None
        else:
            (placed,) = parse_record(record).containers
            assert placed.name == "main" and env["NVIDIA_VISIBLE_DEVICES"] == ",".join(c.uuid for c in placed.shares)
