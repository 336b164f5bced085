"""What one version of a pod costs the extender (issue 23): filter, prioritize and bind parse it
once, and the watch event that brings the bind's own signed record back is not verified again —
while a forged body is still never parsed into what is remembered."""

from __future__ import annotations

import json

from qgpu_runtime.contract.record import CardShare, ContainerPlacement
from qgpu_runtime.contract.signature import RecordVerifier
from qgpu_runtime.extender.app import ExtenderApp
from qgpu_runtime.extender.binder import Binder
from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.model import requests
from qgpu_runtime.model.requests import DEFAULT_LIMITS, parse_pod
from qgpu_runtime.placement import engine
from qgpu_runtime.placement.policies import make_policy
from qgpu_runtime.placement.state import Placement
from tests.contract.test_record_signature import CountingKey
from tests.extender.test_binder_faults import api_at
from tests.extender.test_extender_trust import bind_body, filter_body
from tests.extender.test_kube_cache import SEC, cache, node, pod
from tests.recordkeys import SIGNER


def _app(key: CountingKey, *pods: dict) -> ExtenderApp:
    cache = AllocationCache(make_policy("binpack"), "binpack", assume_ttl_ns=60 * SEC,
                            verifier=RecordVerifier(key))  # type: ignore[arg-type]
    cache.replace_nodes([node("a"), node("b")])
    cache.replace_pods(list(pods))
    cache.synced.set()  # as the watch feeder sets it once every kind has listed
    # no apiserver behind it: the Binding call is replaced in the test that binds
    binder = Binder(api_at("http://127.0.0.1:9"), cache, DEFAULT_LIMITS, signer=SIGNER)
    return ExtenderApp(cache, binder, DEFAULT_LIMITS)


def test_one_pod_version_is_parsed_once_for_filter_prioritize_and_bind_and_its_record_not_verified_again(monkeypatch):
    parsed: list[str] = []  # every parse of a container, whoever parses (the module's own, not an import)
    container = requests._parse_container

    def counting(collector, spec, *args):  # noqa: ANN002
        parsed.append(spec["name"])
        return container(collector, spec, *args)

    monkeypatch.setattr(requests, "_parse_container", counting)
    key = CountingKey(SIGNER.verifier.public_key)
    real = pod("p", version="11")
    app = _app(key, real)
    written: dict[str, str] = {}
    assert app.binder is not None
    monkeypatch.setattr(app.binder.pods, "create_binding", lambda ns, name, uid, node_name, notes: written.update(notes))
    assert app.handle("filter", filter_body(real))[1]["NodeNames"] == ["a", "b"]
    status, scores = app.handle("prioritize", filter_body(real))
    assert status == 200 and [s["Host"] for s in json.loads(bytes(scores))] == ["a", "b"]
    status, doc = app.handle("bind", bind_body(real, "a"))
    assert status == 200 and doc["Error"] == ""
    assert parsed == ["c"]  # the pod's one container, once
    # the watch brings the bind back: the Binding's annotations on the pod, now bound to a
    bound = {**real, "metadata": {**real["metadata"], "resourceVersion": "12", "annotations": dict(written)},
             "spec": {**real["spec"], "nodeName": "a"}}
    app.cache.apply_pod("MODIFIED", bound)
    booked = app.cache.booking("ns/p")
    assert booked is not None and booked.node == "a" and booked.gpu_milli == 300
    assert key.calls == 0
    # the same event to a cache that did not sign it: verified (what the one above was spared)
    other_key = CountingKey(SIGNER.verifier.public_key)
    _app(other_key).cache.apply_pod("MODIFIED", bound)
    assert other_key.calls == 1


def test_a_forged_body_with_the_real_pod_s_uid_and_version_does_not_plant_its_request():
    """The memory holds only pods as the apiserver has them: a body is never parsed into it."""
    key = CountingKey(SIGNER.verifier.public_key)
    real = pod("p", core=200, version="5")  # two whole cards
    app = _app(key, real)
    forged = pod("p", core=10, version="5")  # same name, UID and version; 10 % of one card
    status, doc = app.handle("filter", filter_body(forged))
    assert "asks for other resources than the pod in the apiserver" in doc["Error"]
    # what the check remembered is the apiserver's pod (two whole cards), never the body's 10 %
    assert len(app.cache.requests) <= 1
    assert app.cache.requests.of(real, DEFAULT_LIMITS) == requests.parse_pod(real, DEFAULT_LIMITS)
    app.handle("filter", filter_body(real))
    held = app.cache.booking("ns/p")
    assert held is not None and held.gpu_milli == 2000 and len(app.cache.requests) == 1


# -- the bind takes filter's hold as it is (reservations.py, ``_held_here``) ------------------------

def _counting_place(monkeypatch) -> list[str]:
    """Every decision of the placement engine on one node, whoever asks for it."""
    calls: list[str] = []
    place = engine.place

    def counting(state, request, policy, mask=None):  # noqa: ANN001
        calls.append("place")
        return place(state, request, policy, mask)

    monkeypatch.setattr(engine, "place", counting)
    return calls


def test_a_bind_to_the_node_filter_held_books_the_held_cards_without_deciding_again(monkeypatch):
    c = cache()
    p = pod("p", core=30)
    request = parse_pod(p)
    assert c.filter(p, request, ["a", "b"], now_ns=1).held == "a"
    held = c.booking("ns/p")
    calls = _counting_place(monkeypatch)
    record = c.reserve(p, request, "a", 2)
    assert calls == []
    assert c.booking("ns/p") == held and record.containers == held.containers
    # the hold became the booking: the next pod's filter sees those cards taken, not released
    q = pod("q", core=80)
    c.filter(q, parse_pod(q), ["a"], now_ns=3)
    booked_q = c.booking("ns/q")
    assert booked_q is not None and {s.index for s in booked_q.containers[0].shares}.isdisjoint(
        {s.index for s in held.containers[0].shares})


def test_a_bind_elsewhere_a_changed_request_or_another_binders_commitment_decide_again(monkeypatch):
    c = cache()
    p = pod("p", core=30)
    request = parse_pod(p)
    c.filter(p, request, ["a", "b"], now_ns=1)
    calls = _counting_place(monkeypatch)
    c.reserve(p, request, "b", 2)  # the scheduler chose the other node filter passed
    assert calls == ["place"] and c.booking("ns/p").node == "b"

    c2 = cache()
    c2.filter(p, request, ["a", "b"], now_ns=1)
    bigger = parse_pod(pod("p", core=50))  # not the request the hold was chosen for
    calls.clear()
    c2.reserve(p, bigger, "a", 2)
    assert calls == ["place"] and c2.booking("ns/p").gpu_milli == 500

    c3 = cache()
    c3.filter(p, request, ["a", "b"], now_ns=1)
    held = c3.booking("ns/p")
    share = held.containers[0].shares[0]
    other = Placement("a", (ContainerPlacement("c", (CardShare(share.index, share.uuid, 900, 0),)),))
    calls.clear()
    record = c3.reserve(p, request, "a", 2, others={"x/other-binder": other})
    assert calls == ["place"]  # decided around the other binder's commitment, not kept
    assert record.containers[0].shares[0].index != held.containers[0].shares[0].index


def test_a_body_that_differs_harmlessly_parses_the_apiserver_s_pod_once_for_the_check_and_the_filter(monkeypatch):
    parsed: list[str] = []
    container = requests._parse_container

    def counting(collector, spec, *args):  # noqa: ANN002
        parsed.append(spec["name"])
        return container(collector, spec, *args)

    monkeypatch.setattr(requests, "_parse_container", counting)
    real = pod("p", version="3")
    app = _app(CountingKey(SIGNER.verifier.public_key), real)
    # a label differs (labels are kept whole, for PodDisruptionBudgets); an annotation qgpu does not
    # read would not differ at all (kube/podslim.py keeps only the ones it reads)
    body = {**real, "metadata": {**real["metadata"], "labels": {"scheduler.example/seen": "yes"}}}
    assert app.handle("filter", filter_body(body))[1]["NodeNames"] == ["a", "b"]
    assert parsed == ["c", "c"]  # the body's pod once (the check), the apiserver's once (check and filter)
    assert len(app.cache.requests) == 1
    parsed.clear()
    unread = {**real, "metadata": {**real["metadata"], "annotations": {"scheduler.example/seen": "yes"}}}
    assert app.handle("filter", filter_body(unread))[1]["NodeNames"] == ["a", "b"]
    assert parsed == []  # the same request as the apiserver's pod, whose parse is remembered
