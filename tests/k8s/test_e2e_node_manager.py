"""`qgpu manager serve` against the real kube-apiserver (and, for placement, the real kube-scheduler
with qgpu's extender): node labels and inventory, Allocate from the pod's allocation record, the
matching rule for same-size pods, reconciliation after deletions while the manager was down,
`qgpu status` / `kubectl qgpu` reading the cluster, API failures, and the manager's ClusterRole."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from qgpu_runtime.extender.nodes import node_spec
from qgpu_runtime.placement.state import CardSpec
from tests.k8s.controlplane import ROOT, free_port, kubeconfig
from tests.k8s.kubeobjects import bound, events_for, gpu_pod, read_pod, record, wait_for
from tests.k8s.nodemanager import CORE, MEMORY, ManagedNode, bare_node, bind_with_record, read_node
from tests.k8s.rbac import kubeconfig_bound_to, template_cluster_role, unbind

NONE_SCHEDULER = "qgpu-test-nobody"  # pods the real scheduler must leave alone: the test binds them itself


@pytest.fixture
def managed(cluster, label) -> Iterator[Callable[..., ManagedNode]]:
    """Factory: a fresh node (API object + test kubelet + running manager, admin kubeconfig)."""
    nodes: list[ManagedNode] = []

    def make(spec: str = "2xT4-16G", start: bool = True, create: bool = True, extra_args: tuple[str, ...] = ()) -> ManagedNode:
        name = f"nm-{uuid.uuid4().hex[:8]}"
        if create:
            bare_node(cluster.api, name, label)
        node = ManagedNode(name, spec, cluster.cp.admin_kubeconfig, extra_args=extra_args)
        nodes.append(node)
        if start:
            node.start()
        return node

    yield make
    for node in nodes:
        node.close()


def pending_pod(name: str, core: int, memory_gib: int) -> dict[str, Any]:
    return gpu_pod(name, {CORE: core, MEMORY: memory_gib}, scheduler_name=NONE_SCHEDULER)


def assigned(pod: dict[str, Any]) -> list[str]:
    return json.loads(pod["metadata"]["annotations"].get("qgpu.io/assigned", "[]"))


# ---- (a) node labels and annotations ------------------------------------------------------------

def assigned_soon(cluster, ns: str, name: str, containers: list[str]) -> None:
    """``qgpu.io/assigned`` is written after Allocate returns (node/annotationwriter.py): it lands soon."""
    wait_for(f"pod {ns}/{name} annotated {containers}", lambda: assigned(read_pod(cluster.api, ns, name)) == containers,
             timeout=30)


def test_manager_publishes_gpu_labels_and_inventory_on_its_node(cluster, managed):
    node = managed("2xT4-16G")
    obj = read_node(cluster.api, node.name)
    labels, notes = obj["metadata"]["labels"], obj["metadata"]["annotations"]
    assert (labels["qgpu.io/gpu-count"], labels["qgpu.io/gpu-model"], labels["qgpu.io/gpu-memory-mib"]) == ("2", "T4", "16384")
    assert notes["qgpu.io/isolation-policy"] == "fixed-share"
    assert json.loads(notes["qgpu.io/gpus"]) == [
        {"index": c.index, "uuid": c.uuid, "model": "T4", "memory_mib": 16384, "healthy": True} for c in node.cards]
    # the extender reads it back as the manager's real cards
    assert node_spec(obj).cards == tuple(CardSpec(c.index, c.uuid, "T4", 16384) for c in node.cards)
    assert labels["kubernetes.io/hostname"] == node.name  # a merge patch, not a replacement


def test_node_object_created_after_the_manager_started_is_labelled_on_a_later_attempt(cluster, label, managed):
    node = managed("1xT4-16G", create=False)  # the manager serves kubelet even while its Node is missing
    wait_for("the failed node patch logged", lambda: "could not write GPU labels/annotations" in node.log())
    assert f'HTTP 404 nodes "{node.name}" not found' in node.log(), node.log()
    bare_node(cluster.api, node.name, label)
    wait_for("labels after the retry", lambda: read_node(cluster.api, node.name)["metadata"]["labels"].get("qgpu.io/gpu-count") == "1",
             timeout=60)


def test_card_gone_unhealthy_is_republished_and_leaves_placement(cluster, ns, managed):
    """The card leaves placement, and the pod holding a share of it gets a Warning Event saying so."""
    node = managed("2xT4-16G")
    cluster.api.create_namespaced_pod(ns, pending_pod("on-card-1", 30, 5))
    bind_with_record(cluster.api, ns, "on-card-1", node.name, [(1, node.cards[1].uuid, 300, 5120)], time.time_ns())
    node.kubelet.admit(read_pod(cluster.api, ns, "on-card-1"))
    node.control.write_text(json.dumps({"unhealthy": {"1": "XID 79"}}))
    obj = wait_for("card 1 unhealthy on the node", lambda: (n := read_node(cluster.api, node.name))
                   and not json.loads(n["metadata"]["annotations"]["qgpu.io/gpus"])[1]["healthy"] and n)
    card1 = json.loads(obj["metadata"]["annotations"]["qgpu.io/gpus"])[1]
    assert card1["reason"] == "XID 79"
    assert [c.index for c in node_spec(obj).cards] == [0]
    (event,) = wait_for("the pod's Event", lambda: [e for e in events_for(cluster.api, ns, "on-card-1")
                                                    if e["reason"] == "GPUCardUnhealthy"])
    assert event["type"] == "Warning" and "is unhealthy (XID 79)" in event["message"], event


# ---- (b) a pod placed by the real scheduler + extender is admitted with its record's cards -------

def test_pod_placed_by_scheduler_and_extender_gets_its_records_cards(cluster, ns, label, managed):
    node = managed("2xT4-16G")
    cluster.api.create_namespaced_pod(ns, gpu_pod("infer", {CORE: 30, MEMORY: 5}, selector=label))
    pod = bound(cluster.api, ns, "infer")
    rec = record(pod)
    assert rec is not None and rec.node == pod["spec"]["nodeName"] == node.name
    (share,) = rec.containers[0].shares
    assert share.uuid == node.cards[share.index].uuid  # the extender placed it on the inventory the manager published

    envs = node.kubelet.admit(pod)["c0"]
    assert envs["NVIDIA_VISIBLE_DEVICES"] == share.uuid
    assert (envs["QGPU_CORE_MILLI"], envs["QGPU_MEMORY_MIB"]) == ("300", "5120")
    assert (envs["QGPU_CLASS"], envs["QGPU_POLICY"]) == ("normal", "fixed-share")
    held = node.kubelet.held[(ns, "infer")]["c0"]
    assert all(d.startswith(f"qgpu-core-{share.index}-") for d in held[CORE])  # GetPreferredAllocation steered kubelet
    assigned_soon(cluster, ns, "infer", ["c0"])  # patched through the API, after Allocate returned
    assert node.grants() == [(ns, "infer", "c0", CORE), (ns, "infer", "c0", MEMORY)]


# ---- (c) several pending pods of the same size: bind order decides -----------------------------

def test_same_size_pending_pods_are_matched_in_bind_order_not_creation_or_name_order(cluster, ns, managed):
    node = managed("3xT4-16G")
    cards = node.cards
    for name in ("a", "b", "c"):  # created in name order ...
        cluster.api.create_namespaced_pod(ns, pending_pod(name, 50, 4))
    base = time.time_ns()
    plan = {"b": (base, 2), "a": (base + 1_000_000, 0), "c": (base + 2_000_000, 1)}  # ... bound b, a, c
    for name, (bind_time, card) in plan.items():
        bind_with_record(cluster.api, ns, name, node.name, [(card, cards[card].uuid, 500, 4096)], bind_time)
    pods = {name: read_pod(cluster.api, ns, name) for name in plan}

    # kubelet admits in bind order; Allocate does not name the pod, the matcher must find each one
    for name, (_, card) in plan.items():
        envs = node.kubelet.admit(pods[name])["c0"]
        assert envs["NVIDIA_VISIBLE_DEVICES"] == cards[card].uuid, f"pod {name} got another pod's card"
        assigned_soon(cluster, ns, name, ["c0"])
    assert {pod for _, pod, _, _ in node.grants()} == {"a", "b", "c"}


def test_allocate_with_no_matching_pod_is_refused_with_the_reason(cluster, ns, managed):
    node = managed("1xT4-16G")
    cluster.api.create_namespaced_pod(ns, pending_pod("small", 20, 2))
    bind_with_record(cluster.api, ns, "small", node.name, [(0, node.cards[0].uuid, 200, 2048)], time.time_ns())
    import grpc

    with pytest.raises(grpc.RpcError) as err:
        node.kubelet.allocate(CORE, [f"qgpu-core-0-{i}" for i in range(30)])  # 30 units: nobody asked for that
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{ns}/small: next container 'c0' asks for 20 {CORE}, kubelet sent 30" in err.value.details()


# ---- (d) reconciliation: a pod deleted while the manager is down --------------------------------

def test_pod_deleted_while_manager_is_down_is_released_at_next_start(cluster, ns, managed):
    node = managed("2xT4-16G")
    cards = node.cards
    for name, card in (("gone", 0), ("kept", 1)):
        cluster.api.create_namespaced_pod(ns, pending_pod(name, 40, 4))
        bind_with_record(cluster.api, ns, name, node.name, [(card, cards[card].uuid, 400, 4096)], time.time_ns())
        node.kubelet.admit(read_pod(cluster.api, ns, name))
    gone_uid = read_pod(cluster.api, ns, "gone")["metadata"]["uid"]
    assert {p for _, p, _, _ in node.grants()} == {"gone", "kept"}
    assert (node.root / "state" / "containers" / gone_uid).is_dir()

    assert node.stop() == 0
    cluster.api.delete_namespaced_pod("gone", ns, grace_period_seconds=0)
    wait_for("pod gone from the API", lambda: "gone" not in {p.metadata.name for p in cluster.api.list_namespaced_pod(ns).items})
    node.kubelet.forget(ns, "gone")  # kubelet drops the containers of a deleted pod
    node.start()

    assert {p for _, p, _, _ in node.grants()} == {"kept"}
    assert f"release pod {gone_uid}: pod no longer exists on this node" in node.log()
    assert not (node.root / "state" / "containers" / gone_uid).exists()
    # the released share is free again: a new pod with a record on card 0 is admitted there
    cluster.api.create_namespaced_pod(ns, pending_pod("next", 60, 8))
    bind_with_record(cluster.api, ns, "next", node.name, [(0, cards[0].uuid, 600, 8192)], time.time_ns())
    assert node.kubelet.admit(read_pod(cluster.api, ns, "next"))["c0"]["NVIDIA_VISIBLE_DEVICES"] == cards[0].uuid


# ---- (e) qgpu status / kubectl qgpu against the cluster -----------------------------------------

def run_cli(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_qgpu_status_and_kubectl_qgpu_show_node_cards_allocations_and_policy(cluster, ns, managed):
    node = managed("2xT4-16G")
    cards = node.cards
    cluster.api.create_namespaced_pod(ns, pending_pod("train", 30, 5))
    bind_with_record(cluster.api, ns, "train", node.name, [(1, cards[1].uuid, 300, 5120)], time.time_ns())
    node.kubelet.admit(read_pod(cluster.api, ns, "train"))
    # what is used: test_qgpu_status_reads_what_is_used_from_the_nodes_manager_through_the_pod_proxy
    kubeconfig_arg = ["--kubeconfig", str(cluster.cp.admin_kubeconfig), "--node", node.name, "--no-usage"]

    verify = ["--record-verify-key", str(node.root / "keys" / "record-verify.pub")]  # the key the manager runs with
    out = run_cli([sys.executable, "-m", "qgpu_runtime.cli", "status", *kubeconfig_arg, *verify, "--json"])
    assert out.returncode == 0, out.stderr
    (status,) = json.loads(out.stdout)["nodes"]
    assert (status["name"], status["policy"]) == (node.name, "fixed-share")
    assert [(c["index"], c["uuid"], c["model"], c["memory_mib"]) for c in status["cards"]] == [
        (c.index, c.uuid, "T4", 16384) for c in cards]
    assert status["cards"][0]["workloads"] == [] and status["cards"][0]["core_allocated_milli"] == 0
    assert status["cards"][1]["workloads"] == [{"name": f"{ns}/train", "core_milli": 300, "memory_mib": 5120, "klass": "normal",
                                                "unverified": False, "container": "c0", "used_core_pct": None,
                                                "used_memory_mib": None}]
    assert (status["cards"][1]["core_allocated_milli"], status["cards"][1]["memory_allocated_mib"]) == (300, 5120)

    table = run_cli([sys.executable, "-m", "qgpu_runtime.cli", "status", *kubeconfig_arg])
    assert table.returncode == 0, table.stderr
    header, row0, row1 = table.stdout.splitlines()
    assert header.split()[:4] == ["NODE", "POLICY", "CARD", "MODEL"]
    assert row0.split()[:5] == [node.name, "fixed-share", "0", "T4", "16384MiB"] and row0.endswith("-")
    assert row1.split() == [node.name, "fixed-share", "1", "T4", "16384MiB", "30%", "5120MiB", "-", f"{ns}/train(30%/5120MiB)"]

    # the console script, and kubectl finding it as a plugin on PATH
    plugin = Path(sys.executable).parent / "kubectl-qgpu"
    via_script = run_cli([str(plugin), "status", *kubeconfig_arg])
    assert via_script.returncode == 0 and via_script.stdout == table.stdout, via_script.stderr
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the plugin was checked as a console script only")
    via_kubectl = run_cli([kubectl, "qgpu", "status", *kubeconfig_arg],
                          env={"PATH": f"{plugin.parent}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert via_kubectl.returncode == 0 and via_kubectl.stdout == table.stdout, via_kubectl.stderr


def host_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None: the apiserver's
    pod proxy refuses loopback addresses, so a stand-in manager pod needs another one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def test_qgpu_status_reads_what_is_used_from_the_nodes_manager_through_the_pod_proxy(cluster, ns, managed, tmp_path):
    """A real manager serving /metrics, reached as the roles deploy it: a pod labelled qgpu-manager
    with a `metrics` port on the node, through the apiserver's pod proxy with the caller's own
    credentials. The pod object stands in for the DaemonSet's (no kubelet runs here): its IP is
    this host's, where the manager listens. A caller without pods/proxy still gets the allocations,
    and the reason the figures are missing."""
    address = host_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address: the apiserver's pod proxy refuses loopback")
    port = free_port()
    node = managed("2xT4-16G", extra_args=("--metrics-port", str(port)))
    cards = node.cards
    cluster.api.create_namespaced_pod(ns, pending_pod("train", 30, 5))
    bind_with_record(cluster.api, ns, "train", node.name, [(1, cards[1].uuid, 300, 5120)], time.time_ns())
    node.kubelet.admit(read_pod(cluster.api, ns, "train"))
    uid, cid = read_pod(cluster.api, ns, "train")["metadata"]["uid"], "f" * 64
    cluster.api.patch_namespaced_pod_status("train", ns, {"status": {
        "phase": "Running", "containerStatuses": [{"name": "c0", "containerID": f"containerd://{cid}", "image": "pause",
                                                   "imageID": "", "ready": True, "restartCount": 0}]}})
    node.control.write_text(json.dumps({"processes": [
        {"pid": 4242, "card_index": 1, "memory_mib": 1800, "sm_util_pct": 12, "cgroup": f"0::/kubepods/pod{uid}/{cid}"},
        {"pid": 4343, "card_index": 0, "memory_mib": 300, "sm_util_pct": 4, "cgroup": "0::/user.slice/someone"}]}))
    cluster.api.create_namespaced_pod(ns, {
        "metadata": {"name": "manager", "labels": {"app.kubernetes.io/name": "qgpu-manager"}},
        "spec": {"nodeName": node.name, "containers": [{"name": "manager", "image": "pause",
                                                        "ports": [{"name": "metrics", "containerPort": port}]}]}})
    cluster.api.patch_namespaced_pod_status("manager", ns, {"status": {
        "phase": "Running", "podIP": address, "podIPs": [{"ip": address}]}})
    argv = [sys.executable, "-m", "qgpu_runtime.cli", "status", "--node", node.name, "--manager-namespace", ns, "--json"]

    def status(kubeconfig: Path) -> dict[str, Any]:
        out = run_cli([*argv, "--kubeconfig", str(kubeconfig)])
        assert out.returncode == 0, out.stderr
        (got,) = json.loads(out.stdout)["nodes"]
        return got

    def used() -> bool:
        got = status(cluster.cp.admin_kubeconfig)
        return got["cards"][1]["workloads"][0]["used_memory_mib"] == 1800 and got["cards"][0]["memory_used_mib"] == 300
    wait_for("qgpu status shows the manager's sample", used, timeout=30)
    got = status(cluster.cp.admin_kubeconfig)
    assert got["usage_error"] == ""
    assert [(c["index"], c["util_pct"], c["memory_used_mib"]) for c in got["cards"]] == [(0, 4, 300), (1, 12, 1800)]
    (train,) = got["cards"][1]["workloads"]
    assert (train["name"], train["container"], train["used_core_pct"], train["used_memory_mib"]) == (f"{ns}/train", "c0", 12, 1800)
    table = run_cli([*argv[:-1], "--kubeconfig", str(cluster.cp.admin_kubeconfig)])
    assert f"{ns}/train(30%/5120MiB,used 12%/1800MiB)" in table.stdout, table.stdout

    # the same as a user who may list pods and nodes, and nothing else: allocations, and why no figures
    reader = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {},
              "rules": [{"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["list"]}]}
    name = f"status-reader-{uuid.uuid4().hex[:6]}"
    try:
        limited = status(kubeconfig_bound_to(cluster, reader, name, tmp_path / "reader.kubeconfig"))
    finally:
        unbind(cluster, name)
    assert limited["cards"][1]["core_allocated_milli"] == 300 and limited["cards"][1]["memory_used_mib"] is None
    assert "HTTP 403" in limited["usage_error"] and "pods/proxy" in limited["usage_error"], limited["usage_error"]


def test_qgpu_status_lists_pending_gpu_pods_with_the_schedulers_reason(cluster, ns):
    """A GPU pod no node runs is listed with PodScheduled's reason, or its gates; with --node only
    nodes are shown."""
    gated = {**pending_pod("gated", 40, 4), "metadata": {"name": "gated"}}
    gated["spec"]["schedulingGates"] = [{"name": "example.com/wait"}]
    cluster.api.create_namespaced_pod(ns, gated)
    cluster.api.create_namespaced_pod(ns, {"metadata": {"name": "cpu-only"}, "spec": {"schedulingGates": [{"name": "example.com/wait"}],
                                                                                     "containers": [{"name": "c", "image": "x"}]}})
    out = run_cli([sys.executable, "-m", "qgpu_runtime.cli", "status", "--kubeconfig", str(cluster.cp.admin_kubeconfig), "--json"])
    assert out.returncode == 0, out.stderr
    mine = [p for p in json.loads(out.stdout)["pending"] if p["name"].startswith(f"{ns}/")]
    assert mine == [{"name": f"{ns}/gated", "asks": "tke.cloud.tencent.com/qgpu-core=40, tke.cloud.tencent.com/qgpu-memory=4",
                     "reason": "SchedulingGated", "message": "gates: example.com/wait"}]
    table = run_cli([sys.executable, "-m", "qgpu_runtime.cli", "status", "--kubeconfig", str(cluster.cp.admin_kubeconfig)])
    assert table.returncode == 0 and any(line.startswith(f"{ns}/gated ") for line in table.stdout.splitlines()), table.stdout
    only_node = run_cli([sys.executable, "-m", "qgpu_runtime.cli", "status", "--kubeconfig", str(cluster.cp.admin_kubeconfig),
                         "--node", "no-such-node", "--json"])
    assert json.loads(only_node.stdout)["pending"] == []


def test_qgpu_status_names_an_unreachable_apiserver(tmp_path, cluster):
    cfg = broken_kubeconfig(tmp_path, cluster, free_port())
    out = run_cli([sys.executable, "-m", "qgpu_runtime.cli", "status", "--kubeconfig", str(cfg)])
    assert out.returncode == 1
    assert out.stderr.startswith("qgpu status: listing nodes at https://127.0.0.1:") and "Traceback" not in out.stderr, out.stderr


# ---- API failures: retry with a clear log, or exit with a clear error ----------------------------

def broken_kubeconfig(tmp_path: Path, cluster, port: int) -> Path:
    """The admin kubeconfig pointed at a port where no apiserver listens (the shared one keeps running)."""
    cp = cluster.cp
    path = tmp_path / "wrong-port.kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig(f"https://127.0.0.1:{port}", cp.ca.cert_path, cp.admin, "admin")))
    return path


def test_manager_waits_for_an_unreachable_apiserver_with_a_clear_log_and_stops_on_sigterm(tmp_path, cluster, managed):
    node = managed("1xT4-16G", start=False)
    port = free_port()
    proc = node.spawn(broken_kubeconfig(tmp_path, cluster, port))
    wait_for("two retry warnings", lambda: node.log().count("start-up reconciliation:") >= 2, timeout=60)
    assert proc.poll() is None, node.log()
    log = node.log()
    assert (f"listing the pods of node {node.name} at https://127.0.0.1:{port} after 3 attempts" in log
            and "kubelet is not served until the pods" in log), log
    assert "Traceback" not in log, log
    assert node.kubelet.registrations == []  # nothing served while the store cannot be reconciled
    assert node.stop() == 0
    assert "stopped before the pods of node" in node.log()


def test_manager_without_permission_exits_with_the_apiservers_reason(tmp_path, cluster, managed):
    node = managed("1xT4-16G", start=False)
    cp = cluster.cp
    nobody = cp.ca.issue("nobody", "qgpu-test-nobody", client=True)
    cfg = tmp_path / "nobody.kubeconfig"
    cfg.write_text(yaml.safe_dump(kubeconfig(cp.server, cp.ca.cert_path, nobody, "nobody")))
    proc = node.spawn(cfg)
    assert proc.wait(60) == 1, node.log()
    log = node.log()
    assert "cannot start: listing the pods of node" in log and "HTTP 403" in log, log
    assert 'User "qgpu-test-nobody" cannot list resource "pods"' in log, log
    assert "Traceback" not in log and "after 3 attempts" not in log, log  # forbidden is not retried


def test_manager_with_a_missing_kubeconfig_exits_naming_it(tmp_path, managed):
    node = managed("1xT4-16G", start=False)
    proc = node.spawn(tmp_path / "nope.kubeconfig")
    assert proc.wait(60) == 2
    assert f"--kubeconfig {tmp_path / 'nope.kubeconfig'}" in node.log() and "Traceback" not in node.log(), node.log()


# ---- RBAC: the ClusterRole the deployment template grants is enough, and no more is used -----------

def test_manager_works_with_exactly_the_clusterrole_of_its_template(tmp_path, cluster, ns, managed):
    role = template_cluster_role("qgpu-manager.yaml.j2", qgpu_manager_namespace="qgpu-system",
                                 qgpu_manager_isolation_policies=[])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "patch"]},
                             {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
                             {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
                             {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    cfg = kubeconfig_bound_to(cluster, role, f"qgpu-manager-{ns}", tmp_path / "manager.kubeconfig")

    node = managed("1xT4-16G", start=False)
    node.resources = (*node.resources, "nvidia.com/gpu")  # HAMi's pods come here: the share sizes are published
    # start-up reconciliation lists this pod; Allocate serves it and patches qgpu.io/assigned
    cluster.api.create_namespaced_pod(ns, pending_pod("p", 20, 2))
    bind_with_record(cluster.api, ns, "p", node.name, [(0, node.cards[0].uuid, 200, 2048)], time.time_ns())
    node.start(kubeconfig=cfg)
    assert read_node(cluster.api, node.name)["metadata"]["labels"]["qgpu.io/gpu-count"] == "1"
    capacity = cluster.api.read_node_status(node.name).status.capacity  # HAMi's share sizes (node/nodeinfo.py)
    assert {k: capacity.get(k) for k in ("nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores")} == \
        {"nvidia.com/gpumem": str(node.cards[0].memory_mib), "nvidia.com/gpumem-percentage": "100", "nvidia.com/gpucores": "100"}
    assert node.kubelet.admit(read_pod(cluster.api, ns, "p"))["c0"]["NVIDIA_VISIBLE_DEVICES"] == node.cards[0].uuid
    assigned_soon(cluster, ns, "p", ["c0"])
    # an HTTP 403 in the log, not the milliseconds of a timestamp (",403")
    assert not re.search(r"(?<![,\d])403\b", node.log()) and "could not" not in node.log(), node.log()
