"""Isolation on real containers: a pod's process, started by containerd in the pod's real cgroup,
is reported as a GPU process by the simulated backend (its control file, as NVML would list it),
traced by the node manager through /proc/<pid>/cgroup (hostPID) to the pod, and held and released
by fixed-share; a process over its memory quota is stopped and the Event lands on the pod."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from qgpu_runtime.contract.record import ALLOCATION, parse_record
from tests.polling import poll
from tests.realnode import kube
from tests.realnode.localcluster import LocalCluster
from tests.realnode.test_e2e_dialects import cluster_image, delete


@pytest.fixture(scope="module")
def ns(local_cluster: LocalCluster) -> Iterator[str]:
    api = kube.core(local_cluster)
    yield kube.namespace(api, "isolation")
    local_cluster.simulated_control().write_text("{}\n")
    api.delete_namespace("isolation")


def host_pid(cluster: LocalCluster, pod: dict) -> int:
    """The host PID of the pod's container's main process, from containerd's own task list."""
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    for line in cluster.ctr("tasks", "list").stdout.decode().splitlines()[1:]:
        task, pid, _status = line.split()
        if task == cid:
            return int(pid)
    raise AssertionError(f"container {cid} has no task in containerd")


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def gpu_process(cluster: LocalCluster, pid: int, card: int, *, util_pct: int, memory_mib: int) -> None:
    """Make the simulated card report ``pid`` as its process, as NVML lists compute processes."""
    control = {"processes": [{"pid": pid, "card_index": card, "sm_util_pct": util_pct, "memory_mib": memory_mib}]}
    cluster.simulated_control().write_text(json.dumps(control))


def running_gpu_pod(cluster: LocalCluster, ns: str, name: str, core: str, memory_gib: str) -> tuple[dict, int, int]:
    api = kube.core(cluster)
    api.create_namespaced_pod(ns, kube.shell_pod(name, cluster_image(cluster), "exec sleep 3600", limits={
        "tke.cloud.tencent.com/qgpu-core": core, "tke.cloud.tencent.com/qgpu-memory": memory_gib}))
    pod = kube.wait_phase(api, ns, name, ("Running",))
    (placed,) = parse_record(pod["metadata"]["annotations"][ALLOCATION]).containers
    return pod, host_pid(cluster, pod), placed.shares[0].index


def test_fixed_share_holds_and_releases_a_busy_container(local_cluster: LocalCluster, ns: str) -> None:
    pod, pid, card = running_gpu_pod(local_cluster, ns, "busy", "20", "2")
    gpu_process(local_cluster, pid, card, util_pct=100, memory_mib=512)
    # 100 % busy against a 20 % share: the container is stopped (T) for most of each period and
    # let run in between; both states must be seen on the real process.
    seen: set[str] = set()
    poll(lambda: seen.add(state(pid)) or {"T", "S"} <= seen, timeout=30, interval=0.01,
         what=f"pid {pid} both held (T) and running (S); seen {seen}")
    gpu_process(local_cluster, pid, card, util_pct=0, memory_mib=0)
    poll(lambda: state(pid) != "T", timeout=10, what=f"pid {pid} released once idle")
    assert kube.phase(kube.core(local_cluster), ns, "busy") == "Running"
    delete(local_cluster, ns, "busy")


def test_a_container_over_its_memory_quota_is_stopped_with_an_event_on_the_pod(local_cluster: LocalCluster, ns: str) -> None:
    pod, pid, card = running_gpu_pod(local_cluster, ns, "greedy", "10", "1")
    gpu_process(local_cluster, pid, card, util_pct=5, memory_mib=3072)  # 3 GiB used, 1 GiB granted
    api = kube.core(local_cluster)
    poll(lambda: not Path(f"/proc/{pid}").exists() or state(pid) in ("Z", "X"), timeout=30,
         what=f"pid {pid} stopped by the memory watchdog")
    found = poll(lambda: [e for e in kube.events(api, ns, "greedy") if "memory" in e.lower()], timeout=30,
                 what="a memory Event on pod greedy")
    assert "3072" in found[0] and "1024" in found[0], found
    local_cluster.simulated_control().write_text("{}\n")
    delete(local_cluster, ns, "greedy")
