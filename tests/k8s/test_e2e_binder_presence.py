"""Node commitments ``auto`` against the real apiserver: a binder alone binds without its node's
Lease, and a second binder arriving while the first binds finds the first one's binds in the Leases
before it binds itself (issue 23 §2, extender/presence.py).

Each binder is a real Binder with its own cache and its own binders' presence on the same
apiserver; the renewals are driven by the test (``renew()``) instead of the background loop, so
every interleaving is chosen, not timed. Clocks that decide liveness are the test's.
"""

from __future__ import annotations

import threading

import pytest
from kubernetes import client

from qgpu_runtime.contract.leases import lease_name, parse_binders
from qgpu_runtime.contract.names import BINDERS, BINDERS_LEASE
from qgpu_runtime.extender.binder import Binder, BindError
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.extender.commitments import LeaseCommitments
from qgpu_runtime.extender.podapi import PodApi
from qgpu_runtime.kube.client import api_client
from qgpu_runtime.kube.leasedoc import LeaseDocuments
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.placement.policies import make_policy
from tests.k8s.kubeobjects import cards, gpu_node, gpu_pod, read_pod
from tests.recordkeys import SIGNER, VERIFIER

BIG = {"tke.cloud.tencent.com/qgpu-core": 60, "tke.cloud.tencent.com/qgpu-memory": 10}  # two never fit one card


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class HeldBinding(PodApi):
    """The real Binding, sent only once the test lets it go: a bind in flight, paused at will."""

    def __init__(self, api: client.CoreV1Api, timeout, attempts) -> None:
        super().__init__(api, timeout, attempts)
        self.reached = threading.Event()
        self.go = threading.Event()

    def create_binding(self, *args, **kwargs) -> None:
        self.reached.set()
        self.go.wait()
        super().create_binding(*args, **kwargs)


def one_card_node(cluster, ns, label, node: str) -> None:
    gpu_node(cluster.api, node, cards(1, memory_mib=16384, node=node), label)


def binder(cluster, ns, node: str, identity: str, mode: str = "auto", clock: Clock | None = None):
    """A Binder with its presence (duration 15 s) on ``clock``; nothing renewed yet."""
    connection = api_client(str(cluster.cp.admin_kubeconfig))
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([client.ApiClient().sanitize_for_serialization(cluster.api.read_node(node))])
    cache.replace_pods([])  # its watch has delivered nothing: what it knows of others comes from the Leases
    coordination = client.CoordinationV1Api(connection)
    b = Binder(client.CoreV1Api(connection), cache, DEFAULT_LIMITS, commitments=LeaseCommitments(coordination, ns),
               signer=SIGNER)
    presence = b.track_binders(LeaseDocuments(coordination, ns, BINDERS, {}), identity, mode, duration_s=15,
                               monotonic=clock or Clock())
    return b, presence, coordination


def join(presence, clock: Clock) -> None:
    """Publish, then watch the binders' Lease for the full duration a newcomer waits."""
    assert presence.renew()
    clock.now += 15
    assert presence.renew()


def pending(cluster, ns, label, name: str) -> str:
    return cluster.api.create_namespaced_pod(ns, gpu_pod(name, BIG, selector=label, scheduler_name="nobody")).metadata.uid


def node_lease_exists(coordination, ns, node) -> bool:
    try:
        coordination.read_namespaced_lease(lease_name(node), ns)
        return True
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise


def binders(coordination, ns) -> dict:
    lease = coordination.read_namespaced_lease(BINDERS_LEASE, ns)
    return parse_binders((lease.metadata.annotations or {}).get(BINDERS))


def test_a_binder_alone_binds_without_writing_its_nodes_lease(cluster, ns, label):
    node = f"{ns}-alone"
    one_card_node(cluster, ns, label, node)
    clock = Clock()
    first, presence, coordination = binder(cluster, ns, node, "first", clock=clock)
    with pytest.raises(BindError, match="may not bind yet: its presence in the binders' Lease is not written yet"):
        first.bind(ns, "p0", pending(cluster, ns, label, "p0"), node)
    assert presence.renew() and not presence.ready()
    with pytest.raises(BindError, match="has watched the binders' Lease for 0 s of the 15 s"):
        first.bind(ns, "p0", read_pod(cluster.api, ns, "p0")["metadata"]["uid"], node)
    clock.now += 15
    assert presence.renew() and presence.ready()
    first.bind(ns, "p0", read_pod(cluster.api, ns, "p0")["metadata"]["uid"], node)
    assert read_pod(cluster.api, ns, "p0")["spec"]["nodeName"] == node
    assert not node_lease_exists(coordination, ns, node)
    entry = binders(coordination, ns)["first"]
    assert entry.committing is False and entry.duration_s == 15


def test_a_second_binder_arriving_while_the_first_binds_sees_that_bind_in_the_lease(cluster, ns, label):
    node = f"{ns}-join"
    one_card_node(cluster, ns, label, node)
    first_clock, second_clock = Clock(), Clock()
    first, first_presence, coordination = binder(cluster, ns, node, "first", clock=first_clock)
    join(first_presence, first_clock)
    assert not first_presence.committing
    held = HeldBinding(first.pods.api, first.pods.timeout, first.pods.attempts)
    first.pods = held
    p0 = pending(cluster, ns, label, "p0")
    in_flight = threading.Thread(target=first.bind, args=(ns, "p0", p0, node))
    in_flight.start()
    held.reached.wait()  # the first binder chose card 0 without a commitment; its Binding is not sent yet

    second, second_presence, _ = binder(cluster, ns, node, "second", clock=second_clock)
    join(second_presence, second_clock)  # published and watched, but the first still binds without commitments
    p1 = pending(cluster, ns, label, "p1")
    with pytest.raises(BindError, match="first bind without node commitments and have not yet confirmed"):
        second.bind(ns, "p1", p1, node)

    first_renewal = threading.Thread(target=first_presence.renew)
    first_renewal.start()  # sees the second: stops going without, waits for the bind in flight
    held.go.set()
    in_flight.join()
    first_renewal.join()
    assert first_presence.committing and binders(coordination, ns)["first"].committing
    committed = LeaseCommitments(coordination, ns).read_fresh(node).commitments
    assert set(committed.pods) == {p0}  # the bind made without a commitment, written down before confirming

    assert second_presence.renew()
    # the second's cache never saw p0 bound: only the Lease tells it card 0 is 60 % taken
    with pytest.raises(BindError, match=f"node {node} cannot take it"):
        second.bind(ns, "p1", p1, node)
    assert not read_pod(cluster.api, ns, "p1")["spec"].get("nodeName")


def test_a_binder_that_could_not_renew_for_its_duration_stops_binding(cluster, ns, label):
    node = f"{ns}-stale"
    one_card_node(cluster, ns, label, node)
    clock = Clock()
    first, presence, _ = binder(cluster, ns, node, "first", clock=clock)
    join(presence, clock)
    assert presence.ready()
    clock.now += 16  # a reader may count the entry gone after 30 s; this binder stops after 15
    with pytest.raises(BindError, match="was not renewed for 15 s"):
        first.bind(ns, "p0", pending(cluster, ns, label, "p0"), node)


def test_an_entry_unchanged_for_twice_its_duration_by_the_readers_clock_is_gone(cluster, ns, label):
    node = f"{ns}-gone"
    one_card_node(cluster, ns, label, node)
    dead_clock = Clock()
    _, dead, coordination = binder(cluster, ns, node, "dead", clock=dead_clock)
    join(dead, dead_clock)  # says committing: false, then never renews again (kill -9)
    clock = Clock()
    second, presence, _ = binder(cluster, ns, node, "second", clock=clock)
    join(presence, clock)
    with pytest.raises(BindError, match="dead bind without node commitments"):
        second.bind(ns, "p0", pending(cluster, ns, label, "p0"), node)
    clock.now += 14  # 29 s since its first sight of the dead entry
    assert presence.renew()
    with pytest.raises(BindError, match="dead bind without node commitments"):
        second.bind(ns, "p0", read_pod(cluster.api, ns, "p0")["metadata"]["uid"], node)
    clock.now += 2
    assert presence.renew()  # 31 s unchanged by its own clock: gone, and dropped from the document
    assert set(binders(coordination, ns)) == {"second"} and not presence.committing
    second.bind(ns, "p0", read_pod(cluster.api, ns, "p0")["metadata"]["uid"], node)


def test_an_always_binder_makes_an_auto_binder_commit_and_leaving_lets_it_stop(cluster, ns, label):
    node = f"{ns}-always"
    one_card_node(cluster, ns, label, node)
    always_clock, auto_clock = Clock(), Clock()
    _, always, coordination = binder(cluster, ns, node, "always", mode="always", clock=always_clock)
    join(always, always_clock)
    assert always.committing
    auto, presence, _ = binder(cluster, ns, node, "auto", clock=auto_clock)
    join(presence, auto_clock)
    assert presence.committing
    auto.bind(ns, "p0", pending(cluster, ns, label, "p0"), node)
    assert node_lease_exists(coordination, ns, node)
    always.leave()
    assert set(binders(coordination, ns)) == {"auto"}
    assert presence.renew() and not presence.committing


def test_a_malformed_binders_document_keeps_binds_committed(cluster, ns, label):
    node = f"{ns}-bad"
    one_card_node(cluster, ns, label, node)
    clock = Clock()
    first, presence, coordination = binder(cluster, ns, node, "first", clock=clock)
    join(presence, clock)
    assert not presence.committing
    lease = coordination.read_namespaced_lease(BINDERS_LEASE, ns)
    lease.metadata.annotations[BINDERS] = '{"version": 1, "binders": {"x": {"beat": -1}}}'
    coordination.replace_namespaced_lease(BINDERS_LEASE, ns, lease)
    assert not presence.renew() and presence.committing
    first.bind(ns, "p0", pending(cluster, ns, label, "p0"), node)
    assert node_lease_exists(coordination, ns, node)


def test_a_binder_whose_entry_was_deleted_is_back_before_a_newcomer_decides(cluster, ns, label):
    """The binders' Lease deleted (an admin, a stolen extender token) while the first binds alone:
    the newcomer sees nobody at first, but watches a full duration before its first bind, and the
    first writes itself back at its next renewal, sees the newcomer and commits."""
    node = f"{ns}-deleted"
    one_card_node(cluster, ns, label, node)
    first_clock, second_clock = Clock(), Clock()
    first, first_presence, coordination = binder(cluster, ns, node, "first", clock=first_clock)
    join(first_presence, first_clock)
    first.bind(ns, "p0", pending(cluster, ns, label, "p0"), node)  # alone: no commitment
    coordination.delete_namespaced_lease(BINDERS_LEASE, ns)
    second, second_presence, _ = binder(cluster, ns, node, "second", clock=second_clock)
    assert second_presence.renew() and set(binders(coordination, ns)) == {"second"}
    p1 = pending(cluster, ns, label, "p1")
    with pytest.raises(BindError, match="has watched the binders' Lease for 0 s"):
        second.bind(ns, "p1", p1, node)
    assert first_presence.renew()  # back in, sees the second: commits, writes p0 into the node's Lease
    assert set(binders(coordination, ns)) == {"first", "second"} and binders(coordination, ns)["first"].committing
    second_clock.now += 15
    assert second_presence.renew() and second_presence.committing
    with pytest.raises(BindError, match=f"node {node} cannot take it"):
        second.bind(ns, "p1", p1, node)  # p0's 60 % is in the Lease, though this cache never saw p0


def test_no_binders_lease_is_written_with_commitments_off(cluster, ns, label):
    node = f"{ns}-off"
    one_card_node(cluster, ns, label, node)
    connection = api_client(str(cluster.cp.admin_kubeconfig))
    b = Binder(client.CoreV1Api(connection), AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER),
               DEFAULT_LIMITS, signer=SIGNER)
    with pytest.raises(ValueError, match="needs node commitments"):
        b.track_binders(LeaseDocuments(client.CoordinationV1Api(connection), ns, BINDERS, {}), "x", "auto")
    assert LeaseDocuments(client.CoordinationV1Api(connection), ns, BINDERS, {}).read(BINDERS_LEASE, timeout=(3, 10)) is None
