"""playbooks/node-pool-rollout.yml against the real control plane of tests/k8s (issue 6).

Four fake GPU nodes (two V100 training nodes, two T4 inference nodes, the example inventory's pool
group vars copied verbatim) are rolled with the fixture's admin kubeconfig. Every inventory host
is this machine (ansible_connection=local) with its own sandbox root, driven by the variables the
roles' molecule scenarios use: files land under the host's qgpu_root_prefix, the GPU, driver and
CUDA probes read a fixture tree at `<prefix>-probe`, no package manager and no init system run.

There is no kubelet: the pods on the nodes are created bound (spec.nodeName) with
terminationGracePeriodSeconds 0, so an eviction deletes them at once. Ordinary pods belong to a
ReplicaSet, one pod per node to a DaemonSet (both real objects; no controller-manager runs, so
neither creates pods of its own).

What the rollout did is read back from the apiserver — node specs and labels, the pods left, and
the order in which nodes were cordoned and uncordoned as a watch on the nodes saw it — and from
the play output.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from ansible_tools import REPO, Run, ansible_playbook, expected_pool_labels
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.k8s.conftest import Cluster
from tests.k8s.kubeobjects import PAUSE, cards, gpu_node

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "inventories" / "example"
PLAYBOOK = "playbooks/node-pool-rollout.yml"
POOLS = {"qgpu_pool_training": "V100", "qgpu_pool_inference": "T4"}
PCI_DEVICE_IDS = {"V100": "0x1db4", "T4": "0x1eb8"}
SENTINEL = "qgpu-test/rollout-watch-done"


@dataclass
class NodeWatch:
    """Every change of spec.unschedulable of the test's nodes, in the order the apiserver sent it."""

    cluster: Cluster
    selector: str
    count: int  # nodes the selector matches: the watch is ready once it has listed them all
    transitions: list[tuple[str, bool]] = field(default_factory=list)
    seen_sentinel: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._token = uuid.uuid4().hex
        self._watch = watch.Watch()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the node watch did not list the nodes"

    def _run(self) -> None:
        try:
            self._follow()
        except Exception:  # noqa: BLE001 - a watch cut after stop(); before it, stop() finds no sentinel
            if not self._stopping.is_set():
                raise

    def _follow(self) -> None:
        state: dict[str, bool] = {}
        for event in self._watch.stream(self.cluster.api.list_node, label_selector=self.selector, timeout_seconds=900):
            node = event["object"]
            if (node.metadata.annotations or {}).get(SENTINEL) == self._token:
                self.seen_sentinel.set()
            unschedulable = bool(node.spec.unschedulable)
            if node.metadata.name not in state:  # the initial ADDED events
                state[node.metadata.name] = unschedulable
                if len(state) == self.count:
                    self._ready.set()
                continue
            if state[node.metadata.name] != unschedulable:
                state[node.metadata.name] = unschedulable
                self.transitions.append((node.metadata.name, unschedulable))

    def stop(self, any_node: str) -> list[tuple[str, bool]]:
        """Waits until the watch has delivered everything up to now (an annotation written after
        the run comes back through it), then stops it."""
        self.cluster.api.patch_node(any_node, {"metadata": {"annotations": {SENTINEL: self._token}}})
        assert self.seen_sentinel.wait(60), "the node watch never delivered the sentinel annotation"
        self._stopping.set()
        self._watch.stop()
        return self.transitions


@dataclass
class Fleet:
    """One set of fake GPU nodes, its pods and the inventory that rolls them."""

    cluster: Cluster
    work: Path
    label: dict[str, str]
    namespace: str
    pools: dict[str, list[str]]

    @property
    def inventory(self) -> Path:
        return self.work / "inventory"

    @property
    def nodes(self) -> list[str]:
        """In inventory order, which is the order the serial batches take them."""
        return [name for names in self.pools.values() for name in names]

    def pool_of(self, node: str) -> str:
        return next(pool for pool, names in self.pools.items() if node in names)

    def node(self, name: str) -> dict[str, Any]:
        return json.loads(self.cluster.api.read_node(name, _preload_content=False).data)

    def pods_on(self, node: str) -> list[str]:
        pods = self.cluster.api.list_namespaced_pod(self.namespace, field_selector=f"spec.nodeName={node}").items
        return sorted(p.metadata.name for p in pods)

    def roll(self, *extra: str) -> tuple[Run, list[tuple[str, bool]]]:
        selector = ",".join(f"{k}={v}" for k, v in self.label.items())
        node_watch = NodeWatch(self.cluster, selector, len(self.nodes))
        run = ansible_playbook("-i", str(self.inventory), PLAYBOOK, *extra)
        (self.work / "rollout.log").write_text(run.output)  # kept by pytest's tmp_path for a failed run
        return run, node_watch.stop(self.nodes[0])


def make_fleet(cluster: Cluster, work: Path, *, training: int = 2, wrong_gpu: int | None = None) -> Fleet:
    """`training` V100 nodes then two T4 nodes, their pods and the inventory. `wrong_gpu`: the
    probe tree of the node at that index holds a T4 although its pool (training) allows V100
    only, so its preflight cannot pass."""
    suffix = uuid.uuid4().hex[:6]
    label = {"qgpu-test": f"rollout-{suffix}"}
    sizes = {"qgpu_pool_training": training, "qgpu_pool_inference": 2}
    pools = {pool: [f"rollout-{suffix}-{model.lower()}-{i}" for i in range(sizes[pool])] for pool, model in POOLS.items()}
    fleet = Fleet(cluster, work, label, namespace_for(cluster, suffix), pools)
    for pool, model in POOLS.items():
        for name in pools[pool]:
            gpu_node(cluster.api, name, cards(2, model, 32768 if model == "V100" else 16384, node=name), labels=label)
    create_workloads(fleet)
    root = work / "roots"
    write_inventory(fleet, root)
    for index, name in enumerate(fleet.nodes):
        model = "T4" if index == wrong_gpu else POOLS[fleet.pool_of(name)]
        write_probe_tree(root / f"{name}-probe", model)
    return fleet


def namespace_for(cluster: Cluster, suffix: str) -> str:
    """A namespace the qgpu webhooks skip, should test_k8s_half's fail-closed webhook be live."""
    name = f"rollout-{suffix}"
    cluster.api.create_namespace({"apiVersion": "v1", "kind": "Namespace",
                                  "metadata": {"name": name, "labels": {"qgpu.io/webhook": "disabled"}}})
    return name


def create_workloads(fleet: Fleet) -> None:
    """On every node: one pod of a ReplicaSet (drain evicts it) and one of a DaemonSet (drain
    leaves it, ignore_daemonsets)."""
    apps = client.AppsV1Api(fleet.cluster.api_client)
    template = {"metadata": {"labels": {"app": "work"}},
                "spec": {"containers": [{"name": "c", "image": PAUSE}], "terminationGracePeriodSeconds": 0}}
    selector = {"matchLabels": {"app": "work"}}
    owners = {
        "ReplicaSet": apps.create_namespaced_replica_set(fleet.namespace, {
            "apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": "work"},
            "spec": {"replicas": len(fleet.nodes), "selector": selector, "template": template}}),
        "DaemonSet": apps.create_namespaced_daemon_set(fleet.namespace, {
            "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "agent"},
            "spec": {"selector": selector, "template": template}}),
    }
    for node in fleet.nodes:
        for kind, owner in owners.items():
            fleet.cluster.api.create_namespaced_pod(fleet.namespace, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{owner.metadata.name}-{node}", "labels": {"app": "work"},
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": kind, "name": owner.metadata.name,
                                                  "uid": owner.metadata.uid, "controller": True}]},
                "spec": {**template["spec"], "nodeName": node}})


def write_inventory(fleet: Fleet, root: Path) -> None:
    inventory = fleet.inventory
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "host_vars").mkdir()
    hosts = {"all": {"children": {
        "qgpu_standalone": {"hosts": {}},
        "qgpu_kube_api": {"hosts": {"localhost": None}},
        "qgpu_gpu_nodes": {"children": {pool: {"hosts": {h: None for h in names}} for pool, names in fleet.pools.items()}},
    }}}
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    probe = "{{ qgpu_root_prefix }}-probe"
    (inventory / "group_vars" / "all.yml").write_text(yaml.safe_dump({
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "qgpu_kubeconfig": str(fleet.cluster.cp.admin_kubeconfig),
        # The sandbox of the molecule scenarios: a simulated TencentOS 3.1 GPU node whose probes
        # read a fixture tree, files only (no dnf, no services, no reboot).
        "gpu_preflight_probe_root": probe,
        # This machine is not TencentOS; the sandbox host declares its own OS supported.
        "gpu_preflight_supported_os": "{{ {ansible_facts.distribution: [ansible_facts.distribution_major_version]} }}",
        "nvidia_driver_probe_root": probe,
        "nvidia_driver_platform": {"distribution": "TencentOS", "major_version": "3", "architecture": "x86_64"},
        "nvidia_driver_manage_packages": False,
        "nvidia_driver_manage_services": False,
        "cuda_toolkit_probe_root": probe,
        "cuda_toolkit_platform": {"distribution": "TencentOS", "major_version": "3", "architecture": "x86_64"},
        "cuda_toolkit_manage_packages": False,
        "nvidia_container_toolkit_probe_root": probe,
        "nvidia_container_toolkit_platform": {"distribution": "TencentOS", "major_version": "3"},
        "nvidia_container_toolkit_manage_packages": False,
        "nvidia_container_toolkit_manage_services": False,
        # One wheel for every host, built once into the fleet's work dir.
        "qgpu_runtime_build_dir": str(fleet.work / "wheels"),
        "qgpu_runtime_python": "{{ ansible_playbook_python }}",
        "qgpu_runtime_install_dependencies": False,
    }, sort_keys=False))
    for name in fleet.nodes:
        (inventory / "host_vars" / f"{name}.yml").write_text(yaml.safe_dump({"qgpu_root_prefix": str(root / name)}))
    for pool in fleet.pools:  # the example's pool settings, verbatim
        shutil.copy(EXAMPLE / "group_vars" / f"{pool}.yml", inventory / "group_vars" / f"{pool}.yml")


def write_probe_tree(probe: Path, model: str) -> None:
    """What gpu_preflight reads on a provisioned node: one GPU of `model` on the PCI bus, driver
    450.102.04 loaded, CUDA 11.3, nvidia-container-cli, /dev/nvidia-uvm, and the kernel headers."""
    files = {
        "sys/bus/pci/devices/0000:3b:00.0/vendor": "0x10de\n",
        "sys/bus/pci/devices/0000:3b:00.0/class": "0x030200\n",
        "sys/bus/pci/devices/0000:3b:00.0/device": PCI_DEVICE_IDS[model] + "\n",
        "sys/module/nvidia/version": "450.102.04\n",
        "usr/local/cuda-11.3/version.json": '{"cuda": {"name": "CUDA SDK", "version": "11.3.1"}}',
        "usr/bin/nvidia-container-cli": "#!/bin/sh\n",
        "dev/nvidia-uvm": "",
    }
    for relative, content in files.items():
        (probe / relative).parent.mkdir(parents=True, exist_ok=True)
        (probe / relative).write_text(content)
    (probe / "usr/src/kernels" / platform.release()).mkdir(parents=True)


def task_events(run: Run, tasks: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(task, status, host) for every host line of the named tasks, in output order."""
    events: list[tuple[str, str, str]] = []
    current = None
    for line in run.output.splitlines():
        if line.startswith("TASK ["):
            current = next((t for t in tasks if line.startswith(f"TASK [{t}")), None)
        elif current:
            match = re.match(r"^(ok|changed|skipping|failed|fatal): \[([^\]\s]+)", line)
            if match:
                events.append((current, match.group(1), match.group(2)))
    return events


def grouped(events: list[tuple[str, str, str]]) -> list[tuple[str, set[str]]]:
    """Consecutive events of one task merged: (task, hosts). Hosts of one batch finish a task in
    any order; batches follow each other."""
    groups: list[tuple[str, set[str]]] = []
    for task, _, host in events:
        if groups and groups[-1][0] == task:
            groups[-1][1].add(host)
        else:
            groups.append((task, {host}))
    return groups


def pool_labels(fleet: Fleet, node: str) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """(the node's qgpu labels, what its pool's group vars ask for)."""
    expected = expected_pool_labels(yaml.safe_load((fleet.inventory / "group_vars" / f"{fleet.pool_of(node)}.yml").read_text()))
    labels = fleet.node(node)["metadata"]["labels"]
    return {key: labels.get(key) for key in expected}, expected


def cleanup(fleet: Fleet) -> None:
    for name in fleet.nodes:
        try:
            fleet.cluster.api.delete_node(name)
        except ApiException as exc:
            if exc.status != 404:
                raise
    fleet.cluster.api.delete_namespace(fleet.namespace)


# -- a rollout that succeeds, two nodes per batch ------------------------------------------------


@dataclass
class Rolled:
    fleet: Fleet
    run: Run
    transitions: list[tuple[str, bool]]


@pytest.fixture(scope="module")
def rolled(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rolled]:
    fleet = make_fleet(cluster, tmp_path_factory.mktemp("rollout"))
    run, transitions = fleet.roll("-e", "qgpu_rollout_batch=2")
    yield Rolled(fleet, run, transitions)
    cleanup(fleet)


def test_the_rollout_succeeds(rolled: Rolled) -> None:
    assert rolled.run.returncode == 0, rolled.run.output[-6000:]


def test_batches_are_serial_as_the_apiserver_saw_them(rolled: Rolled) -> None:
    """Each node is cordoned once and uncordoned once, and the second batch is only cordoned
    after both nodes of the first are schedulable again."""
    nodes = rolled.fleet.nodes
    first, second = set(nodes[:2]), set(nodes[2:])
    transitions = rolled.transitions
    assert sorted(transitions) == sorted([(n, True) for n in nodes] + [(n, False) for n in nodes]), transitions
    assert {n for n, _ in transitions[:4]} == first, transitions
    assert [u for _, u in transitions[:4]].count(False) == 2 and transitions[3][1] is False, transitions
    assert {n for n, _ in transitions[4:]} == second, transitions


def test_batches_are_serial_in_the_play_output(rolled: Rolled) -> None:
    nodes = rolled.fleet.nodes
    events = task_events(rolled.run, ("Cordon the node", "Drain the node", "Uncordon the node"))
    assert all(status == "changed" for _, status, _ in events), events
    first, second = set(nodes[:2]), set(nodes[2:])
    assert grouped(events) == [("Cordon the node", first), ("Drain the node", first), ("Uncordon the node", first),
                               ("Cordon the node", second), ("Drain the node", second), ("Uncordon the node", second)]
    assert rolled.run.output.count("PLAY [Roll the GPU node pools]") == 2


def test_notified_handlers_run_before_the_node_is_uncordoned(rolled: Rolled) -> None:
    """containerd restarts with the nvidia runtime (and the initramfs is rebuilt) before pods may
    come back: in each batch the handlers run between the last role and the uncordon."""
    lines = rolled.run.output.splitlines()
    headers = [line.split(" ***")[0] for line in lines if line.startswith(("TASK [", "RUNNING HANDLER ["))]
    restart = "RUNNING HANDLER [nvidia_container_toolkit : Restart containerd]"
    uncordon = "TASK [Uncordon the node]"
    order = [h for h in headers if h in (restart, uncordon, "TASK [Cordon the node]")]
    assert order == ["TASK [Cordon the node]", restart, uncordon] * 2, order


def test_every_node_ends_uncordoned_and_labelled_as_its_pool_says(rolled: Rolled) -> None:
    for name in rolled.fleet.nodes:
        assert not rolled.fleet.node(name)["spec"].get("unschedulable"), name
        actual, expected = pool_labels(rolled.fleet, name)
        assert actual == expected, name


def test_ordinary_pods_were_evicted_and_daemonset_pods_left(rolled: Rolled) -> None:
    assert {n: rolled.fleet.pods_on(n) for n in rolled.fleet.nodes} == {n: [f"agent-{n}"] for n in rolled.fleet.nodes}


def test_every_node_was_provisioned_in_its_own_sandbox(rolled: Rolled) -> None:
    root = rolled.fleet.work / "roots"
    for name in rolled.fleet.nodes:
        plan = json.loads((root / name / "var/lib/qgpu/provisioning/nvidia_driver.json").read_text())
        assert plan["install"] is True and plan["gpus"] == ["0000:3b:00.0"], name
        assert (root / name / "opt/qgpu/installed.json").is_file(), name


def changed_tasks(run: Run) -> dict[str, set[str]]:
    """task header -> hosts reported `changed` in it."""
    changed: dict[str, set[str]] = {}
    task = ""
    for line in run.output.splitlines():
        if line.startswith(("TASK [", "RUNNING HANDLER [")):
            task = line.split(" ***")[0]
        elif match := re.match(r"^changed: \[([^\]\s]+)", line):
            changed.setdefault(task, set()).add(match.group(1))
    return changed


def test_a_second_rollout_changes_nothing_but_the_cordon(rolled: Rolled) -> None:
    """Runs last in its group on purpose: it rolls the fleet again."""
    again, transitions = rolled.fleet.roll("-e", "qgpu_rollout_batch=2")
    assert again.returncode == 0, again.output[-6000:]
    nodes = set(rolled.fleet.nodes)
    assert changed_tasks(again) == {"TASK [Cordon the node]": nodes, "TASK [Uncordon the node]": nodes}, again.output[-6000:]
    assert sorted(transitions) == sorted([(n, True) for n in nodes] + [(n, False) for n in nodes])


# -- a rollout that fails: batches of two, a node of the second batch cannot pass its preflight ----


@dataclass
class Stopped:
    fleet: Fleet
    run: Run
    transitions: list[tuple[str, bool]]
    before: dict[str, dict[str, Any]]

    @property
    def batches(self) -> tuple[list[str], list[str], list[str]]:
        """(done, the batch that failed, not started): nodes [0, 1], [2, 3] and [4]."""
        nodes = self.fleet.nodes
        return nodes[:2], nodes[2:4], nodes[4:]


FAILING = 2  # v100-2: a training node whose probe tree holds a T4, first of the second batch


@pytest.fixture(scope="module")
def stopped(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stopped]:
    fleet = make_fleet(cluster, tmp_path_factory.mktemp("rollout-fail"), training=3, wrong_gpu=FAILING)
    before = {name: fleet.node(name) for name in fleet.nodes}
    run, transitions = fleet.roll("-e", "qgpu_rollout_batch=2")  # the failure budget: its default, 0
    yield Stopped(fleet, run, transitions, before)
    cleanup(fleet)


def test_a_failed_node_fails_the_play_with_a_clear_message(stopped: Stopped) -> None:
    failing = stopped.fleet.nodes[FAILING]
    assert stopped.run.returncode != 0, stopped.run.output[-6000:]
    message = (f'qgpu rollout: node {failing} failed in "Stop on failed preflight checks (enforce mode)" and stays '
               "cordoned (spec.unschedulable=true); nothing more runs on it. Cause: gpu_models: found ['T4']; "
               "allowed models: V100 (unknown PCI device ids can be mapped in gpu_preflight_pci_models). "
               "Failure budget qgpu_rollout_max_fail_percentage=0% of a batch: no later batch starts; "
               f"not yet rolled: {stopped.batches[2][0]}. Fix the cause and run the rollout again.")
    assert message in stopped.run.output, stopped.run.output[-6000:]


def test_the_batch_before_the_failure_completed(stopped: Stopped) -> None:
    done = stopped.batches[0]
    for name in done:
        assert not stopped.fleet.node(name)["spec"].get("unschedulable"), name
        actual, expected = pool_labels(stopped.fleet, name)
        assert actual == expected, name
        assert stopped.fleet.pods_on(name) == [f"agent-{name}"], name
    assert sorted(stopped.transitions[:4]) == sorted((n, flag) for n in done for flag in (True, False)), stopped.transitions


def test_the_failed_node_stays_cordoned_drained_and_unlabelled(stopped: Stopped) -> None:
    failing = stopped.fleet.nodes[FAILING]
    assert stopped.fleet.node(failing)["spec"].get("unschedulable") is True
    assert stopped.fleet.pods_on(failing) == [f"agent-{failing}"]
    # The pool labels come last, after every install and check.
    assert pool_labels(stopped.fleet, failing)[0]["qgpu-device-enable"] is None


def test_the_other_node_of_the_failed_batch_finished_its_rollout(stopped: Stopped) -> None:
    """The failed node's rescue runs once its batch mates are through the block (linear
    strategy), so they end uncordoned and labelled before the budget stops the play."""
    failing = stopped.fleet.nodes[FAILING]
    (mate,) = [n for n in stopped.batches[1] if n != failing]
    assert not stopped.fleet.node(mate)["spec"].get("unschedulable")
    actual, expected = pool_labels(stopped.fleet, mate)
    assert actual == expected
    assert stopped.fleet.pods_on(mate) == [f"agent-{mate}"]
    assert sorted(stopped.transitions[4:]) == sorted([(failing, True), (mate, True), (mate, False)]), stopped.transitions


def test_the_later_batch_is_not_touched(stopped: Stopped) -> None:
    for name in stopped.batches[2]:
        node = stopped.fleet.node(name)
        assert node["metadata"]["resourceVersion"] == stopped.before[name]["metadata"]["resourceVersion"], name
        assert not node["spec"].get("unschedulable"), name
        assert stopped.fleet.pods_on(name) == [f"agent-{name}", f"work-{name}"], name
        assert not (stopped.fleet.work / "roots" / name).exists(), name
        assert not re.search(rf"^\w+: \[{re.escape(name)}[\] ]", stopped.run.output, re.M), stopped.run.output[-6000:]
