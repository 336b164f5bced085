"""A GPU pod's admission on the node against the real kube-apiserver (issue 23 §1): in the steady
state Allocate and GetPreferredAllocation read the watch-fed cache (no LIST) and write nothing
before they answer; a pod bound a moment ago, which the watch has not delivered, is still matched,
by one LIST. The manager runs in this process so its API calls can be counted at the client."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from qgpu_runtime.gpu.simulated import SimulatedBackend, build_cards, parse_spec
from qgpu_runtime.node.deviceplugin.resources import parse_resources
from qgpu_runtime.node.kube_client import KubePodSource
from qgpu_runtime.node.manager import ManagerConfig, NodeManager
from qgpu_runtime.node.store import Store
from tests.k8s.kubeobjects import gpu_pod, read_pod, wait_for
from tests.k8s.nodemanager import CORE, MEMORY, bare_node, bind_with_record
from tests.recordkeys import VERIFIER

SPEC = "2xT4-16G"
NOBODY = "qgpu-test-nobody"  # no scheduler takes these pods: the test binds them as the extender does


class CountingSource(KubePodSource):
    """The manager's real API client, counting its LISTs and PATCHes; ``gate`` holds the watch's
    events back (a watch that lags) while it is clear."""

    def __init__(self, kubeconfig: str) -> None:
        super().__init__(kubeconfig)
        self.lists = 0
        self.list_threads: list[int] = []  # who listed: kubelet's caller (the admission path) or the watch
        self.patch_threads: list[int] = []  # which thread wrote: kubelet's caller, or the annotation writer
        self.gate = threading.Event()
        self.gate.set()

    def list_pods_on_node(self, node: str):
        self.lists += 1
        self.list_threads.append(threading.get_ident())
        return super().list_pods_on_node(node)

    def pods_on_node(self, node: str):
        self.lists += 1
        self.list_threads.append(threading.get_ident())
        return super().pods_on_node(node)

    def lists_by_caller(self) -> int:
        """LISTs made by this thread, the one that plays kubelet: the watch's own relists (after a
        timeout or a dropped stream on a loaded machine) are not on the admission path."""
        return self.list_threads.count(threading.get_ident())

    def patch_pod_annotations(self, namespace, name, values) -> None:
        self.patch_threads.append(threading.get_ident())
        super().patch_pod_annotations(namespace, name, values)

    def watch_pods_on_node(self, node, resource_version, timeout_s, stop) -> Iterator[tuple[str, dict[str, Any]]]:
        for event in super().watch_pods_on_node(node, resource_version, timeout_s, stop):
            while not self.gate.wait(0.1):
                if stop.is_set():
                    return
            yield event


@pytest.fixture
def node(cluster, label, tmp_path: Path) -> Iterator[tuple[str, NodeManager, CountingSource]]:
    name = f"adm-{uuid.uuid4().hex[:8]}"
    bare_node(cluster.api, name, label)
    config = ManagerConfig(node=name, resources=parse_resources(f"{CORE},{MEMORY}"), plugin_dir=tmp_path / "dp",
                           pod_resources_socket=tmp_path / "pr.sock", state_dir=tmp_path / "state",
                           isolation_policy="fixed-share", label_node=False, record_verifier=VERIFIER)
    source = CountingSource(str(cluster.cp.admin_kubeconfig))
    manager = NodeManager(config, SimulatedBackend(build_cards(parse_spec(SPEC), name), None), Store(tmp_path / "meta.db"),
                          source)
    manager.start()
    try:
        yield name, manager, source
    finally:
        source.gate.set()
        manager.stop()
        manager.store.close()


def bound_pod(cluster, ns: str, node: str, name: str, card: int, bind_time: int) -> dict[str, Any]:
    cluster.api.create_namespaced_pod(ns, gpu_pod(name, {CORE: 20, MEMORY: 2}, scheduler_name=NOBODY))
    uuid_of = build_cards(parse_spec(SPEC), node)[card].uuid
    bind_with_record(cluster.api, ns, name, node, [(card, uuid_of, 200, 2048)], bind_time)
    return read_pod(cluster.api, ns, name)


def admit(manager: NodeManager, card: int) -> dict[str, str]:
    """What kubelet does for one container: GetPreferredAllocation, then Allocate, per resource."""
    envs: dict[str, str] = {}
    for kind, size in ((manager.config.resources[0], 20), (manager.config.resources[1], 2)):
        available = [d for d, _ in manager.wait_devices(kind, -1, 0)[1]]
        ids = manager.preferred(kind, available, [], size)
        assert all(f"-{card}-" in d for d in ids), f"GetPreferredAllocation steered {kind.name} off card {card}: {ids}"
        envs.update(manager.allocate(kind, tuple(ids)).envs)
    return envs


def assigned(cluster, ns: str, name: str) -> str | None:
    return (read_pod(cluster.api, ns, name)["metadata"].get("annotations") or {}).get("qgpu.io/assigned")


def test_steady_state_admissions_make_no_list_and_no_api_write_before_answering(cluster, ns, node):
    name, manager, source = node
    base = time.time_ns()
    for i in range(6):
        bound_pod(cluster, ns, name, f"p{i}", i % 2, base + i)
    wait_for("the watch delivered the six pods", lambda: (s := manager.node_pods.snapshot()) and len(s.derived) == 6)
    lists = source.lists_by_caller()
    for i in range(6):
        envs = admit(manager, i % 2)
        assert envs["QGPU_CORE_MILLI"] == "200"
        assert source.lists_by_caller() == lists, f"pod p{i}: a LIST on the admission path"
    for i in range(6):  # written after Allocate returned, by the annotation writer's thread
        wait_for(f"p{i} annotated", lambda i=i: assigned(cluster, ns, f"p{i}") == '["c0"]', timeout=30)
    assert source.patch_threads and threading.get_ident() not in source.patch_threads  # none by kubelet's caller
    assert source.lists_by_caller() == lists


def test_a_pod_bound_a_moment_ago_that_the_watch_has_not_delivered_is_matched_by_one_list(cluster, ns, node):
    name, manager, source = node
    wait_for("the cache synced", lambda: manager.node_pods.snapshot() is not None)
    source.gate.clear()  # the watch lags from here: it delivers nothing
    bound_pod(cluster, ns, name, "late", 1, time.time_ns())
    lists = source.lists_by_caller()
    envs = admit(manager, 1)
    assert envs["NVIDIA_VISIBLE_DEVICES"] == build_cards(parse_spec(SPEC), name)[1].uuid
    # GetPreferredAllocation missed and listed; Allocate reused its match; the memory resource's pair the same
    assert source.lists_by_caller() - lists == 2
    assert manager.node_pods.snapshot().derived == ()  # type: ignore[union-attr]  # still lagging
    source.gate.set()
    wait_for("the watch caught up", lambda: len(manager.node_pods.snapshot().derived) == 1)  # type: ignore[union-attr]
    wait_for("late annotated", lambda: assigned(cluster, ns, "late") == '["c0"]', timeout=30)
