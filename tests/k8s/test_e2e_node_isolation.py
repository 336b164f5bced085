"""The node manager's isolation loop against the real kube-apiserver: the policy read from the
Node's label, and the memory watchdog's Event written on the offending pod.

Cards, processes and signals are the modelled ones of tests/node/test_node_isolation.py (no GPU,
no kubelet here); everything the manager says to Kubernetes goes through ``KubePodSource``.
"""

from __future__ import annotations

import signal
import sys
import uuid
from pathlib import Path

import pytest

from qgpu_runtime.gpu.simulated import SimulatedBackend, build_cards, parse_spec
from qgpu_runtime.isolation.policy import POLICY_LABEL, Policy
from qgpu_runtime.isolation.signals import SignalActuator
from qgpu_runtime.node.deviceplugin.resources import parse_resources
from qgpu_runtime.node.kube_client import KubePodSource
from qgpu_runtime.node.manager import ManagerConfig, NodeManager
from qgpu_runtime.node.store import Grant, Share, Store
from tests.k8s.kubeobjects import cards, events_for, gpu_node, wait_for
from tests.recordkeys import VERIFIER

sys.path.insert(0, str(Path(__file__).parents[1] / "node"))
from simnode import AdvancingSampler, FakeProc, SimKernel, cgroupfs  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "isolation"))
from helpers import make_backend  # noqa: E402

RESOURCE = "tke.cloud.tencent.com/qgpu-core"
CID = "e" * 64


def manager(cluster, tmp: Path, node: str, gpus, kernel, override: str | None = None) -> NodeManager:
    config = ManagerConfig(node=node, resources=parse_resources(RESOURCE), plugin_dir=tmp / "dp",
                           pod_resources_socket=tmp / "pr.sock", state_dir=tmp / "state", isolation_policy=override,
                           pod_refresh_s=0.0, proc_root=tmp / "proc", isolation_refresh_s=0.1, label_node=False, record_verifier=VERIFIER)
    return NodeManager(config, SimulatedBackend(build_cards(parse_spec("1xT4-16G"), node), None), Store(tmp / "meta.db"),
                       KubePodSource(str(cluster.cp.admin_kubeconfig)),
                       isolation=lambda r: (AdvancingSampler(gpus, r.owner), SignalActuator(r.groups, killpg=kernel.killpg)))


@pytest.mark.parametrize("value, policy", [("bs", Policy.BURST_SHARE), ("fixed-share", Policy.FIXED_SHARE)])
def test_policy_is_read_from_the_nodes_label(cluster, tmp_path, value, policy):
    node = f"iso-{uuid.uuid4().hex[:8]}"
    gpu_node(cluster.api, node, cards(1, node=node), {POLICY_LABEL: value})
    gpus = make_backend().gpus
    m = manager(cluster, tmp_path, node, gpus, SimKernel(FakeProc(tmp_path / "proc"), gpus))
    m.start()
    try:
        assert m.policy is policy
    finally:
        m.stop()
        m.store.close()


def test_a_bad_label_on_the_node_stops_the_start_with_label_and_value(cluster, tmp_path):
    node = f"iso-{uuid.uuid4().hex[:8]}"
    gpu_node(cluster.api, node, cards(1, node=node), {POLICY_LABEL: "guaranteed"})
    gpus = make_backend().gpus
    m = manager(cluster, tmp_path, node, gpus, SimKernel(FakeProc(tmp_path / "proc"), gpus))
    try:
        with pytest.raises(ValueError, match=rf"node label {POLICY_LABEL}: 'guaranteed' is not a known isolation policy"):
            m.start()
    finally:
        m.stop()
        m.store.close()


def test_memory_watchdog_writes_a_warning_event_on_the_offending_pod(cluster, ns, tmp_path):
    node = f"iso-{uuid.uuid4().hex[:8]}"
    gpu_node(cluster.api, node, cards(1, node=node))
    cluster.api.create_namespaced_pod(ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "greedy"},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}})
    cluster.api.patch_namespaced_pod_status("greedy", ns, {"status": {"phase": "Running", "containerStatuses": [{
        "name": "main", "containerID": f"containerd://{CID}", "image": "registry.k8s.io/pause:3.10", "imageID": "",
        "ready": True, "restartCount": 0, "state": {"running": {"startedAt": "2026-11-23T10:00:00Z"}}}]}})
    uid = cluster.api.read_namespaced_pod("greedy", ns).metadata.uid

    gpus = make_backend().gpus
    proc = FakeProc(tmp_path / "proc")
    kernel = SimKernel(proc, gpus)
    m = manager(cluster, tmp_path, node, gpus, kernel, override="be")
    m.store.record(Grant(uid, ns, "greedy", "main", RESOURCE, ("core-0-0",), 1),
                   [Share(uid, ns, "greedy", "main", 0, m.cards[0].uuid, 500, 2048, "normal", 1)])
    proc.add(101, cgroupfs(uid, CID), 101)
    gpus[0].spawn(101, 500, 4096)
    m.start()
    try:
        event = wait_for("the watchdog's Event", lambda: next(
            (e for e in events_for(cluster.api, ns, "greedy") if e["reason"] == "GPUMemoryQuotaExceeded"), None))
    finally:
        m.stop()
        m.store.close()
    assert event["type"] == "Warning" and event["involvedObject"]["uid"] == uid
    assert "4096 MiB" in event["message"] and "quota of 2048 MiB" in event["message"]
    assert kernel.signalled(101) == [signal.SIGCONT, signal.SIGTERM] and 101 not in gpus[0].processes


def test_a_node_the_api_does_not_know_stops_the_start_unless_the_flag_decides(cluster, tmp_path):
    from qgpu_runtime.node.manager import NodeUnreadable

    gpus = make_backend().gpus
    kernel = SimKernel(FakeProc(tmp_path / "proc"), gpus)
    m = manager(cluster, tmp_path / "a", "iso-missing", gpus, kernel)
    try:
        with pytest.raises(NodeUnreadable, match=rf"node iso-missing: cannot read its label {POLICY_LABEL}"):
            m.start()
    finally:
        m.stop()
        m.store.close()
    m = manager(cluster, tmp_path / "b", "iso-missing", gpus, kernel, override="fs")
    m.start()
    try:
        assert m.policy is Policy.FIXED_SHARE
    finally:
        m.stop()
        m.store.close()
