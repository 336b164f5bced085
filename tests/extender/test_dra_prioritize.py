"""DRA prioritize: a pod's demand read from its claims, cards' usage from allocated claims, and the
policy's ranking of the state the DRA allocator's first fit would leave on each node."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from qgpu_runtime.contract.dra import DRIVER, SHARED_CLASS, WHOLE_CLASS, slice_device, slice_name
from qgpu_runtime.extender.app import ExtenderApp
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.extender.dra import Ask, DemandError, DraView, claim_asks, claim_usage
from qgpu_runtime.model.requests import DEFAULT_LIMITS, PodRequest
from qgpu_runtime.placement.policies import make_policy
from qgpu_runtime.placement.state import CardSpec
from tests.recordkeys import VERIFIER

NO_GPU = PodRequest("ns", "p")


def rslice(node: str, cards: int = 4, memory: int = 16384) -> dict[str, Any]:
    devices = [slice_device(CardSpec(i, f"GPU-{node}-{i}", "Tesla-T4", memory), "burst-share") for i in range(cards)]
    return {"metadata": {"name": slice_name(node)},
            "spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": devices}}


def claim(name: str, core: int | None = 250, memory: int | None = 4096, *, cls: str = SHARED_CLASS, count: int = 1,
          allocated: list[tuple[str, str, int, int]] = (), uid: str | None = None) -> dict[str, Any]:
    capacity = {k: str(v) for k, v in (("core", core), ("memory", memory)) if v is not None}
    exact: dict[str, Any] = {"deviceClassName": cls, "count": count}
    if capacity:
        exact["capacity"] = {"requests": capacity}
    doc: dict[str, Any] = {"metadata": {"name": name, "namespace": "ns", "uid": uid or f"uid-{name}"},
                           "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exact}]}}}
    if allocated:
        doc["status"] = {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": node, "device": device, "shareID": f"s{i}",
             "consumedCapacity": {"core": str(c), "memory": str(m), "pods": "1"}}
            for i, (node, device, c, m) in enumerate(allocated)]}}}
    return doc


def pod(*claims: str, template: str | None = None) -> dict[str, Any]:
    refs: list[dict[str, str]] = [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)]
    if template:
        refs.append({"name": "t", "resourceClaimTemplateName": template})
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "pod-uid"},
            "spec": {"containers": [{"name": "c", "image": "x"}], "resourceClaims": refs}}


def view(*nodes: str, cards: int = 4) -> DraView:
    v = DraView()
    v.replace_slices([rslice(n, cards) for n in nodes])
    v.replace_claims([])
    v.replace_templates([])
    return v


# -- decoding ------------------------------------------------------------------------------------

def test_capacity_requests_are_rounded_as_the_slice_request_policy_rounds_them() -> None:
    asks = claim_asks(claim("c", core=255, memory=3000)["spec"])
    assert asks == [Ask(core=260, memory=3072)]


def test_a_request_without_capacity_asks_the_whole_card() -> None:
    assert claim_asks(claim("c", core=None, memory=None, cls=WHOLE_CLASS, count=2)["spec"]) == [Ask(None, None)] * 2


def test_the_apiservers_canonical_quantity_is_read() -> None:
    spec = claim("c")["spec"]
    spec["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["core"] = "1k"
    assert claim_asks(spec) == [Ask(1000, 4096)]


def test_other_classes_are_not_qgpus_demand() -> None:
    assert claim_asks(claim("c", cls="gpu.nvidia.com")["spec"]) == []


def test_first_available_takes_the_first_qgpu_subrequest() -> None:
    spec = {"devices": {"requests": [{"name": "gpu", "firstAvailable": [
        {"name": "other", "deviceClassName": "gpu.nvidia.com"},
        {"name": "share", "deviceClassName": SHARED_CLASS, "capacity": {"requests": {"core": "300", "memory": "2048"}}}]}]}}
    assert claim_asks(spec) == [Ask(300, 2048)]


def test_a_byte_quantity_is_not_a_qgpu_capacity() -> None:
    with pytest.raises(DemandError, match="capacity.requests.memory='4Gi'"):
        claim_asks(claim("c", memory="4Gi")["spec"])  # type: ignore[arg-type]


def test_usage_is_the_consumed_capacity_of_qgpu_results() -> None:
    doc = claim("c", allocated=[("node-a", "gpu-1", 250, 4096)])
    doc["status"]["allocation"]["devices"]["results"].append({"driver": "other.example.com", "pool": "x", "device": "d"})
    assert [(u.node, u.device, u.core, u.memory) for u in claim_usage(doc)] == [("node-a", "gpu-1", 250, 4096)]


def _on_node(doc: dict[str, Any], node: str) -> dict[str, Any]:
    """The nodeSelector kube-scheduler writes into an allocation of node-local devices."""
    doc["status"]["allocation"]["nodeSelector"] = {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}
    return doc


def test_a_node_naming_another_nodes_pool_cannot_fill_that_nodes_cards() -> None:
    """A compromised node-a publishes its slice with pool "node-b". Claims kube-scheduler allocates
    on node-a then carry pool "node-b"; booked by pool, node-b looked full (scored 0) and node-a
    empty. The slice is not read (its pool is not its node's) and the results, allocated for
    node-a, are not booked on node-b."""
    hostile = rslice("node-a")
    hostile["spec"]["pool"]["name"] = "node-b"
    v = DraView()
    v.replace_slices([hostile, rslice("node-b")])
    v.replace_templates([])
    v.replace_claims([_on_node(claim(f"c{i}", core=1000, memory=16384, allocated=[("node-b", f"gpu-{i}", 1000, 16384)]), "node-a")
                      for i in range(4)])
    state = v.state()
    assert "node-a" not in state.index  # its slice is left out: it scores 0
    row = state.index["node-b"]
    assert state.core_free[row].tolist() == [1000] * 4 and state.pods[row].tolist() == [0] * 4
    assert claim_usage(_on_node(claim("x", allocated=[("node-b", "gpu-0", 250, 4096)]), "node-a")) == []
    # an allocation really on node-b is booked there
    honest = _on_node(claim("real", core=500, memory=8192, allocated=[("node-b", "gpu-0", 500, 8192)]), "node-b")
    assert [(u.node, u.device) for u in claim_usage(honest)] == [("node-b", "gpu-0")]


def test_demand_comes_from_named_claims_and_templates() -> None:
    v = view("node-a")
    v.apply_claim("ADDED", claim("mine", core=300, memory=2048))
    v.apply_template("ADDED", {"metadata": {"name": "tpl", "namespace": "ns"},
                               "spec": {"spec": claim("x", core=None, memory=None, cls=WHOLE_CLASS)["spec"]}})
    assert v.demand(pod("mine", template="tpl")) == [Ask(300, 2048), Ask(None, None)]
    assert v.demand(pod("unknown")) is None
    assert v.demand({"metadata": {"name": "p"}, "spec": {}}) is None



def test_a_claim_the_watch_has_not_delivered_yet_is_waited_for_and_then_counted() -> None:
    """kube-scheduler may ask about a claim pod before the claims watch delivered its claim (the
    CI failure of tests/provisioning/test_k8s_dra.py: a claim created just before its pod scored 0
    everywhere, and the pod landed on the emptier node). demand waits for the claim; the watch
    delivers in order, so an allocation written before the claim is counted once it is known."""
    v = view("node-a", "node-b")
    answer: list[Any] = []
    asking = threading.Thread(target=lambda: answer.append(v.demand(pod("late"), wait=60.0)))
    asking.start()
    for _ in range(3000):  # until demand waits on the condition (or has answered: the test fails)
        if answer or v._delivered._waiters:  # type: ignore[attr-defined]
            break
        asking.join(0.01)
    assert answer == []
    v.apply_claim("ADDED", claim("late", core=300, memory=2048))
    asking.join(30)
    assert answer == [[Ask(300, 2048)]]


def test_a_known_claim_of_another_driver_and_a_missing_one_are_not_waited_for_past_the_bound() -> None:
    v = view("node-a")
    v.apply_claim("ADDED", claim("theirs", cls="gpu.nvidia.com"))
    v.apply_template("ADDED", {"metadata": {"name": "tpl", "namespace": "ns"},
                               "spec": {"spec": claim("x", cls="gpu.nvidia.com")["spec"]}})
    answer: list[Any] = []
    asking = threading.Thread(target=lambda: answer.append(
        (v.demand(pod("theirs"), wait=3600.0), v.demand(pod(template="tpl"), wait=3600.0))))
    asking.start()
    asking.join(30)
    assert answer == [(None, None)]  # known, asks nothing of qgpu: answered without waiting
    assert v.demand(pod("missing"), wait=0.05) is None  # never delivered: no opinion after the wait
    v.apply_claim("DELETED", claim("theirs", cls="gpu.nvidia.com"))
    assert "ns/theirs" not in v._asks


def test_nothing_is_waited_for_before_the_watches_listed_or_while_one_relists() -> None:
    """Before a watch's first LIST, or after it broke and until its relist, every claim pod would
    wait the whole bound, one after the other (kube-scheduler's cycle is serial): no opinion at once."""
    fresh = DraView()
    fresh.replace_slices([rslice("node-a")])
    answer: list[Any] = []
    asking = threading.Thread(target=lambda: answer.append(fresh.demand(pod("late"), wait=3600.0)))
    asking.start()
    asking.join(30)
    assert answer == [None]  # claims and templates never listed
    v = view("node-a")
    v.following("claims", False)  # the claims watch broke
    asking = threading.Thread(target=lambda: answer.append(v.demand(pod("late"), wait=3600.0)))
    asking.start()
    asking.join(30)
    assert answer == [None, None]
    v.replace_claims([claim("late", core=300, memory=2048)])  # relisted
    assert v.demand(pod("late"), wait=3600.0) == [Ask(300, 2048)]


def test_a_template_pods_claim_is_read_from_the_claim_its_status_names() -> None:
    """The resourceclaim controller names the claim it made from the template in the pod's status
    (kube-scheduler waits for it): that claim is read, and a deleted template changes nothing."""
    v = view("node-a")
    v.apply_claim("ADDED", claim("p-gpu-x7", core=400, memory=1024))
    made = pod(template="tpl")
    made["status"] = {"resourceClaimStatuses": [{"name": "t", "resourceClaimName": "p-gpu-x7"}]}
    assert v.demand(made) == [Ask(400, 1024)]  # no template known at all
    assert v.demand(pod(template="tpl")) is None

# -- scoring -------------------------------------------------------------------------------------

def test_binpack_prefers_the_node_whose_cards_claims_already_use() -> None:
    v = view("node-a", "node-b", "node-c")
    v.apply_claim("ADDED", claim("used", allocated=[("node-b", "gpu-0", 500, 8192)]))
    scores = v.scores([Ask(250, 4096)], NO_GPU, ["node-a", "node-b", "node-c"], make_policy("binpack"))
    assert scores.tolist() == [0, 10, 0]


def test_spread_prefers_the_empty_nodes() -> None:
    v = view("node-a", "node-b")
    v.apply_claim("ADDED", claim("used", allocated=[("node-b", "gpu-0", 500, 8192)]))
    assert v.scores([Ask(250, 4096)], NO_GPU, ["node-a", "node-b"], make_policy("spread")).tolist() == [10, 0]


def test_a_deleted_claim_frees_its_share() -> None:
    v = view("node-a", "node-b")
    used = claim("used", allocated=[("node-b", "gpu-0", 500, 8192)])
    v.apply_claim("ADDED", used)
    v.apply_claim("DELETED", used)
    assert v.scores([Ask(250, 4096)], NO_GPU, ["node-a", "node-b"], make_policy("binpack")).tolist() == [10, 10]


def test_a_node_where_first_fit_finds_no_card_scores_zero() -> None:
    """Every card of node-b is partly used: a whole card does not fit there; node-a still takes it."""
    v = view("node-a", "node-b", cards=2)
    v.apply_claim("ADDED", claim("u", count=2, allocated=[("node-b", "gpu-0", 100, 1024), ("node-b", "gpu-1", 100, 1024)]))
    assert v.scores([Ask(None, None)], NO_GPU, ["node-a", "node-b"], make_policy("binpack")).tolist() == [10, 0]


def test_first_fit_follows_the_slices_device_order() -> None:
    """The allocator walks a slice's devices as listed (qgpu lists them by card index), not by name.
    With gpu-0, gpu-1, gpu-2 and gpu-3 full on node-a, a whole card still fits there (gpu-4), and
    binpack scores node-a over the empty node-b; a pod asking for 9 whole cards fits only on node-b."""
    v = view("node-a", "node-b", cards=12)
    full = [("node-a", f"gpu-{i}", 1000, 16384) for i in range(4)]
    v.apply_claim("ADDED", claim("u", count=4, allocated=full))
    assert v.scores([Ask(None, None)], NO_GPU, ["node-a", "node-b"], make_policy("binpack")).tolist() == [10, 0]
    assert v.scores([Ask(None, None)] * 9, NO_GPU, ["node-a", "node-b"], make_policy("binpack")).tolist() == [0, 10]


def test_card_columns_follow_the_slices_device_order() -> None:
    """First fit tries the columns left to right: a slice listing gpu-1 before gpu-0 puts gpu-1 first."""
    reordered = rslice("node-a", cards=2)
    reordered["spec"]["devices"].reverse()
    v = DraView()
    v.replace_slices([reordered])
    v.replace_claims([])
    state = v.state()
    assert [int(state.card_index[0, j]) for j in range(2)] == [1, 0]


def test_unknown_nodes_score_zero_and_the_list_order_is_kept() -> None:
    v = view("node-a")
    assert v.scores([Ask(250, 4096)], NO_GPU, ["nowhere", "node-a"], make_policy("binpack")).tolist() == [0, 10]


def test_a_slice_seen_after_its_claims_books_them() -> None:
    v = DraView()
    v.replace_claims([claim("used", allocated=[("node-b", "gpu-0", 500, 8192)])])
    v.replace_slices([rslice("node-a"), rslice("node-b")])
    assert v.scores([Ask(250, 4096)], NO_GPU, ["node-a", "node-b"], make_policy("binpack")).tolist() == [0, 10]


# -- the extender verb ---------------------------------------------------------------------------

def test_prioritize_scores_a_dra_pod_and_leaves_others_at_zero() -> None:
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([])
    the_pod = pod("mine")
    cache.replace_pods([the_pod])
    v = view("node-a", "node-b")
    v.apply_claim("ADDED", claim("mine"))
    v.apply_claim("ADDED", claim("used", allocated=[("node-a", "gpu-0", 500, 8192)]))
    app = ExtenderApp(cache, None, DEFAULT_LIMITS, dra=v)
    body = json.dumps({"Pod": the_pod, "NodeNames": ["node-a", "node-b"]}).encode()
    status, doc = app.handle("prioritize", body)
    assert status == 200
    assert json.loads(doc) == [{"Host": "node-a", "Score": 10}]  # node-b scores 0: left out
    without = ExtenderApp(cache, None, DEFAULT_LIMITS)
    status, doc = without.handle("prioritize", body)
    assert json.loads(doc) == []  # every node 0


def test_dra_prioritize_scores_claim_pods_only() -> None:
    """The verb of kube-scheduler's entry without managedResources (every pod reaches it): a claim
    pod is scored as by prioritize, a dialect pod gets 0 (the main entry scores it, once)."""
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([])
    the_pod = pod("mine")
    dialect = pod()
    dialect["metadata"].update(name="dialect", uid="dialect-uid")
    dialect["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    cache.replace_pods([the_pod, dialect])
    v = view("node-a", "node-b")
    v.apply_claim("ADDED", claim("mine"))
    v.apply_claim("ADDED", claim("used", allocated=[("node-a", "gpu-0", 500, 8192)]))
    app = ExtenderApp(cache, None, DEFAULT_LIMITS, dra=v)
    names = ["node-a", "node-b"]
    status, doc = app.handle("dra-prioritize", json.dumps({"Pod": the_pod, "NodeNames": names}).encode())
    assert status == 200
    assert json.loads(doc) == [{"Host": "node-a", "Score": 10}]  # node-b scores 0: left out
    status, doc = app.handle("dra-prioritize", json.dumps({"Pod": dialect, "NodeNames": names}).encode())
    assert status == 200
    assert json.loads(doc) == []  # every node 0
    status, doc = ExtenderApp(cache, None, DEFAULT_LIMITS).handle(
        "dra-prioritize", json.dumps({"Pod": the_pod, "NodeNames": names}).encode())
    assert status == 404 and "--dra-prioritize" in doc["Error"]


def test_a_node_flapping_its_slice_rebuilds_the_card_state_a_few_times_then_once_per_interval() -> None:
    """A node writes its own ResourceSlice: alternating two valid versions, it made every DRA
    prioritize rebuild the card state. Paced as node specs are (extender/pacing.py); a new slice and
    a deleted one apply at once; the latest held-back version applies once the node may change."""
    from qgpu_runtime.extender.pacing import ChangePacer

    now = [100.0]
    v = view("a", "b")
    v.paced.pacer = ChangePacer(lambda: now[0], burst=2, interval_s=5.0)
    states = [v.state()]  # kept, so no two are the same object by accident
    for i in range(10):
        v.apply_slice("MODIFIED", rslice("a", cards=2 if i % 2 == 0 else 4))
        states.append(v.state())
    assert len({id(s) for s in states}) <= 3  # the state before and the burst's two, not eleven
    v.apply_slice("MODIFIED", rslice("a", cards=3))  # the latest, held back
    assert v.state().n_cards[v.state().index["a"]] != 3
    v.apply_slice("ADDED", rslice("c", cards=1))  # another node's new slice: at once
    assert "c" in v.state().index
    now[0] += 5.0
    assert v.state().n_cards[v.state().index["a"]] == 3 and v.paced.waiting == {}
    v.apply_slice("DELETED", rslice("a"))
    assert "a" not in v.state().index  # a slice gone: at once


def test_a_node_deleting_and_creating_its_slice_is_paced_too() -> None:
    """A new slice and a deleted one applied at once, so a node alternating delete and create
    (or fresh slice names) rebuilt the card state at every prioritize (review, 2026-12-01)."""
    from qgpu_runtime.extender.pacing import ChangePacer

    now = [100.0]
    v = view("a")
    v.paced.pacer = ChangePacer(lambda: now[0], burst=2, interval_s=5.0)
    states = [v.state()]
    for i in range(10):
        if i % 2 == 0:
            v.apply_slice("DELETED", rslice("a"))
        else:
            v.apply_slice("ADDED", rslice("a", cards=2 + i % 3))
        states.append(v.state())
    assert len({id(s) for s in states}) <= 4, len({id(s) for s in states})  # not eleven
    v.apply_slice("ADDED", rslice("b"))  # another node's first slice: at once
    assert "b" in v.state().index
