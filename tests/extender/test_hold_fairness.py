"""Holds shared fairly between namespaces (issue 21 §5): pods that filter passed and that never reach
their bind cannot keep another namespace's pods out. In memory; under the real kube-scheduler with
pods stuck in PreBind: tests/k8s/test_e2e_hold_fairness.py."""

from __future__ import annotations

import json

import pytest

from qgpu_runtime.extender.app import ExtenderApp
from qgpu_runtime.extender.cache import AllocationCache, default_holds_per_namespace
from qgpu_runtime.extender.podstate import BindAuthorization, NodeNameSet, PodStates
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from qgpu_runtime.placement.policies import make_policy
from tests.extender.test_kube_cache import SEC, node, pod
from tests.recordkeys import VERIFIER


def in_namespace(namespace: str, name: str) -> dict:
    p = pod(name, core=10, memory=1, uid=f"uid-{namespace}-{name}")
    p["metadata"]["namespace"] = namespace
    return p


def app_with(pods: list[dict], max_holds: int, per_namespace: int | None = None) -> ExtenderApp:
    cache = AllocationCache(make_policy("binpack"), "binpack", assume_ttl_ns=600 * SEC, max_holds=max_holds,
                            max_holds_per_namespace=per_namespace, verifier=VERIFIER)
    cache.replace_nodes([node("a"), node("b")])
    cache.replace_pods(pods)
    return ExtenderApp(cache, None, DEFAULT_LIMITS)


def filter_pod(app: ExtenderApp, p: dict) -> dict:
    return app.handle("filter", json.dumps({"Pod": p, "NodeNames": ["a", "b"]}).encode())[1]


def test_the_default_share_is_half_of_the_holds_rounded_up():
    assert [default_holds_per_namespace(n) for n in (1, 2, 3, 1000)] == [1, 1, 2, 500]


def test_one_namespace_takes_at_most_its_share_and_is_told_so():
    stuck = [in_namespace("team-a", f"p{i}") for i in range(3)]
    other = in_namespace("team-b", "q")
    app = app_with([*stuck, other], max_holds=3)  # share: 2
    assert [filter_pod(app, p)["Error"] for p in stuck[:2]] == ["", ""]
    doc = filter_pod(app, stuck[2])
    assert doc["Error"] == ("namespace 'team-a' already has 2 pods holding cards that await their bind (at most 2 per "
                            "namespace, --max-holds-per-namespace); pod team-a/p2 is refused until some of them are "
                            "bound or expire")
    assert filter_pod(app, other)["Error"] == "" and app.cache.holds() == 3


def test_at_the_cap_the_busiest_namespace_gives_up_its_oldest_hold():
    """Issue 21 §5: three pods of one namespace stuck after filter held --max-holds 3; the next
    namespace's pod waited 74 s. Now it takes the oldest hold of the namespace holding most."""
    stuck = [in_namespace("team-a", f"p{i}") for i in range(3)]
    other = in_namespace("team-b", "q")
    app = app_with([*stuck, other], max_holds=3, per_namespace=3)
    for p in stuck:
        assert filter_pod(app, p)["Error"] == ""
    assert filter_pod(app, other)["Error"] == "" and app.cache.holds() == 3
    assert app.cache.booking("team-b/q") is not None and app.cache.booking("team-a/p0") is None
    assert app.cache.hold_evictions == 1
    # the evicted pod's bind is refused like any bind no filter allowed; kube-scheduler tries it again
    bind = {"PodName": "p0", "PodNamespace": "team-a", "PodUID": stuck[0]["metadata"]["uid"], "Node": "a"}
    assert "no filter of this extender passed it" in app.handle("bind", json.dumps(bind).encode())[1]["Error"]


def test_at_the_cap_a_namespace_as_busy_as_the_others_waits_with_the_reason():
    pods = [in_namespace("team-a", "p0"), in_namespace("team-b", "q0"), in_namespace("team-b", "q1")]
    app = app_with(pods, max_holds=2, per_namespace=2)
    assert filter_pod(app, pods[0])["Error"] == "" and filter_pod(app, pods[1])["Error"] == ""
    doc = filter_pod(app, pods[2])  # team-b would hold 2 against team-a's 1: taking team-a's hold is not fairer
    assert doc["Error"] == ("2 pods already hold cards and await their bind (at most 2, --max-holds; namespace 'team-b' "
                            "holds 1, the most any namespace holds is 1); pod team-b/q1 is refused until some are bound "
                            "or expire")
    assert app.cache.hold_evictions == 0


def test_a_bind_in_flight_is_never_evicted():
    states = PodStates()
    states.authorize("team-a/p0", BindAuthorization("u0", NodeNameSet(["a"]), 1))
    states.authorize("team-a/p1", BindAuthorization("u1", NodeNameSet(["a"]), 2))
    states.pin("team-a/p0", "record")
    assert states.room_for("team-b/q", max_holds=2, per_namespace=2).evict == "team-a/p1"
    states.pin("team-a/p1", "record")
    assert states.room_for("team-b/q", max_holds=2, per_namespace=2).refusal is not None


def test_counts_per_namespace_follow_authorizations():
    states = PodStates()
    states.authorize("a/p", BindAuthorization("u", NodeNameSet(["n"]), 1))
    states.authorize("a/p", BindAuthorization("u", NodeNameSet(["n"]), 2))  # again: still one
    states.authorize("b/q", BindAuthorization("v", NodeNameSet(["n"]), 1))
    assert (states.authorized_in("a"), states.authorized_in("b"), states.authorized_count()) == (1, 1, 2)
    states.deauthorize("a/p")
    states.deauthorize("a/p")
    assert (states.authorized_in("a"), states.authorized_count()) == (0, 1)


@pytest.mark.parametrize("per_namespace", [0, -1])
def test_a_share_below_one_is_refused(per_namespace):
    with pytest.raises(ValueError, match=f"max_holds_per_namespace={per_namespace}: must be >= 1"):
        AllocationCache(make_policy("binpack"), "binpack", max_holds=3, max_holds_per_namespace=per_namespace, verifier=VERIFIER)
