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
from qgpu_runtime.extender.commitments import LeaseCommitments, Snapshot, lease_name
from qgpu_runtime.kube.client import api_client
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.placement.commitments import CardUse, Commitment
from qgpu_runtime.placement.policies import make_policy
from tests.k8s.kubeobjects import cards, gpu_node, gpu_pod, read_pod, record
from tests.recordkeys import SIGNER, VERIFIER

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
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
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
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=store, signer=SIGNER)
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
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=store, signer=SIGNER)
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
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=store, commitment_grace_ns=60 * 10**9, signer=SIGNER)
    uid = pending_pod(cluster, ns, label, "p")
    binder.bind(ns, "p", uid, node)
    assert set(store.read(node).commitments.pods) == {"fresh-uid", uid}  # a binder gone for 2 min: its entry went


def test_binds_in_a_row_read_the_lease_once_and_a_rival_write_between_them_is_caught(cluster, ns, label):
    """The store hands out the Lease its last write left instead of reading it again (one write per
    bind with one active binder); a rival's write in between fails the next write on its
    resourceVersion, and the bind decides again on a fresh read that includes the rival."""
    node = f"{ns}-row"
    api, cache, coordination = setup(cluster, ns, label, node, n_cards=2)
    store = LeaseCommitments(coordination, ns)
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=store, signer=SIGNER)
    uids = [pending_pod(cluster, ns, label, f"p{i}") for i in range(3)]
    binder.bind(ns, "p0", uids[0], node)
    binder.bind(ns, "p1", uids[1], node)
    assert store.fresh_reads == 1 and binder.conflicts == 0
    rival_store = LeaseCommitments(coordination, ns)
    seen = rival_store.read(node)
    rival = Commitment("rival-uid", "other/rival", time.time_ns(), (CardUse(0, 400, 4096),))
    rival_store.write(seen, seen.commitments.with_pod(rival))
    binder.bind(ns, "p2", uids[2], node)
    assert binder.conflicts == 1 and store.fresh_reads == 2
    committed = LeaseCommitments(coordination, ns).read(node).commitments
    assert set(committed.pods) == {"rival-uid", *uids}
    # binpack put p0 and p1 on card 0 (30 % each) and would put p2 there too; the rival's 40 % fills it
    assert committed.pods[uids[2]].cards[0].index == 1


def test_a_lease_deleted_behind_the_store_is_written_again_with_what_it_knew(cluster, ns, label):
    """kube-apiserver creates a Lease on update (coordination's strategy allows it), so the write on
    the remembered Lease recreates it: the entries it knew plus the new one, a superset that only
    over-counts until pruned. Had a rival recreated it meanwhile, the resourceVersion would differ
    and the write would conflict as in the test above."""
    node = f"{ns}-gone"
    api, cache, coordination = setup(cluster, ns, label, node)
    store = LeaseCommitments(coordination, ns)
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=store, signer=SIGNER)
    uids = [pending_pod(cluster, ns, label, f"p{i}") for i in range(2)]
    binder.bind(ns, "p0", uids[0], node)
    coordination.delete_namespaced_lease(lease_name(node), ns)
    binder.bind(ns, "p1", uids[1], node)
    assert binder.conflicts == 0 and store.fresh_reads == 1
    assert set(LeaseCommitments(coordination, ns).read(node).commitments.pods) == set(uids)
    assert read_pod(cluster.api, ns, "p1")["spec"]["nodeName"] == node
