"""A pod past the entries qgpu keeps of one (kube/podslim.py ``MAX_KEPT_POD_ENTRIES``) in the
extender: kept without its containers and claims (a few hundred bytes, where 30,000 claim entries
were 8.8 MiB), it is placed by no filter, named in the refusal, judged by no other verb, and a
bound one's signed record still books its cards with its node-fit CPU and memory."""

from __future__ import annotations

import json

from qgpu_runtime.extender.app import ExtenderApp
from qgpu_runtime.extender.trust import TrustedPods
from qgpu_runtime.kube.podslim import MAX_KEPT_POD_ENTRIES, OVERSIZED
from qgpu_runtime.model.requests import DEFAULT_LIMITS, pod_compute
from tests.extender.test_dra_prioritize import claim, view
from tests.extender.test_dra_prioritize import pod as claim_pod
from tests.extender.test_extender_trust import app_with, bind_body, filter_body
from tests.extender.test_kube_cache import node, pod
from tests.extender.test_preempt import answer, app, bound, filter_passes, meta_body, pending, watch

WIDE = 600  # containers of 1 + 2 resource names each: 1,800 entries, past the 512


def wide(p: dict, n: int = WIDE) -> dict:
    """``p`` with ``n`` more containers asking 10m of CPU and 16 MiB (no GPU)."""
    p["spec"]["containers"] += [{"name": f"w{i}", "image": "busybox",
                                 "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}} for i in range(n)]
    return p


def test_filter_refuses_a_pod_past_the_budget_on_every_node_naming_the_pod_the_list_its_length_and_the_bound():
    big = wide(pod("big", core=30, memory=4))
    a = app_with(big)
    held = a.cache.unbound_pod("uid-big")
    assert held is not None and OVERSIZED in held and len(json.dumps(held)) < 600  # what the mirror keeps of it
    status, doc = a.handle("filter", filter_body(big))
    assert status == 200 and doc["NodeNames"] == [] and doc["Error"] == ""
    reasons = doc["FailedAndUnresolvableNodes"]
    assert set(reasons) == {"a", "b"}
    assert reasons["a"] == (f"pod ns/big lists {WIDE + 1} spec.containers ({3 * WIDE + 3} entries of its spec in all, "
                            "counting each container's resource names and claim references), past the "
                            f"{MAX_KEPT_POD_ENTRIES} entries qgpu keeps of one pod's spec (kube/podslim.py "
                            "MAX_KEPT_POD_ENTRIES): qgpu does not place it; split it into pods of fewer containers or claims")
    assert a.cache.holds() == 0 and not a.cache.state().bookings
    assert a.metrics.refused.labels("filter", "oversized-pod")._value.get() == 1
    assert "no filter of this extender passed it" in a.handle("bind", bind_body(big, "a"))[1]["Error"]

    # not delivered by the watch yet: the pod read from the apiserver, whole, is refused alike
    cache = app_with().cache
    fresh = ExtenderApp(cache, None, DEFAULT_LIMITS, pods=TrustedPods(cache, DEFAULT_LIMITS, read_pod=lambda ns, name: big))
    assert fresh.handle("filter", filter_body(big))[1]["FailedAndUnresolvableNodes"] == reasons
    assert cache.holds() == 0


def test_prioritize_preempt_and_dra_prioritize_have_no_opinion_on_a_pod_past_the_budget():
    big = wide(pod("big", core=30, memory=4))
    status, doc = app_with(big).handle("prioritize", filter_body(big))
    assert status == 200 and all(e["Score"] == 0 for e in json.loads(doc))

    a = app(node("a", n_cards=1))
    watch(a, bound("A", "a", {0: 80}))
    preemptor = wide(pending("p", 100, priority=1000))
    watch(a, preemptor)
    assert answer(a, meta_body(preemptor, {"a": ["A"]})) == {}  # nothing evicted for a pod filter refuses
    assert a.metrics.refused.labels("preempt", "oversized-pod")._value.get() == 1

    claimed = claim_pod("mine")
    a = app_with(claimed)
    v = view("node-a", "node-b")
    v.apply_claim("ADDED", claim("mine"))
    with_dra = ExtenderApp(a.cache, None, DEFAULT_LIMITS, dra=v)
    body = json.dumps({"Pod": claimed, "NodeNames": ["node-a", "node-b"]}).encode()
    assert json.loads(with_dra.handle("dra-prioritize", body)[1]) != []  # scored while it fits the budget
    many = wide(claim_pod("mine"))
    a.cache.apply_pod("MODIFIED", many)
    body = json.dumps({"Pod": many, "NodeNames": ["node-a", "node-b"]}).encode()
    assert json.loads(with_dra.handle("dra-prioritize", body)[1]) == []  # every node 0


def test_a_bound_pod_past_the_budget_keeps_its_cards_booked_with_its_cpu_and_memory():
    """The extender places no such pod, but one an older release placed (or a record of its own
    choosing, where it is signed) books what its record says, with the pod's CPU and memory summed
    from its thousands of containers, through events and relists, until it ends."""
    a = app(node("a", n_cards=1))
    mine = wide(bound("A", "a", {0: 100}))
    watch(a, mine)
    booking = a.cache.booking("ns/A")
    assert booking is not None and booking.node == "a" and booking.gpu_milli == 1000
    assert (booking.cpu_milli, booking.memory_mib) == pod_compute(mine) == (WIDE * 10, WIDE * 16)
    assert filter_passes(a, pending("q", 100)) == []  # its card is not free for another pod
    a.cache.replace_pods([mine])  # a relist books it the same
    assert a.cache.booking("ns/A") == booking
    a.cache.apply_pod("DELETED", mine)
    assert a.cache.booking("ns/A") is None and filter_passes(a, pending("q", 100)) == ["a"]
