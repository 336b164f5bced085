"""Two kube-schedulers (leader election off), each with its own qgpu extender, race on one burst.

This is how issue 11 §5 broke: every scheduler runs every pod's cycle and each extender's cache and
per-node lock only know its own binds, so both saw the same card free and both bound onto it (a
16 GiB card at 20 GiB and 120 % core). With node commitments (a Lease per node, written with a
resourceVersion precondition) the apiserver lets only one of two racing binds commit; the other
decides again on fresh state or fails, and the scheduler retries it.

Capacity is exact: 3 nodes × 2 cards × 3 pods (30 % core, 5 GiB on a 16 GiB card) = 18 slots for
54 identical pods, so afterwards exactly 18 are bound and no card holds a fourth pod, checked from
the allocation records, from the commitment Leases, and on node 0 (a real node manager, whose
Allocate the test kubelet calls for each pod bound there) from the node's own store.
"""

from __future__ import annotations

import json
import sqlite3
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from kubernetes import client

from qgpu_runtime.contract.inventory import CARDS
from qgpu_runtime.contract.leases import lease_name, parse_commitments
from qgpu_runtime.contract.names import COMMITMENTS
from tests.k8s.controlplane import extender_server
from tests.k8s.kubeobjects import MANAGED_RESOURCES, card_usage, cards, gpu_node, gpu_pod, list_pods, record, wait_for
from tests.k8s.nodemanager import ManagedNode, bare_node, read_node

NODES, CARDS_PER_NODE, PODS_PER_CARD = 3, 2, 3
SLOTS = NODES * CARDS_PER_NODE * PODS_PER_CARD  # 18
PODS = 3 * SLOTS
CARD_MIB = 16384
LIMITS = {"tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 5}
COMMITMENT_NAMESPACE = "qgpu-system"  # the extender's default --commitment-namespace (tests/k8s/conftest.py makes it)


def _settled(api: client.CoreV1Api, ns: str, quiet_s: float = 4.0):
    """Pods once at least SLOTS are bound and nothing changed for ``quiet_s`` (a bind beyond the
    capacity would show up as more than SLOTS)."""
    last: list[str] = []
    since = time.monotonic()

    def probe():
        nonlocal last, since
        items = list_pods(api, ns)
        now_bound = sorted(p["metadata"]["name"] for p in items if p["spec"].get("nodeName"))
        if now_bound != last:
            last, since = now_bound, time.monotonic()
            return None
        return items if len(now_bound) >= SLOTS and time.monotonic() - since >= quiet_s else None

    return probe


def store_usage(node: ManagedNode) -> dict[int, tuple[int, int, int]]:
    """Card index → (core ‰, memory MiB, containers) summed over the manager's store rows."""
    db = sqlite3.connect(f"file:{node.root / 'meta.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT card_index, SUM(core_milli), SUM(memory_mib), COUNT(*) FROM shares GROUP BY card_index")
        return {index: (core, mib, n) for index, core, mib, n in rows.fetchall()}
    finally:
        db.close()


def conflicts_of(extender) -> float | None:
    """Lease writes this extender lost (reported, not asserted: how often the race hits varies)."""
    with urllib.request.urlopen(extender.url + "/metrics", timeout=5, context=extender.ssl_context()) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("qgpu_extender_commitment_conflicts_total "):
                return float(line.split()[1])
    return None


@pytest.mark.slow
def test_two_schedulers_with_two_extenders_never_over_commit_a_card(cluster, ns, label, tmp_path):
    cp = cluster.cp
    scheduler_name = f"race-{ns}"
    extenders = [extender_server(cp, name=f"race-extender-{i}-{ns}") for i in range(2)]
    schedulers = [f"race-scheduler-{i}-{ns}" for i in range(2)]
    managed = None
    try:
        for extender in extenders:
            extender.start()
        for name, extender in zip(schedulers, extenders):
            config = {
                "apiVersion": "kubescheduler.config.k8s.io/v1",
                "kind": "KubeSchedulerConfiguration",
                "clientConnection": {"kubeconfig": str(cp.scheduler_kubeconfig), "qps": 1000, "burst": 2000},
                "leaderElection": {"leaderElect": False},
                "profiles": [{"schedulerName": scheduler_name}],
                "extenders": [extender.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s")],
            }
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            cp.start_scheduler_from_file(path, name=name)
        # Node 0 is a managed node: a real `qgpu manager serve` (simulated 2 x 16 GiB cards) publishes
        # its cards and answers the test kubelet's Allocate from its store; the others are API objects.
        bare_node(cluster.api, f"{ns}-0", label)
        managed = ManagedNode(f"{ns}-0", f"{CARDS_PER_NODE}xT4-16G", cp.admin_kubeconfig)
        managed.start()
        wait_for("the manager's card inventory on its node",
                 lambda: CARDS in (read_node(cluster.api, f"{ns}-0")["metadata"].get("annotations") or {}))
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: gpu_node(cluster.api, f"{ns}-{i}", cards(CARDS_PER_NODE, memory_mib=CARD_MIB,
                                                                              node=f"{ns}-{i}"), label), range(1, NODES)))
        time.sleep(1.0)  # the extenders' node watches catch up
        pods = [gpu_pod(f"p{i:02d}", LIMITS, selector=label, scheduler_name=scheduler_name) for i in range(PODS)]
        with ThreadPoolExecutor(8) as pool:  # a burst: both schedulers see the pods at once
            list(pool.map(lambda p: cluster.api.create_namespaced_pod(ns, p, _preload_content=False), pods))

        items = wait_for(f"at least {SLOTS} pods bound, then quiet", _settled(cluster.api, ns), timeout=180, interval=0.5)
        conflicts = [conflicts_of(extender) for extender in extenders]
        print(f"node commitment conflicts per extender: {conflicts}")
        # kubelet admits the pods bound to the managed node, in bind order, as a real node would
        on_managed = sorted((p for p in items if p["spec"].get("nodeName") == f"{ns}-0"),
                            key=lambda p: int(p["metadata"]["annotations"]["qgpu.io/bind-time"]))
        refused = []
        for pod in on_managed:
            try:
                managed.kubelet.admit(pod)
            except Exception as exc:  # noqa: BLE001 - reported below, after the records' verdict
                refused.append((pod["metadata"]["name"], str(exc)))
        store_shares = store_usage(managed)
    finally:
        for name in schedulers:
            cp.stop_scheduler(name)
        for extender in extenders:
            extender.stop()
        if managed is not None:
            managed.close()

    bound = [p for p in items if p["spec"].get("nodeName")]
    for pod in items:  # no record without its Binding, none naming another node
        rec = record(pod)
        assert (rec is None) == (not pod["spec"].get("nodeName")), pod["metadata"]["name"]
        assert rec is None or rec.node == pod["spec"]["nodeName"], pod["metadata"]["name"]
    usage = card_usage(bound)
    over = {k: u for k, u in usage.items() if u["core_milli"] > 1000 or u["memory_mib"] > CARD_MIB}
    assert not over, f"over-committed cards (from the records): {over}"
    assert len(bound) == SLOTS, f"{len(bound)} pods bound into {SLOTS} slots"

    # the node's own store agrees: every admitted container holds its recorded share, no card over
    assert not refused, f"Allocate refused on the managed node: {refused}"
    assert sum(n for _, _, n in store_shares.values()) == len(on_managed) > 0, store_shares
    assert all(core <= 1000 and mib <= CARD_MIB for core, mib, _ in store_shares.values()), store_shares

    coordination = client.CoordinationV1Api(cluster.api_client)
    for i in range(NODES):
        node = f"{ns}-{i}"
        lease = json.loads(coordination.read_namespaced_lease(lease_name(node), COMMITMENT_NAMESPACE,
                                                              _preload_content=False).data)
        committed = parse_commitments(lease["metadata"]["annotations"][COMMITMENTS], node)
        per_card: dict[int, list[int]] = {}
        for c in committed.pods.values():
            for use in c.cards:
                totals = per_card.setdefault(use.index, [0, 0])
                totals[0] += use.core_milli
                totals[1] += use.memory_mib
        assert all(core <= 1000 and mib <= CARD_MIB for core, mib in per_card.values()), (node, per_card)
        for pod in (p for p in bound if p["spec"]["nodeName"] == node):  # every bound pod is committed there
            assert pod["metadata"]["uid"] in committed.pods, f"bound pod {pod['metadata']['name']} has no commitment on {node}"
