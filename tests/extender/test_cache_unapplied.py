"""A pod event the extender's cache cannot apply (extender/cache.py ``apply_pod``): the cache goes on
with every other pod, reports that one once per pod version, and keeps the state it had of it rather
than freeing the cards a bound pod holds. The failure is injected where no input reaches today: a
reader of the pod that raises what no caller foresaw, as ``int()`` of ``qgpu.io/group-min-member: "²"``
did, which broke the pods' watch and every relist (docs/security.md)."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from kubernetes import client as kube

from qgpu_runtime.extender import cache as cache_module
from qgpu_runtime.extender.app import ExtenderApp
from qgpu_runtime.extender.groups import GROUP_LABEL, MIN_MEMBER_ANNOTATION
from qgpu_runtime.extender.watch import CacheFeeder
from qgpu_runtime.model.requests import DEFAULT_LIMITS
from tests.extender.test_kube_cache import bind_locally, cache, pod
from tests.webhook.test_claim_quota_serving import page

NOW = 10**18
BOOM = "invalid literal for int() with base 10: '\u00b2'"


@pytest.fixture
def breaking(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the pods whose reading raises (add to the set); a bare deletion, which carries
    nothing but a name and UID, reads nothing that could."""
    broken: set[str] = set()
    real = cache_module.entry_of

    def entry_of(p: Any, verifier: Any) -> Any:
        if (p.get("metadata") or {}).get("name") in broken and "spec" in p:
            raise ValueError(BOOM)
        return real(p, verifier)

    monkeypatch.setattr(cache_module, "entry_of", entry_of)
    return broken


def version(p: dict, v: str) -> dict:
    return {**p, "metadata": {**p["metadata"], "resourceVersion": v}}


def test_a_relist_applies_every_other_pod_and_keeps_the_one_it_cannot_apply(breaking):
    c = cache()
    b1, b2, b3 = (bind_locally(c, pod(n), "a", NOW) for n in ("p1", "p2", "p3"))
    c.replace_pods([b1, b2])
    kept = c.booking("ns/p1")
    breaking.add("p1")
    c.replace_pods([version(b1, "2"), b2, b3])  # raised at p1, before p2 and p3
    assert c.booking("ns/p1") == kept  # listed, though unreadable: not taken for gone
    assert c.booking("ns/p2") is not None and c.booking("ns/p3") is not None
    assert c.unapplied() == {"ns/p1": f"ValueError: {BOOM}"}


def test_a_bound_pods_event_that_cannot_be_applied_keeps_its_cards_booked(breaking):
    """Dropping the pod would free cards it holds on its node for the next filter to give away."""
    c = cache()
    bound = bind_locally(c, pod("p1", core=100, memory=0), "a", NOW)
    c.apply_pod("ADDED", version(bound, "1"))
    booked = c.booking("ns/p1")
    breaking.add("p1")
    c.apply_pod("MODIFIED", version(bound, "2"))
    assert c.booking("ns/p1") == booked
    c.replace_pods([version(bound, "2")])
    assert c.booking("ns/p1") == booked


def test_an_unapplied_event_is_reported_once_per_pod_version_and_counted_until_one_applies(breaking):
    c = cache()
    app = ExtenderApp(c, None, DEFAULT_LIMITS)
    breaking.add("p1")
    for v in ("2", "2", "2", "3"):
        c.apply_pod("MODIFIED", version(pod("p1"), v))
    reports = [m for m in c.problems if m.startswith("pod ns/p1: its MODIFIED event")]
    assert len(reports) == 2 and "(resourceVersion 2)" in reports[0] and "(resourceVersion 3)" in reports[1]
    assert f"could not be applied (ValueError: {BOOM}); the pod keeps the state" in reports[0]
    app.refresh_gauges()
    assert app.metrics.registry.get_sample_value("qgpu_extender_unapplied_pods") == 1
    breaking.clear()
    c.apply_pod("MODIFIED", version(pod("p1"), "4"))
    app.refresh_gauges()
    assert c.unapplied() == {} and app.metrics.registry.get_sample_value("qgpu_extender_unapplied_pods") == 0


@pytest.mark.parametrize("event, phase", [("DELETED", "Running"), ("MODIFIED", "Succeeded"), ("MODIFIED", "Failed")])
def test_a_pod_that_left_frees_its_cards_even_when_its_event_cannot_be_applied(breaking, event, phase):
    c = cache()
    bound = bind_locally(c, pod("p1"), "a", NOW)
    c.apply_pod("ADDED", bound)
    breaking.add("p1")
    c.apply_pod("MODIFIED", version(bound, "2"))
    assert c.unapplied()
    c.apply_pod(event, {**bound, "status": {"phase": phase}})
    assert c.booking("ns/p1") is None and c.unapplied() == {}
    assert any("applied as the pod's deletion" in m for m in c.problems)


def tenant_pod_with_a_unicode_min_member() -> dict:
    p = pod("evil", core=0, memory=0)
    p["spec"]["containers"][0]["resources"] = {}
    p["metadata"]["labels"] = {GROUP_LABEL: "g"}
    p["metadata"]["annotations"] = {MIN_MEMBER_ANNOTATION: "\u00b2"}
    return p


def test_the_pods_list_with_a_tenants_unicode_min_member_still_syncs_the_cache():
    """The relist after the watch broke met the same pod, raised again, and the cache never synced."""
    c = cache()
    c.synced.clear()
    feeder = CacheFeeder(kube.CoreV1Api(kube.ApiClient()), c)
    (kind,) = [k for k in feeder.kinds if k.name == "pods"]
    feeder.kinds = [kind]
    victim = bind_locally(c, pod("victim"), "a", NOW)
    kind.list_call = lambda **kw: page([tenant_pod_with_a_unicode_min_member(), victim],
                                       **{k: v for k, v in kw.items() if k in ("limit", "_continue")})
    feeder._list(kind)
    assert c.synced.is_set() and c.booking("ns/victim") is not None


class Stream:
    """A watch's answer as the client hands it over unread (``_preload_content=False``)."""

    def __init__(self, events: list[dict]) -> None:
        self.body = "".join(json.dumps(e) + "\n" for e in events).encode()

    def stream(self, amt: Any = None, decode_content: Any = None) -> Iterator[bytes]:
        yield self.body

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


def test_the_watch_skips_an_object_whose_event_raises_and_follows_the_rest():
    """Raising broke the stream into a relist, which met the same object again."""
    c = cache()
    feeder = CacheFeeder(kube.CoreV1Api(kube.ApiClient()), c)
    (kind,) = [k for k in feeder.kinds if k.name == "pods"]
    applied: list[str] = []

    def apply(event: str, obj: Any) -> None:
        if obj["metadata"]["name"] == "bad":
            raise RuntimeError(BOOM)
        applied.append(obj["metadata"]["name"])

    kind.apply = apply
    events = [{"type": "MODIFIED", "object": version(pod(n), v)} for n, v in (("p1", "5"), ("bad", "6"), ("p2", "7"))]
    kind.list_call = lambda **kw: Stream(events)
    assert feeder._follow(kind, "4") == "7"
    assert applied == ["p1", "p2"]
