"""Opt-in eviction of the pods of failed cards on device-plugin pools (issue 26 §4, extender/evictor.py).

The cache (real) is fed nodes whose inventory marks a card unhealthy and pods bound with signed
records; the API is a fake that serves the pods and records Evictions, so every refusal can be
played: a budget (429), a pod gone (404), a pod re-created under the name (409).
"""

from __future__ import annotations

import copy
import json

import pytest
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract.inventory import encode_inventory
from qgpu_runtime.contract.names import POOL_MODE_LABEL
from qgpu_runtime.contract.record import parse_record
from qgpu_runtime.extender import evictor as module
from qgpu_runtime.extender.evictor import UnhealthyCardEvictor, tolerated_for
from qgpu_runtime.placement.state import CardSpec
from tests.extender.test_kube_cache import SEC, bind_locally, cache, node, pod
from tests.recordkeys import VERIFIER

NOW = 1_000 * SEC


class Response:
    def __init__(self, doc: dict) -> None:
        self.data = json.dumps(doc).encode()


class FakeApi:
    """read_namespaced_pod and create_namespaced_pod_eviction over a dict of pods."""

    def __init__(self, pods: list[dict]) -> None:
        self.pods = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p for p in pods}
        self.evictions: list[tuple[str, dict]] = []
        self.refuse: list[int] = []  # statuses the next Evictions answer
        self.reads = 0

    def read_namespaced_pod(self, name, namespace, _preload_content=True, _request_timeout=None):
        self.reads += 1
        p = self.pods.get(f"{namespace}/{name}")
        if p is None:
            raise ApiException(status=404, reason="Not Found")
        return Response(p)

    def create_namespaced_pod_eviction(self, name, namespace, body, _preload_content=True, _request_timeout=None):
        if self.refuse:
            raise ApiException(status=self.refuse.pop(0), reason="refused")
        self.evictions.append((f"{namespace}/{name}", body))
        self.pods.pop(f"{namespace}/{name}", None)
        return Response({})


def failed_node(name: str, unhealthy: dict[int, str], labels: dict | None = None) -> dict:
    n = node(name)
    cards = [CardSpec(i, f"GPU-{name}-{i}", "V100", 32768) for i in range(2)]
    n["metadata"]["annotations"]["qgpu.io/gpus"] = encode_inventory(cards, unhealthy)
    n["metadata"]["labels"] = labels or {}
    return n


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def world(*specs: tuple[str, str, int, dict | None]):
    """A cache with nodes a and b, pods (name, node, core, spec extras) bound by the cache, their
    watch events applied; the fake API serving them."""
    c = cache()
    pods = []
    for name, where, core, extra in specs:
        bound = bind_locally(c, pod(name, core=core), where, NOW)
        if extra:
            bound["spec"].update(extra)
        c.apply_pod("MODIFIED", bound)
        pods.append(bound)
    return c, FakeApi(pods), pods


def card_of(p: dict) -> int:
    (share,) = parse_record(p["metadata"]["annotations"]["qgpu.io/allocation"]).containers[0].shares
    return share.index


def test_only_the_pods_on_the_failed_card_are_evicted_with_their_uid_as_precondition():
    c, api, pods = world(("big", "a", 80, None), ("other-card", "a", 80, None), ("elsewhere", "b", 80, None))
    assert card_of(pods[0]) != card_of(pods[1])  # 80 % each: two cards of node a
    c.apply_node("MODIFIED", failed_node("a", {card_of(pods[0]): "XID 79: fell off the bus"}))
    clock = Clock()
    ev = UnhealthyCardEvictor(api, c.failed_cards, VERIFIER, clock)
    assert ev.scan() == ["ns/big"]
    ((key, body),) = api.evictions
    assert key == "ns/big" and body["deleteOptions"]["preconditions"]["uid"] == "uid-big"
    assert body["kind"] == "Eviction" and body["apiVersion"] == "policy/v1"
    assert ev.scan() == []  # gone from the API now (its watch event has not come): nothing sent twice
    assert len(api.evictions) == 1 and ev.evicted == 1


def test_nothing_is_scanned_while_every_card_is_healthy():
    c, api, _ = world(("p", "a", 30, None))
    ev = UnhealthyCardEvictor(api, c.failed_cards, VERIFIER, Clock())
    assert c.failed_cards() == ({}, [])
    assert ev.scan() == [] and api.evictions == []


@pytest.mark.parametrize("tolerations, expected", [
    ([{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists", "effect": "NoExecute"}], None),
    ([{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists"}], None),
    ([{"operator": "Exists"}], None),  # an empty key with Exists tolerates every taint
    ([{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
      {"key": "gpu.qgpu.io/unhealthy", "operator": "Exists", "tolerationSeconds": 10}], 10.0),
    ([{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists", "tolerationSeconds": -5}], 0.0),
    ([{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists", "effect": "NoSchedule"}], 0.0),
    ([{"key": "gpu.qgpu.io/unhealthy", "operator": "Equal", "value": "x"}], 0.0),
    ([{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}], 0.0),
    ([{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists", "tolerationSeconds": "30"}], 0.0),  # not a number
    ("not a list", 0.0),
    ([], 0.0),
])
def test_a_pod_tolerates_a_failed_card_as_it_would_a_noexecute_taint(tolerations, expected):
    assert tolerated_for({"spec": {"tolerations": tolerations}}) == expected


def test_a_tolerating_pod_stays_and_one_with_toleration_seconds_goes_when_they_have_passed():
    forever = {"tolerations": [{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists"}]}
    for_30 = {"tolerations": [{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists", "tolerationSeconds": 30}]}
    c, api, pods = world(("stays", "a", 30, forever), ("waits", "a", 30, for_30))
    assert card_of(pods[0]) == card_of(pods[1]) == 0  # binpack: one card
    # the cache books what the watch said; the API (read before each Eviction) has the tolerations
    c.apply_node("MODIFIED", failed_node("a", {0: "XID 48"}))
    clock = Clock()
    ev = UnhealthyCardEvictor(api, c.failed_cards, VERIFIER, clock)
    assert ev.scan() == []
    clock.t += 29
    assert ev.scan() == []
    clock.t += 1
    assert ev.scan() == ["ns/waits"]
    clock.t += 3600
    assert ev.scan() == [] and [k for k, _ in api.evictions] == ["ns/waits"]


def test_a_card_healthy_again_restarts_the_toleration_clock():
    for_30 = {"tolerations": [{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists", "tolerationSeconds": 30}]}
    c, api, _ = world(("waits", "a", 30, for_30))
    clock = Clock()
    ev = UnhealthyCardEvictor(api, c.failed_cards, VERIFIER, clock)
    c.apply_node("MODIFIED", failed_node("a", {0: "XID 48"}))
    assert ev.scan() == []
    clock.t += 20
    c.apply_node("MODIFIED", failed_node("a", {}))
    assert ev.scan() == []
    c.apply_node("MODIFIED", failed_node("a", {0: "XID 48"}))
    assert ev.scan() == []  # failed again: seen from now
    clock.t += 29
    assert ev.scan() == []  # 29 s since it failed again, 49 since it first failed
    clock.t += 1
    assert ev.scan() == ["ns/waits"]


def test_a_record_the_extender_did_not_sign_points_the_evictor_nowhere():
    """A tenant writes a record naming the failed card onto its own pod (to see it evicted), or a
    signed record copied from another pod: the cache keeps neither, so neither is a target."""
    c, api, pods = world(("victim", "a", 30, None))
    forged = pod("forged", node_name="a", annotations={
        "qgpu.io/allocation": pods[0]["metadata"]["annotations"]["qgpu.io/allocation"]})
    copied = pod("copied", node_name="a", annotations=dict(pods[0]["metadata"]["annotations"]))
    for p in (forged, copied):
        c.apply_pod("ADDED", p)
        api.pods[f"ns/{p['metadata']['name']}"] = p
    c.apply_node("MODIFIED", failed_node("a", {0: "XID 79"}))
    _, found = c.failed_cards()
    assert [t.key for t in found] == ["ns/victim"]


def test_the_pod_is_read_again_and_a_changed_one_is_left_alone():
    c, api, pods = world(("moved", "a", 30, None), ("renamed", "a", 30, None), ("unsigned", "a", 30, None))
    api.pods["ns/moved"]["spec"]["nodeName"] = "b"  # what the cache saw is stale
    api.pods["ns/renamed"]["metadata"]["uid"] = "uid-new"  # another pod under the name now
    api.pods["ns/unsigned"]["metadata"]["annotations"].pop("qgpu.io/allocation-signature")
    c.apply_node("MODIFIED", failed_node("a", {0: "XID 79"}))
    ev = UnhealthyCardEvictor(api, c.failed_cards, VERIFIER, Clock())
    assert ev.scan() == [] and api.evictions == []


def test_a_budget_that_refuses_is_asked_again_later_with_a_growing_delay(caplog):
    c, api, _ = world(("guarded", "a", 30, None))
    c.apply_node("MODIFIED", failed_node("a", {0: "XID 79"}))
    clock = Clock()
    results: list[str] = []
    ev = UnhealthyCardEvictor(api, c.failed_cards, VERIFIER, clock, on_result=results.append)
    api.refuse = [429, 429]
    assert ev.scan() == []
    assert "a PodDisruptionBudget allows no disruption now; trying again in 5 s" in caplog.text
    clock.t += 4.9
    assert ev.scan() == [] and api.refuse == [429]  # not asked before its delay
    clock.t += 0.1
    assert ev.scan() == []
    assert "trying again in 10 s" in caplog.text
    clock.t += 10
    assert ev.scan() == ["ns/guarded"]
    assert results == ["refused", "refused", "evicted"]  # the extender's metric counts these


def test_a_pod_gone_or_replaced_meanwhile_ends_the_matter():
    c, api, _ = world(("gone", "a", 30, None), ("replaced", "a", 30, None))
    c.apply_node("MODIFIED", failed_node("a", {0: "XID 79"}))
    ev = UnhealthyCardEvictor(api, c.failed_cards, VERIFIER, Clock())
    api.refuse = [404, 409]
    assert ev.scan() == [] and ev._retry == {}
    assert ev.scan() == ["ns/gone", "ns/replaced"]  # the fake serves them still: nothing remembered against them


def test_dra_pool_nodes_are_left_to_their_device_taints():
    c, api, _ = world(("p", "a", 30, None))
    c.apply_node("MODIFIED", failed_node("a", {0: "XID 79"}, labels={POOL_MODE_LABEL: "dra"}))
    assert c.failed_cards() == ({}, [])


def test_one_scan_sends_a_bounded_number_of_evictions(monkeypatch):
    monkeypatch.setattr(module, "MAX_EVICTIONS_PER_SCAN", 2)
    c, api, _ = world(*((f"p{i}", "a", 10, None) for i in range(5)))
    c.apply_node("MODIFIED", failed_node("a", {0: "XID 79"}))
    ev = UnhealthyCardEvictor(api, c.failed_cards, VERIFIER, Clock())
    assert ev.scan() == ["ns/p0", "ns/p1"]
    assert ev.scan() == ["ns/p2", "ns/p3"]


def test_a_card_of_another_uuid_at_that_index_is_not_the_failed_one():
    """A card swapped in at the same index: the record names the old card's UUID."""
    c, api, pods = world(("old", "a", 30, None))
    n = failed_node("a", {0: "XID 79"})
    doc = json.loads(n["metadata"]["annotations"]["qgpu.io/gpus"])
    doc[0]["uuid"] = "GPU-new"
    n["metadata"]["annotations"]["qgpu.io/gpus"] = json.dumps(doc)
    c.apply_node("MODIFIED", copy.deepcopy(n))
    assert c.failed_cards()[1] == []


def test_a_tolerating_pod_is_not_read_again_at_every_scan():
    """A thousand pods that tolerate a failed card for ever must not cost a thousand GETs every 2 s:
    such a pod is read again once a minute (an update may add a toleration, never remove one), one
    with tolerationSeconds when they have run out."""
    forever = {"tolerations": [{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists"}]}
    for_30 = {"tolerations": [{"key": "gpu.qgpu.io/unhealthy", "operator": "Exists", "tolerationSeconds": 30}]}
    c, api, _ = world(("stays", "a", 30, forever), ("waits", "a", 30, for_30))
    c.apply_node("MODIFIED", failed_node("a", {0: "XID 79"}))
    clock = Clock()
    ev = UnhealthyCardEvictor(api, c.failed_cards, VERIFIER, clock)
    assert ev.scan() == [] and api.reads == 2
    for _ in range(10):
        clock.t += 2
        assert ev.scan() == []
    assert api.reads == 2
    clock.t += 10  # 30 s since the card failed
    assert ev.scan() == ["ns/waits"] and api.reads == 3
    clock.t += 30  # a minute since "stays" was read
    assert ev.scan() == [] and api.reads == 4
