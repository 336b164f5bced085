"""T9k groups run all or none (issue 22 §2), under the real kube-apiserver and the real
kube-scheduler with a ``t9k-scheduler`` profile calling the extender, as the
kube_scheduler_extender role wires T9k's pods.

A member's bind holds its cards while its group is incomplete and answers an error naming the
group; kube-scheduler reports it in its FailedScheduling Event and retries the pod. The waiting is
bounded polling on what the API shows (Events, bound pods); no assertion is about time.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest
import yaml

from qgpu_runtime.extender.groups import GROUP_LABEL, MIN_MEMBER_ANNOTATION
from tests.k8s.kubeobjects import MANAGED_RESOURCES, bound, cards, events_for, gpu_node, gpu_pod, read_pod, record, wait_for

WHOLE_CARD = {"tke.cloud.tencent.com/qgpu-core": 100}
GROUP_TIMEOUT_S = 20  # well above kube-scheduler's 10 s maximum backoff, the pace members retry at


@pytest.fixture(scope="module")
def t9k(cluster, tmp_path_factory) -> Iterator[None]:
    """The extender with ``--group-timeout 20`` and kube-scheduler with the t9k-scheduler profile."""
    cluster.restart_extender(extra_args=("--group-timeout", str(GROUP_TIMEOUT_S)))
    config = {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
              "clientConnection": {"kubeconfig": str(cluster.cp.scheduler_kubeconfig), "qps": 1000, "burst": 2000},
              "leaderElection": {"leaderElect": False},
              "profiles": [{"schedulerName": name} for name in ("default-scheduler", "t9k-scheduler")],
              "extenders": [cluster.extender.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s")]}
    path = tmp_path_factory.mktemp("t9k-sched") / "scheduler-config.yaml"
    path.write_text(yaml.safe_dump(config))
    cluster.cp.start_scheduler_from_file(path)
    try:
        yield
    finally:
        cluster.restart_extender()
        cluster.cp.start_scheduler(cluster.scheduler_extenders())


def member(name: str, group: str, label: dict[str, str]) -> dict[str, Any]:
    """A member of a group of 3. The pods are created one after another, and kube-scheduler can bind
    the first before the next exists: the annotation gives the size (docs/extender.md, Groups)."""
    pod = gpu_pod(name, WHOLE_CARD, selector=label, scheduler_name="t9k-scheduler",
                  annotations={MIN_MEMBER_ANNOTATION: "3"})
    pod["metadata"]["labels"] = {GROUP_LABEL: group}
    return pod


def messages(cluster, ns: str, names: list[str]) -> list[str]:
    return [e.get("message") or "" for n in names for e in events_for(cluster.api, ns, n)
            if e.get("reason") == "FailedScheduling"]


def waited(cluster, ns: str, names: list[str], what: str, probe: Any, timeout: float) -> Any:
    """``wait_for`` that, on failure, shows the pods' Events and the extender's and kube-scheduler's logs."""
    try:
        return wait_for(what, probe, timeout=timeout)
    except AssertionError as exc:
        scheduler = cluster.cp.processes.get("kube-scheduler")
        events = "\n".join(f"{n}: {e.get('reason')}: {e.get('message')}" for n in names for e in events_for(cluster.api, ns, n))
        raise AssertionError(f"{exc}\n--- events ---\n{events}\n--- extender ---\n"
                             f"{cluster.extender.process.tail(60) if cluster.extender.process else ''}"
                             f"\n--- kube-scheduler ---\n{scheduler.tail(60) if scheduler else ''}") from None


def unbound(cluster, ns: str, names: list[str]) -> list[str]:
    return [n for n in names if not read_pod(cluster.api, ns, n)["spec"].get("nodeName")]


def test_a_group_of_three_that_fits_binds_all_three(cluster, ns, label, t9k):
    node = f"{ns}-n"
    gpu_node(cluster.api, node, cards(3, node=node), label)
    names = [f"w{i}" for i in range(3)]
    for name in names:
        cluster.api.create_namespaced_pod(ns, member(name, "fits", label))
    pods = [bound(cluster.api, ns, name, timeout=120) for name in names]
    used = sorted(s.index for p in pods for c in record(p).containers for s in c.shares)  # type: ignore[union-attr]
    assert used == [0, 1, 2]


def test_a_group_created_one_pod_at_a_time_without_its_size_settles_into_one_group(cluster, ns, label, t9k):
    """T9k's pods as a slow controller creates them, 1.5 s apart, without qgpu.io/group-min-member:
    none is bound while the next is still to come (the extender's --group-settle, 5 s by default),
    and all three are bound once the last has settled."""
    node = f"{ns}-s"
    gpu_node(cluster.api, node, cards(3, node=node), label)
    names = [f"s{i}" for i in range(3)]
    for name in names:
        pod = gpu_pod(name, WHOLE_CARD, selector=label, scheduler_name="t9k-scheduler")
        pod["metadata"]["labels"] = {GROUP_LABEL: "slow"}
        cluster.api.create_namespaced_pod(ns, pod)
        time.sleep(1.5)
        assert unbound(cluster, ns, names[:names.index(name) + 1]) == names[:names.index(name) + 1], \
            "a member was bound before the group's next pod was created"
    waited(cluster, ns, names, "the slow group bound", lambda: not unbound(cluster, ns, names) or None, timeout=120)
    assert any("waits" in m and "for members still being created" in m for m in messages(cluster, ns, names))


def test_a_group_that_does_not_fit_binds_none_holds_until_the_timeout_and_runs_once_the_blocker_goes(cluster, ns, label, t9k):
    node = f"{ns}-n"
    gpu_node(cluster.api, node, cards(3, node=node), label)
    cluster.api.create_namespaced_pod(ns, gpu_pod("blocker", WHOLE_CARD, selector=label))
    bound(cluster.api, ns, "blocker")
    names = [f"w{i}" for i in range(3)]
    for name in names:
        cluster.api.create_namespaced_pod(ns, member(name, "g", label))

    waiting = f"group {ns}/g ({GROUP_LABEL}) waits for 1 more of 3 members to be placed"
    waited(cluster, ns, names, "a FailedScheduling Event saying what the group waits for",
           lambda: any(waiting in m for m in messages(cluster, ns, names)) or None, timeout=120)
    assert unbound(cluster, ns, names) == names  # two held, none bound

    released = f"group {ns}/g: its held placements were released after {GROUP_TIMEOUT_S} s"
    waited(cluster, ns, names, "the group's holds released by its timeout",
           lambda: any(released in m for m in messages(cluster, ns, names)) or None, timeout=120)
    cluster.api.create_namespaced_pod(ns, gpu_pod("other", WHOLE_CARD, selector=label))
    assert bound(cluster.api, ns, "other")["spec"]["nodeName"] == node  # the held cards went to another pod
    assert unbound(cluster, ns, names) == names

    for name in ("blocker", "other"):
        cluster.api.delete_namespaced_pod(name, ns, grace_period_seconds=0)
    pods = waited(cluster, ns, names, "the group bound", lambda: not unbound(cluster, ns, names)
                  and [read_pod(cluster.api, ns, n) for n in names], timeout=180)
    used = sorted(s.index for p in pods for c in record(p).containers for s in c.shares)  # type: ignore[union-attr]
    assert used == [0, 1, 2]
