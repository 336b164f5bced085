"""The bind's node commitment against the real apiserver, one race at a time.

A rival binder (another extender process, played here by a second LeaseCommitments on the same
apiserver) writes the node's Lease at chosen moments; the apiserver's resourceVersion check is the
real one.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from qgpu_runtime.extender.binder import Binder, BindError
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.extender.commitments import LeaseCommitments, Snapshot
from qgpu_runtime.kube.client import api_client
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.placement.commitments import CardUse, Commitment
from qgpu_runtime.placement.policies import make_policy
from tests.k8s.kubeobjects import cards, gpu_node, gpu_pod, read_pod, record

LIMITS = {"tke.cloud.tencent.com/qgpu-core": 30, "tke.cloud.tencent.com/qgpu-memory": 4}


class RivalAfterRead(LeaseCommitments):
    """Reads like the real store; right after its first read, the rival commits ``rival`` on the
    same node, as a second extender deciding at the same instant would."""

    def __init__(self, api: client.CoordinationV1Api, namespace: str, rival: Commitment) -> None:
        super().__init__(api, namespace)
        self.rival = rival
        self.reads = 0

    def read(self, node: str) -> Snapshot:
        snapshot = super().read(node)
        self.reads += 1
        if self.reads == 1:
            other = LeaseCommitments(self.api, self.namespace)
            seen = other.read(node)
            other.write(seen, seen.commitments.with_pod(self.rival))
        return snapshot


def setup(cluster, ns, label, node: str, n_cards: int = 2) -> tuple[client.CoreV1Api, AllocationCache, client.CoordinationV1Api]:
    gpu_node(cluster.api, node, cards(n_cards, memory_mib=16384, node=node), label)
    connection = api_client(str(cluster.cp.admin_kubeconfig))
    cache = AllocationCache(make_policy("binpack"), "binpack")
    cache.replace_nodes([client.ApiClient().sanitize_for_serialization(cluster.api.read_node(node))])
    cache.replace_pods([])
    return client.CoreV1Api(connection), cache, client.CoordinationV1Api(connection)


def pending_pod(cluster, ns, label, name: str) -> str:
    created = cluster.api.create_namespaced_pod(ns, gpu_pod(name, LIMITS, selector=label, scheduler_name="nobody"))
    return created.metadata.uid


def test_a_bind_that_loses_the_lease_race_decides_again_around_the_winner(cluster, ns, label):
    node = f"{ns}-race"
    api, cache, coordination = setup(cluster, ns, label, node)
    rival = Commitment("rival-uid", "other/rival", time.time_ns(), (CardUse(0, 800, 8192),))
    store = RivalAfterRead(coordination, ns, rival)
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=store)
    uid = pending_pod(cluster, ns, label, "p")
    binder.bind(ns, "p", uid, node)
    assert binder.conflicts == 1 and store.reads == 2  # lost once, decided again on the rival's Lease
    pod = read_pod(cluster.api, ns, "p")
    (share,) = record(pod).containers[0].shares
    assert pod["spec"]["nodeName"] == node and share.index == 1  # binpack wanted card 0; the rival holds 80 % of it
    committed = LeaseCommitments(coordination, ns).read(node).commitments
    assert set(committed.pods) == {"rival-uid", uid}
    assert committed.pods[uid].cards == (CardUse(1, 300, 4096),)


def test_a_bind_onto_cards_another_binder_committed_fails_cleanly(cluster, ns, label):
    node = f"{ns}-full"
    api, cache, coordination = setup(cluster, ns, label, node, n_cards=1)
    store = LeaseCommitments(coordination, ns)
    seen = store.read(node)
    store.write(seen, seen.commitments.with_pod(
        Commitment("rival-uid", "other/rival", time.time_ns(), (CardUse(0, 1000, 16384, exclusive=True),))))
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=store)
    uid = pending_pod(cluster, ns, label, "p")
    with pytest.raises(BindError, match=f"node {node} cannot take it"):
        binder.bind(ns, "p", uid, node)
    pod = read_pod(cluster.api, ns, "p")
    assert not pod["spec"].get("nodeName") and record(pod) is None
    assert set(store.read(node).commitments.pods) == {"rival-uid"}
    assert cache.booking(f"{ns}/p") is None


def test_a_rewrite_prunes_stale_entries_and_keeps_fresh_ones(cluster, ns, label):
    node = f"{ns}-prune"
    api, cache, coordination = setup(cluster, ns, label, node)
    store = LeaseCommitments(coordination, ns)
    seen = store.read(node)
    old = Commitment("old-uid", "other/old", time.time_ns() - 120 * 10**9, (CardUse(0, 500, 4096),))
    fresh = Commitment("fresh-uid", "other/fresh", time.time_ns(), (CardUse(0, 500, 4096),))
    store.write(seen, seen.commitments.with_pod(old).with_pod(fresh))
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=store, commitment_grace_ns=60 * 10**9)
    uid = pending_pod(cluster, ns, label, "p")
    binder.bind(ns, "p", uid, node)
    assert set(store.read(node).commitments.pods) == {"fresh-uid", uid}  # a binder gone for 2 min: its entry went
