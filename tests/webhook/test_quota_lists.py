"""The quota check's LISTs of a namespace are read a page at a time and reduced to charges as they
come, so a tenant cannot make the webhook hold its namespace whole.

Before, each pod or claim CREATE in a namespace with a qgpu quota read all of the namespace's
pods and claims in one answer: a tenant with ``edit`` made pods that ask no GPU (the webhook never
judges them) each near etcd's 1.5 MiB object limit, and the next GPU pod's check decoded all of
them at once (20 such pods: 106 → 411 MiB of a 256 MiB container), the replica was OOM-killed and,
the webhook failing closed, GPU pods and qgpu claims of every namespace were refused. With the
stand-in API of test_claim_quota_serving.py, which pages as the apiserver does.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

from qgpu_runtime.kube import paging
from qgpu_runtime.kube.paging import LIST_PAGE_BYTES, LIST_PAGE_ITEMS
from qgpu_runtime.webhook.quota import Verdict
from tests.webhook.test_claim_quota_serving import FakeApi, Response, claim, guard, page
from tests.webhook.test_claim_quota_serving import review as claim_review
from tests.webhook.test_pod_quota import CARD, pod, review

# One pod's environment as a tenant can make it: ~0.9 MiB of JSON, several times that decoded.
HEAVY_ENV = [{"name": f"E{i:05d}", "value": "v" * 24} for i in range(20_000)]


def heavy_pod(name: str) -> dict[str, Any]:
    doc = pod(name, {"cpu": "1"})
    doc["spec"]["containers"][0]["env"] = HEAVY_ENV  # one list shared by every pod of the fixture
    return doc


def test_a_namespace_is_listed_a_page_at_a_time_and_charged_whole():
    """250 shares of 1 GiB: three pages of pods, every one charged."""
    shares = [pod(f"s{i}", {"tke.cloud.tencent.com/qgpu-core": "1", "tke.cloud.tencent.com/qgpu-memory": "1"}) for i in range(250)]
    api = FakeApi(hard_core=100_000, hard_memory=252 * 1024, pods=shares, claims=[claim("c", 10)])
    verdict = guard(api).check_pod(review("more", {"tke.cloud.tencent.com/qgpu-core": "1", "tke.cloud.tencent.com/qgpu-memory": "2"}))
    assert not verdict.allowed
    assert "gpu.qgpu.io/memory used 257024 + requested 2048 > hard 258048" in verdict.message  # 250 GiB + the claim's 1
    assert api.calls.count("pods") == -(-len(shares) // LIST_PAGE_ITEMS) == 3
    assert guard(api).check_pod(review("fits", {"tke.cloud.tencent.com/qgpu-core": "1", "tke.cloud.tencent.com/qgpu-memory": "1"})).allowed


def test_claims_are_charged_across_pages_and_a_claim_is_not_charged_against_itself():
    claims = [claim(f"c{i}", 10) for i in range(150)]  # 1,500 core
    api = FakeApi(hard_core=1600, hard_memory=1000 * 1024, claims=claims)
    assert guard(api)(claim_review("c149", 100)) == Verdict(True)  # a retried CREATE of a listed claim: not itself twice
    verdict = guard(api)(claim_review("new", 200))
    assert not verdict.allowed and "used 1500 + requested 200 > hard 1600" in verdict.message  # c149 listed: no reservation
    assert api.calls.count("claims") == 4  # two pages per check


def test_pages_past_the_byte_cap_are_asked_again_smaller_and_the_connection_is_not_reused():
    heavy = [heavy_pod(f"h{i}") for i in range(12)]
    share = pod("share", {"tke.cloud.tencent.com/qgpu-core": "50", "tke.cloud.tencent.com/qgpu-memory": "4"})
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD, pods=[*heavy, share])
    answered: list[Response] = []

    def list_pods(ns: str, **kwargs: Any) -> Response:
        api.calls.append("pods")
        answered.append(page(api.pods, **kwargs))
        return answered[-1]

    api.list_namespaced_pod = list_pods  # type: ignore[method-assign]
    verdict = guard(api).check_pod(review("more", {"tke.cloud.tencent.com/qgpu-core": "60", "tke.cloud.tencent.com/qgpu-memory": "1"}))
    assert not verdict.allowed and "gpu.qgpu.io/core used 500 + requested 600 > hard 1000" in verdict.message
    too_big = [r for r in answered if len(r.data) > LIST_PAGE_BYTES]
    assert too_big and all(r.closed for r in too_big)  # abandoned half-read: closed, not back in the pool
    assert all(len(r.data) <= LIST_PAGE_BYTES for r in answered if not r.closed)


def test_the_check_holds_a_page_not_the_namespace():
    """The memory the check allocates while it reads twelve ~1 MiB pods stays within a few pages;
    all at once, it was their whole decoded weight."""
    heavy = [heavy_pod(f"h{i}") for i in range(12)]
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD, pods=heavy)
    replica = guard(api, budget_s=300.0)  # tracing allocations makes decoding many times slower
    whole = len(Response({"items": heavy}).data)
    tracemalloc.start()
    try:
        verdict = replica.check_pod(review("gpu", {"nvidia.com/gpu": "1"}))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert verdict == Verdict(True)
    assert whole > 2 * LIST_PAGE_BYTES
    # all at once it was 7.6 times the namespace's body (104 MiB for 13 MiB); now about twice it,
    # most of that the stand-in's own serialisation of each page it is asked for
    assert peak < 3 * whole, (peak, whole)


def test_one_object_past_the_cap_is_a_500_naming_it(monkeypatch):
    monkeypatch.setattr(paging, "LIST_PAGE_BYTES", 64 * 1024)
    monkeypatch.setattr(paging, "OBJECT_BYTES", 128 * 1024)
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD, pods=[heavy_pod("huge")])
    verdict = guard(api).check_pod(review("gpu", {"nvidia.com/gpu": "1"}))
    assert (verdict.allowed, verdict.code) == (False, 500)
    assert "listing Pods of namespace 'team-a': one object's body is larger than 131072 bytes" in verdict.message


def test_one_object_past_the_page_cap_is_read_on_a_page_of_its_own():
    """etcd bounds the stored object, not the apiserver's JSON of it (``<`` is served as six bytes):
    a pod served past 4 MiB stopped every LIST it was on, the extender's pod watch relisting for ever.
    A page of one object is read up to OBJECT_BYTES; the pages around it as before."""
    escaped = heavy_pod("escaped")
    escaped["spec"]["containers"][0]["env"] = [{"name": "X", "value": "\x01" * (LIST_PAGE_BYTES // 6 + 1)}]  # 6 bytes each
    small = [heavy_pod(f"s{i}") for i in range(3)]
    answered: list[Response] = []

    def fetch(limit: int, token: str | None) -> Response:
        answered.append(page(small[:1] + [escaped] + small[1:], limit=limit, _continue=token))
        return answered[-1]

    names = [p["metadata"]["name"] for items in paging.pages(fetch) for p in items]
    assert names == ["s0", "escaped", "s1", "s2"]
    assert any(r.closed for r in answered) and max(len(r.data) for r in answered if not r.closed) > LIST_PAGE_BYTES
