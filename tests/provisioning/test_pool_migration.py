"""One pool moved from device-plugin to dra and back, as docs/dra.md "Migrating a pool between
the modes" says, against the real control plane of tests/k8s (issue 13 §6).

Two fake T4 nodes form the example inventory's inference pool (its group vars copied, then only
`qgpu_pool_mode` edited), sandboxed as in test_rollout.py: every inventory host is this machine
with its own root, the pods on the nodes belong to a real ReplicaSet and DaemonSet. Each way runs
playbooks/cluster.yml and playbooks/node-pool-rollout.yml (and on the way back cluster.yml once
more). The rollout in dra mode runs a second time, to show it changes nothing but the cordon; the
other repeats are each mode's own tests' (test_rollout.py: a second device-plugin rollout;
test_k8s_dra.py: a second cluster run with a dra pool; test_k8s_half.py: a second cluster run with
device-plugin pools only, the state the way back ends in), not run again here.

No controller-manager runs, so which qgpu manager DaemonSet a node gets is decided here the way the
DaemonSet controller decides it: the DaemonSet's nodeSelector and required node affinity evaluated
against the live Node. What the playbooks did is read back from the apiserver (labels, cordons seen
by a watch, pods left, DaemonSets, DeviceClasses) and from each node's sandbox (the CDI drop-in).
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from ansible_tools import Run, ansible_playbook
from kubernetes import client
from kubernetes.dynamic import DynamicClient
from test_k8s_half import NAMESPACE, delete_webhook_configurations, live_object
from test_rollout import (
    Fleet,
    NodeWatch,
    changed_tasks,
    create_workloads,
    namespace_for,
    task_events,
    write_inventory,
    write_probe_tree,
)

from qgpu_runtime.contract import dra, names
from tests.k8s.conftest import Cluster
from tests.k8s.controlplane import ADMIN_USER
from tests.k8s.kubeobjects import cards, gpu_node

# The module's fixture runs seven playbooks against a control plane before its first test: 662–928 s
# on the 2-core VM beside two other workers, past the suite's 900 s per test (pyproject.toml).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

POOL = "qgpu_pool_inference"  # burst-share, T4: the example's pool settings
POLICY = "burst-share"
CLUSTER = "playbooks/cluster.yml"
ROLLOUT = "playbooks/node-pool-rollout.yml"
DEVICE_CLASSES = {c["metadata"]["name"] for c in dra.device_classes()}
DRA_RBAC = (("ServiceAccount", "v1", NAMESPACE), ("ClusterRole", "rbac.authorization.k8s.io/v1", None),
            ("ClusterRoleBinding", "rbac.authorization.k8s.io/v1", None))
CDI_DROPIN = "etc/containerd/conf.d/90-qgpu-cdi.toml"


@dataclass
class Snapshot:
    """What the cluster and the sandboxes hold after one playbook run."""

    run: Run
    modes: dict[str, str | None]
    managers: dict[str, set[str]]  # node -> the qgpu manager DaemonSets that select it
    unschedulable: dict[str, bool]
    pods: dict[str, list[str]]
    cdi_dropin: dict[str, bool]
    daemonsets: set[str]
    device_classes: set[str]
    dra_rbac: set[str]
    dra_exclusion: dict[str, bool]  # device-plugin DaemonSet -> whether its affinity names qgpu.io/pool-mode
    admission_resources: set[str]  # what the manager's admission policy holds writes of
    transitions: list[tuple[str, bool]] = field(default_factory=list)  # cordons seen during a rollout


@dataclass
class Migration:
    fleet: Fleet
    steps: dict[str, Snapshot]


def requirement_holds(requirement: dict[str, Any], value: str | None) -> bool:
    operator, values = requirement["operator"], requirement.get("values") or []
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    raise AssertionError(f"operator {operator!r} is not evaluated by this test")


def selects(daemonset: dict[str, Any], node: dict[str, Any]) -> bool:
    """Whether the DaemonSet controller would run the DaemonSet's pod on the node (nodeSelector and
    requiredDuringScheduling node affinity; the nodes carry no taints)."""
    spec = daemonset["spec"]["template"]["spec"]
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    fields = {"metadata.name": node["metadata"]["name"]}
    return any(
        all(requirement_holds(r, labels.get(r["key"])) for r in term.get("matchExpressions") or [])
        and all(requirement_holds(r, fields.get(r["key"])) for r in term.get("matchFields") or [])
        for term in required["nodeSelectorTerms"])


def snapshot(fleet: Fleet, run: Run, transitions: list[tuple[str, bool]] | None = None) -> Snapshot:
    cluster = fleet.cluster
    daemonsets = client.AppsV1Api(cluster.api_client).list_namespaced_daemon_set(
        NAMESPACE, label_selector="app.kubernetes.io/name=qgpu-manager", _preload_content=False)
    live = yaml.safe_load(daemonsets.data)["items"]
    nodes = {name: fleet.node(name) for name in fleet.nodes}
    device_classes = DynamicClient(cluster.api_client).resources.get(api_version=dra.API_VERSION, kind="DeviceClass")
    rbac = {f"{kind}/qgpu-manager-dra" for kind, api, ns in DRA_RBAC
            if live_object(cluster, {"apiVersion": api, "kind": kind,
                                     "metadata": {"name": "qgpu-manager-dra", **({"namespace": ns} if ns else {})}})}
    return Snapshot(
        run=run,
        modes={n: (node["metadata"].get("labels") or {}).get(names.POOL_MODE_LABEL) for n, node in nodes.items()},
        managers={n: {d["metadata"]["name"] for d in live if selects(d, node)} for n, node in nodes.items()},
        unschedulable={n: bool(node["spec"].get("unschedulable")) for n, node in nodes.items()},
        pods={n: fleet.pods_on(n) for n in fleet.nodes},
        cdi_dropin={n: (fleet.work / "roots" / n / CDI_DROPIN).is_file() for n in fleet.nodes},
        daemonsets={d["metadata"]["name"] for d in live},
        device_classes={c.metadata.name for c in device_classes.get().items} & DEVICE_CLASSES,
        dra_rbac=rbac,
        dra_exclusion={d["metadata"]["name"]: names.POOL_MODE_LABEL in json.dumps(d["spec"]["template"]["spec"].get("affinity"))
                       for d in live if not d["metadata"]["name"].startswith("qgpu-manager-dra-")},
        admission_resources=admission_resources(cluster),
        transitions=transitions or [],
    )


def admission_resources(cluster: Cluster) -> set[str]:
    policy = client.AdmissionregistrationV1Api(cluster.api_client).read_validating_admission_policy("qgpu-manager-own-node")
    return {r for rule in policy.spec.match_constraints.resource_rules for r in rule.resources}


def set_pool_mode(fleet: Fleet, mode: str) -> None:
    """The one edit docs/dra.md asks for: qgpu_pool_mode in the pool's group vars."""
    path = fleet.inventory / "group_vars" / f"{POOL}.yml"
    group_vars = yaml.safe_load(path.read_text())
    group_vars["qgpu_pool_mode"] = mode
    path.write_text(yaml.safe_dump(group_vars, sort_keys=False))


def play(fleet: Fleet, playbook: str) -> Run:
    run = ansible_playbook("-i", str(fleet.inventory), playbook)
    with (fleet.work / "migration.log").open("a") as log:  # kept by pytest's tmp_path for a failed run
        log.write(f"===== {playbook}\n{run.output}\n")
    return run


def roll(fleet: Fleet) -> tuple[Run, list[tuple[str, bool]]]:
    selector = ",".join(f"{k}={v}" for k, v in fleet.label.items())
    node_watch = NodeWatch(fleet.cluster, selector, len(fleet.nodes))
    run = play(fleet, ROLLOUT)
    return run, node_watch.stop(fleet.nodes[0])


def make_pool(cluster: Cluster, work: Path) -> Fleet:
    suffix = uuid.uuid4().hex[:6]
    label = {"qgpu-test": f"migrate-{suffix}"}
    nodes = [f"migrate-{suffix}-t4-{i}" for i in range(2)]
    fleet = Fleet(cluster, work, label, namespace_for(cluster, f"m{suffix}"), {POOL: nodes})
    for name in nodes:
        gpu_node(cluster.api, name, cards(2, "T4", 16384, node=name), labels=label)
        write_probe_tree(work / "roots" / f"{name}-probe", "T4")
    create_workloads(fleet)
    write_inventory(fleet, work / "roots")
    inventory = fleet.inventory
    all_vars = yaml.safe_load((inventory / "group_vars" / "all.yml").read_text())
    all_vars.update({  # cluster.yml's components, not waited for (no kubelet runs their pods)
        "qgpu_namespace": NAMESPACE,
        "qgpu_image": "registry.example.com/qgpu/qgpu-runtime:0.1.0",
        "qgpu_manager_wait": False,
        "qgpu_scheduler_wait": False,
        "qgpu_webhook_wait": False,
        # The session's extender binds as the cluster admin, not as qgpu-scheduler's ServiceAccount:
        # let it write the allocation record past qgpu-pod-annotations.
        "qgpu_scheduler_extra_pod_annotation_writers": [ADMIN_USER],
    })
    (inventory / "group_vars" / "all.yml").write_text(yaml.safe_dump(all_vars, sort_keys=False))
    (inventory / "host_vars" / "localhost.yml").write_text(yaml.safe_dump({"qgpu_root_prefix": str(work / "roots" / "api")}))
    pool_vars = yaml.safe_load((inventory / "group_vars" / f"{POOL}.yml").read_text())
    # this machine runs Debian's containerd 1.6: declare the 2.x a DRA node needs, restart nothing
    pool_vars.update({"qgpu_node_pool_containerd_version": "2.4.2", "qgpu_node_pool_manage_services": False})
    (inventory / "group_vars" / f"{POOL}.yml").write_text(yaml.safe_dump(pool_vars, sort_keys=False))
    return fleet


@pytest.fixture(scope="module")
def migration(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Migration]:
    work = tmp_path_factory.mktemp("migrate")
    fleet = make_pool(cluster, work)
    steps: dict[str, Snapshot] = {}
    try:
        # The starting point: the pool provisioned in device-plugin mode (labels, cluster objects).
        start = ansible_playbook("-i", str(fleet.inventory), "playbooks/node-pools.yml", CLUSTER)
        steps["start"] = snapshot(fleet, start)
        set_pool_mode(fleet, "dra")
        steps["to-dra cluster"] = snapshot(fleet, play(fleet, CLUSTER))
        steps["to-dra rollout"] = snapshot(fleet, *roll(fleet))
        steps["to-dra rollout again"] = snapshot(fleet, *roll(fleet))
        set_pool_mode(fleet, "device-plugin")
        steps["back cluster"] = snapshot(fleet, play(fleet, CLUSTER))
        steps["back rollout"] = snapshot(fleet, *roll(fleet))
        steps["back cluster after rollout"] = snapshot(fleet, play(fleet, CLUSTER))
        yield Migration(fleet, steps)
    finally:
        teardown = ansible_playbook("-i", str(fleet.inventory), "playbooks/teardown.yml")
        delete_webhook_configurations(cluster)
        for name in fleet.nodes:
            cluster.api.delete_node(name)
        cluster.api.delete_namespace(fleet.namespace)
        assert teardown.returncode == 0, teardown.output[-4000:]
        shutil.rmtree(work, ignore_errors=True)


RUNS = ("start", "to-dra cluster", "to-dra rollout", "to-dra rollout again", "back cluster", "back rollout",
        "back cluster after rollout")
ROLLOUTS = ("to-dra rollout", "to-dra rollout again", "back rollout")
DEVICE_PLUGIN_MANAGER = {f"qgpu-manager-{POLICY}"}
DRA_MANAGER = {f"qgpu-manager-dra-{POLICY}"}


@pytest.mark.parametrize("step", RUNS)
def test_every_step_succeeds(migration: Migration, step: str) -> None:
    run = migration.steps[step].run
    assert run.returncode == 0, run.output[-6000:]


# The mode label and the manager each node gets, after each step. Until the rollout relabels a node,
# the manager it has keeps it; from the relabelling on, the other mode's manager does. Never both,
# never none.
EXPECTED = {
    "start": ("device-plugin", DEVICE_PLUGIN_MANAGER),
    "to-dra cluster": ("device-plugin", DEVICE_PLUGIN_MANAGER),
    "to-dra rollout": ("dra", DRA_MANAGER),
    "to-dra rollout again": ("dra", DRA_MANAGER),
    "back cluster": ("dra", DRA_MANAGER),
    "back rollout": ("device-plugin", DEVICE_PLUGIN_MANAGER),
    "back cluster after rollout": ("device-plugin", DEVICE_PLUGIN_MANAGER),
}


@pytest.mark.parametrize("step", RUNS)
def test_each_node_has_the_label_and_the_one_manager_of_its_mode(migration: Migration, step: str) -> None:
    mode, manager = EXPECTED[step]
    snap = migration.steps[step]
    nodes = migration.fleet.nodes
    assert snap.modes == dict.fromkeys(nodes, mode), snap.modes
    assert snap.managers == {n: manager for n in nodes}, (snap.managers, snap.daemonsets)


@pytest.mark.parametrize("step", ROLLOUTS)
def test_each_node_was_cordoned_drained_and_uncordoned(migration: Migration, step: str) -> None:
    """One node per batch (the rollout's 20 % of two nodes): each cordoned, drained and
    uncordoned before the next is cordoned; only the DaemonSet's pods stay."""
    snap = migration.steps[step]
    first, second = migration.fleet.nodes
    assert snap.transitions == [(first, True), (first, False), (second, True), (second, False)], snap.transitions
    events = task_events(snap.run, ("Cordon the node", "Drain the node", "Uncordon the node"))
    assert [(task, host) for task, _, host in events] == [
        (task, node) for node in (first, second) for task in ("Cordon the node", "Drain the node", "Uncordon the node")]
    assert snap.unschedulable == {first: False, second: False}
    assert snap.pods == {n: [f"agent-{n}"] for n in (first, second)}


def test_the_way_to_dra_writes_the_cdi_dropin_on_each_node(migration: Migration) -> None:
    steps = migration.steps
    nodes = migration.fleet.nodes
    assert steps["to-dra cluster"].cdi_dropin == dict.fromkeys(nodes, False)
    assert steps["to-dra rollout"].cdi_dropin == dict.fromkeys(nodes, True)
    changed = changed_tasks(steps["to-dra rollout"].run)
    assert changed.get("TASK [qgpu_node_pool : Write the CDI drop-in (CRI runtime plugin, config schema 3)]") == set(nodes)


def test_the_way_back_leaves_the_cdi_dropin_untouched(migration: Migration) -> None:
    """docs/dra.md: the drop-in stays (harmless without CDI devices); the roles do not touch it."""
    steps = migration.steps
    assert steps["back cluster after rollout"].cdi_dropin == dict.fromkeys(migration.fleet.nodes, True)
    assert not any("CDI" in task for task in changed_tasks(steps["back rollout"].run))


@pytest.mark.parametrize("step", RUNS)
def test_device_classes_and_dra_rbac_exist_exactly_while_a_node_may_serve_dra(migration: Migration, step: str) -> None:
    """From the cluster.yml run that makes the pool dra until the run after the last node left dra."""
    snap = migration.steps[step]
    dra_present = step not in ("start", "back cluster after rollout")
    assert snap.device_classes == (DEVICE_CLASSES if dra_present else set()), step
    assert snap.dra_rbac == ({f"{k}/qgpu-manager-dra" for k, _, _ in DRA_RBAC} if dra_present else set()), step
    assert bool(snap.daemonsets & {f"qgpu-manager-dra-{p}" for p in ("best-effort", "fixed-share", "burst-share")}) == dra_present
    assert set(snap.dra_exclusion.values()) == {dra_present}, snap.dra_exclusion
    assert ("resourceslices" in snap.admission_resources) == dra_present, snap.admission_resources


@pytest.mark.parametrize("step", ("to-dra rollout again",))
def test_a_second_rollout_changes_nothing_but_the_cordon(migration: Migration, step: str) -> None:
    run = migration.steps[step].run
    nodes = set(migration.fleet.nodes)
    assert changed_tasks(run) == {"TASK [Cordon the node]": nodes, "TASK [Uncordon the node]": nodes}, run.output[-6000:]

