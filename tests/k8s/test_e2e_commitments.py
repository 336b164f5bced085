"""The bind's node commitment against the real apiserver, one race at a time.

A rival binder (another extender process, played here by a second LeaseCommitments on the same
apiserver) writes the node's Lease at chosen moments; the apiserver's resourceVersion check is the
real one.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from qgpu_runtime.contract.leases import CardUse, Commitment, lease_name
from qgpu_runtime.extender.binder import Binder, BindError
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.extender.commitments import LeaseCommitments, Snapshot
from qgpu_runtime.kube.client import api_client
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.placement.policies import make_policy
from qgpu_runtime.placement.state import Placement
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


def test_a_rewrite_prunes_entries_this_binder_watched_past_the_grace_and_keeps_fresh_ones(cluster, ns, label):
    """An entry of a pod that never bound goes once this binder has itself seen it for the grace
    (its own monotonic clock), however its writer stamped it; one it saw later stays."""
    node = f"{ns}-prune"
    api, cache, coordination = setup(cluster, ns, label, node)
    rival = LeaseCommitments(coordination, ns)
    seen = rival.read(node)
    rival.write(seen, seen.commitments.with_pod(
        Commitment("old-uid", "other/old", time.time_ns() - 120 * 10**9, (CardUse(0, 300, 4096),))))
    ticks = [0]
    store = LeaseCommitments(coordination, ns)
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=store, commitment_grace_ns=60 * 10**9,
                    monotonic_ns=lambda: ticks[0], signer=SIGNER)
    uids = [pending_pod(cluster, ns, label, f"p{i}") for i in range(2)]
    binder.bind(ns, "p0", uids[0], node)  # first sight of old-uid: stamped 2 min ago, kept all the same
    assert set(store.read_fresh(node).commitments.pods) == {"old-uid", uids[0]}
    seen = rival.read_fresh(node)
    rival.write(seen, seen.commitments.with_pod(
        Commitment("fresh-uid", "other/fresh", time.time_ns(), (CardUse(0, 300, 4096),))))
    ticks[0] = 60 * 10**9
    binder.bind(ns, "p1", uids[1], node)
    assert set(store.read_fresh(node).commitments.pods) == {"fresh-uid", *uids}


def test_an_entry_stamped_in_the_future_is_pruned_after_the_grace_like_any_other(cluster, ns, label):
    """Issue 21 §6: a binder whose clock ran ahead stamped an entry holding both cards of a node; its
    pod never bound. The entry never aged by the reader's wall clock, so the empty node refused pods."""
    node = f"{ns}-future"
    api, cache, coordination = setup(cluster, ns, label, node, n_cards=2)
    rival = LeaseCommitments(coordination, ns)
    seen = rival.read(node)
    ahead = time.time_ns() + 365 * 24 * 3600 * 10**9
    rival.write(seen, seen.commitments.with_pod(Commitment(
        "ghost-uid", "other/ghost", ahead, (CardUse(0, 1000, 16384, exclusive=True), CardUse(1, 1000, 16384, exclusive=True)))))
    ticks = [0]
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=LeaseCommitments(coordination, ns),
                    commitment_grace_ns=60 * 10**9, monotonic_ns=lambda: ticks[0], signer=SIGNER)
    uid = pending_pod(cluster, ns, label, "p")
    with pytest.raises(BindError, match=f"node {node} cannot take it"):
        binder.bind(ns, "p", uid, node)  # just seen: it counts, as a fresh commitment must
    ticks[0] = 60 * 10**9
    binder.bind(ns, "p", uid, node)
    assert read_pod(cluster.api, ns, "p")["spec"]["nodeName"] == node


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


def test_a_pod_another_binder_committed_on_the_node_is_not_decided_again_over_its_entry(cluster, ns, label):
    """Both kube-schedulers run every pod's cycle. Had the second binder written its own choice over
    the first's entry of the same pod, the Lease would name one card while the first's Binding put
    another card's record on the pod, and the second binder's next decisions there (its watch not
    having delivered that record yet) would count the pod on the wrong card: a card over-committed
    (issue 23's race test failed so under load). The first entry stands and this bind fails."""
    node = f"{ns}-same"
    api, cache, coordination = setup(cluster, ns, label, node)
    uid = pending_pod(cluster, ns, label, "p")
    rival = LeaseCommitments(coordination, ns)
    seen = rival.read(node)
    theirs = Commitment(uid, f"{ns}/p", time.time_ns(), (CardUse(1, 300, 4096),))
    rival.write(seen, seen.commitments.with_pod(theirs))
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=LeaseCommitments(coordination, ns), signer=SIGNER)
    with pytest.raises(BindError, match=f"not bound to {node}: another binder committed this pod there .*cards 1\\)"):
        binder.bind(ns, "p", uid, node)
    pod = read_pod(cluster.api, ns, "p")
    assert not pod["spec"].get("nodeName") and record(pod) is None
    assert LeaseCommitments(coordination, ns).read(node).commitments.pods[uid] == theirs
    assert cache.booking(f"{ns}/p") is None


class WithdrawFails(LeaseCommitments):
    """Writes like the real store, except that taking an entry out fails (the apiserver unreachable
    right after a failed Binding)."""

    def write(self, snapshot: Snapshot, commitments) -> None:
        if set(snapshot.commitments.pods) - set(commitments.pods):
            raise ConnectionError("apiserver unreachable")
        super().write(snapshot, commitments)


def test_this_binders_own_leftover_entry_is_decided_again_on_the_retry(cluster, ns, label, monkeypatch):
    """A Binding that failed and an entry that could not be withdrawn: the pod's retry through the
    same binder replaces its own entry (it remembers what it wrote) instead of waiting out the grace."""
    node = f"{ns}-retry"
    api, cache, coordination = setup(cluster, ns, label, node)
    uid = pending_pod(cluster, ns, label, "p")
    store = WithdrawFails(coordination, ns)
    binder = Binder(api, cache, DEFAULT_LIMITS, commitments=store, signer=SIGNER)
    real = binder.pods.create_binding
    monkeypatch.setattr(binder.pods, "create_binding", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("reset")))
    with pytest.raises(BindError, match="binding to .* failed"):
        binder.bind(ns, "p", uid, node)
    first = LeaseCommitments(coordination, ns).read(node).commitments.pods[uid]  # left behind
    monkeypatch.setattr(binder.pods, "create_binding", real)
    binder.bind(ns, "p", uid, node)
    pod = read_pod(cluster.api, ns, "p")
    assert pod["spec"]["nodeName"] == node
    entry = LeaseCommitments(coordination, ns).read(node).commitments.pods[uid]
    assert entry.since_ns > first.since_ns and entry.cards == Commitment.of(uid, f"{ns}/p", Placement.of_record(record(pod)), 0).cards
