"""What the extender's LISTs keep of the objects a tenant writes while the rest of the pages are
read (extender/watch.py): a ResourceClaim, a ResourceClaimTemplate or a PodDisruptionBudget is
reduced to what the cache keeps of it as its page is read. Held whole until the last page, a few
hundred of them near etcd's object limit were the extender's memory on every (re)list."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

from kubernetes import client as kube

from qgpu_runtime.extender.dra import DraView, ReducedClaim
from qgpu_runtime.extender.watch import CacheFeeder
from qgpu_runtime.placement.disruption import Budget
from tests.extender.test_dra_prioritize import claim
from tests.extender.test_kube_cache import cache
from tests.webhook.test_claim_quota_serving import page

BULK = {f"tenant.example/k{j:05d}": "v" * 60 for j in range(8_000)}  # ~0.7 MiB of labels


def bulky_claim(i: int) -> dict[str, Any]:
    doc = claim(f"c{i}", allocated=[("n1", "gpu-0", 250, 4096)] if i % 2 else [])
    doc["metadata"]["labels"] = dict(BULK)
    return doc


def bulky_template(i: int) -> dict[str, Any]:
    return {"metadata": {"name": f"t{i}", "namespace": "ns", "labels": dict(BULK)}, "spec": {"spec": claim("x")["spec"]}}


def bulky_budget(i: int) -> dict[str, Any]:
    return {"metadata": {"name": f"b{i}", "namespace": "ns", "labels": dict(BULK)},
            "spec": {"selector": {"matchLabels": {"app": "a"}}}, "status": {"disruptionsAllowed": 1}}


def feeder() -> tuple[CacheFeeder, DraView]:
    api = kube.ApiClient()
    dra = DraView()
    return CacheFeeder(kube.CoreV1Api(api), cache(), dra=dra, resource_api=kube.ResourceV1Api(api),
                       policy_api=kube.PolicyV1Api(api)), dra


def listed_held(name: str, make, count: int = 24) -> tuple[list[Any], int, int]:
    """What the kind's LIST hands to ``replace``, the bytes still allocated for it once the pages
    are read (what the LIST accumulated: each object as ``keep`` left it), and the JSON of one
    object (decoded whole, each was several times that)."""
    f, _ = feeder()
    (kind,) = [k for k in f.kinds if k.name == name]
    objects = [make(i) for i in range(count)]
    kind.list_call = lambda **kw: page(objects, **{k: v for k, v in kw.items() if k in ("limit", "_continue")})
    one = len(page(objects[:1]).data)
    replaced: list[list[Any]] = []
    kind.replace = replaced.append
    gc.collect()
    tracemalloc.start()
    try:
        f._list(kind)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    (items,) = replaced
    return items, held, one


def test_claims_are_reduced_as_their_page_is_read_and_the_view_takes_them():
    items, held, one = listed_held("resourceclaims", bulky_claim)
    assert all(isinstance(c, ReducedClaim) for c in items) and len(items) == 24
    assert [c.key for c in items[:2]] == ["ns/c0", "ns/c1"] and items[1].usage and not items[0].usage
    assert held < one, (held, one)  # whole, the 24 claims were ~7 times their JSON
    v = DraView()
    v.replace_claims(items)
    reference = DraView()
    reference.replace_claims([bulky_claim(i) for i in range(24)])
    assert v._asks == reference._asks and v._usage == reference._usage


def test_templates_and_budgets_are_reduced_as_their_page_is_read():
    templates, held, one = listed_held("resourceclaimtemplates", bulky_template)
    assert all(isinstance(t, ReducedClaim) and t.asks for t in templates) and held < one, (held, one)
    budgets, held, one = listed_held("poddisruptionbudgets", bulky_budget)
    assert all(isinstance(b, Budget) for b in budgets) and held < one, (held, one)
    c = cache()
    c.budgets.replace(budgets)
    assert len(c.budgets.in_namespaces(["ns"])) == 24


def test_an_event_and_a_reduced_claim_are_the_same_to_the_view():
    obj = bulky_claim(1)
    a, b = DraView(), DraView()
    a.apply_claim("ADDED", obj)
    b.apply_claim("ADDED", b.reduce_claim(obj))
    assert a._asks == b._asks and a._usage == b._usage and a._asks
    a.apply_claim("DELETED", obj)
    b.apply_claim("DELETED", b.reduce_claim(obj))
    assert a._asks == b._asks == {} and a._usage == b._usage == {}


def test_slices_are_reduced_as_their_page_is_read_and_the_view_takes_them():
    """A node writes its own ResourceSlices, each up to etcd's object limit."""
    from qgpu_runtime.extender.dra import ReducedSlice
    from tests.extender.test_dra_prioritize import rslice

    def bulky_slice(i: int) -> dict[str, Any]:
        doc = rslice(f"n{i}")
        doc["metadata"]["labels"] = dict(BULK)
        return doc

    items, held, one = listed_held("resourceslices", bulky_slice)
    assert all(isinstance(s, ReducedSlice) and s.cards for s in items) and held < one, (held, one)
    v, reference = DraView(), DraView()
    v.replace_slices(items)
    reference.replace_slices([bulky_slice(i) for i in range(24)])
    assert v._slices == reference._slices and len(v._slices) == 24
    v.apply_slice("DELETED", items[0])
    assert len(v._slices) == 23


def test_a_broken_claims_watch_tells_the_view_which_stops_waiting_until_the_relist():
    f, dra = feeder()
    (kind,) = [k for k in f.kinds if k.name == "resourceclaims"]
    dra.replace_claims([])
    dra.replace_templates([])
    assert all(dra._following.values())
    calls: list[int] = []

    def broken_list(**_: Any) -> Any:
        calls.append(1)
        f.stop()  # one failure, then the loop ends
        raise OSError("connection reset")

    kind.list_call = broken_list
    f._run(kind, "")
    assert calls == [1] and dra._following == {"claims": False, "templates": True}
