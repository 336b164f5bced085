"""The node's watched pods (node/podwatch.py) and Allocate on them (node/deviceplugin/allocator.py):
events, relist, the bound, a miss that a LIST answers, a deletion the watch has not delivered, a
record that fails verification, and no LIST in the steady state. A scripted watch source stands in
for the apiserver here; tests/k8s/test_e2e_node_admission.py runs the same against a real one."""

from __future__ import annotations

import copy
import json
import threading
from typing import Any, Iterator

import pytest
from podfactory import pod, qgpu

from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.node.annotationwriter import AnnotationWriter
from qgpu_runtime.node.deviceplugin import matching
from qgpu_runtime.node.deviceplugin.allocator import Allocator
from qgpu_runtime.node.deviceplugin.devices import AllocateRefused
from qgpu_runtime.node.deviceplugin.resources import CATALOG
from qgpu_runtime.node.health import CardHealth
from qgpu_runtime.node.manager import ManagerConfig
from qgpu_runtime.node.metrics import ManagerMetrics
from qgpu_runtime.node.podwatch import ListedPods, NodePodCache, WatchExpired, node_pods, watch_event
from qgpu_runtime.node.reconciler import Reconciler
from qgpu_runtime.node.store import Store
from tests.recordkeys import VERIFIER

NODE = "gpu-node-1"
CORE = CATALOG["tke.cloud.tencent.com/qgpu-core"]
CARDS = {i: CardInfo(i, f"GPU-{i}", "Tesla T4", 16384, i) for i in range(2)}


def versioned(p: dict, version: int) -> dict:
    p = copy.deepcopy(p)
    p["metadata"]["resourceVersion"] = str(version)
    return p


class Source:
    """The apiserver's pods of one node: LISTs counted, watches scripted as lists of events."""

    def __init__(self, pods: list[dict]) -> None:
        self.pods = {p["metadata"]["uid"]: p for p in pods}
        self.version = 100
        self.lists = 0
        self.watches: list[list[tuple[str, dict]] | Exception] = []
        self.patches: list[tuple[str, str, dict]] = []

    def put(self, p: dict) -> dict:
        self.version += 1
        p = versioned(p, self.version)
        self.pods[p["metadata"]["uid"]] = p
        return p

    def list_pods_on_node(self, node: str) -> tuple[list[dict], str]:
        self.lists += 1
        return [copy.deepcopy(p) for p in self.pods.values()], str(self.version)

    def pods_on_node(self, node: str) -> list[dict]:
        return self.list_pods_on_node(node)[0]

    def watch_pods_on_node(self, node: str, version: str, timeout_s: float,
                           stop: threading.Event) -> Iterator[tuple[str, dict[str, Any]]]:
        script = self.watches.pop(0) if self.watches else []
        if isinstance(script, Exception):
            raise script
        yield from script
        stop.set()  # the script is the whole test: end serve()

    def patch_pod_annotations(self, namespace: str, name: str, values: dict) -> None:
        self.patches.append((namespace, name, dict(values)))


class Counting:
    """``derive`` that counts its calls per (uid, version)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, p: dict) -> str | None:
        self.calls.append((p["metadata"]["uid"], p["metadata"].get("resourceVersion", "")))
        return p["metadata"]["name"] if p["status"]["phase"] == "Pending" else None


def gpu_pod(name: str, core: int = 30, card: int = 0, bind_time: int = 1, **kw: Any) -> dict:
    return pod(name, NODE, [("main", qgpu(core, 4), [(card, f"GPU-{card}", core * 10, 4096)])], bind_time=bind_time, **kw)


def test_events_add_change_and_remove_pods_and_derive_runs_once_per_version():
    a, b = versioned(gpu_pod("a"), 1), versioned(gpu_pod("b"), 2)
    source = Source([a])
    derive = Counting()
    cache = NodePodCache(source, NODE, derive)
    assert cache.snapshot() is None  # not synced: callers read by LIST
    cache.relist()
    first = cache.snapshot()
    assert first is not None and first.derived == ("a",)
    cache.apply("ADDED", b)
    running = versioned(b, 3)
    running["status"]["phase"] = "Running"
    cache.apply("MODIFIED", running)
    elsewhere = versioned(a, 4)
    elsewhere["spec"]["nodeName"] = "other-node"
    cache.apply("MODIFIED", elsewhere)  # no longer this node's (cannot happen for a bound pod; still not kept)
    view = cache.snapshot()
    assert view is not None and [p["metadata"]["name"] for p in view.pods] == ["b"] and view.derived == ()
    assert view.generation > first.generation
    cache.apply("DELETED", running)
    assert cache.snapshot().pods == ()  # type: ignore[union-attr]
    cache.apply("BOOKMARK", {"metadata": {"resourceVersion": "99"}})
    assert derive.calls == [(a["metadata"]["uid"], "1"), (b["metadata"]["uid"], "2"), (b["metadata"]["uid"], "3")]


def test_a_relist_derives_only_pods_whose_version_moved():
    a, b = versioned(gpu_pod("a"), 1), versioned(gpu_pod("b"), 2)
    source = Source([a, b])
    derive = Counting()
    cache = NodePodCache(source, NODE, derive)
    cache.relist()
    source.pods[b["metadata"]["uid"]] = versioned(b, 7)
    cache.relist()
    assert [v for _, v in derive.calls] == ["1", "2", "7"]


def test_an_expired_watch_relists_and_a_failed_one_relists_after_a_wait():
    a = versioned(gpu_pod("a"), 1)
    source = Source([a])
    source.watches = [WatchExpired("too old resource version"), ConnectionResetError("cut"), []]
    cache = NodePodCache(source, NODE, Counting(), retry_max_s=0.01)
    cache.serve(threading.Event())
    assert source.lists == 3 and cache.relists == 3
    assert [p["metadata"]["name"] for p in cache.snapshot().pods] == ["a"]  # type: ignore[union-attr]


def test_watch_lines_become_events_and_a_410_becomes_watch_expired():
    assert watch_event(json.dumps({"type": "ADDED", "object": {"metadata": {"uid": "u"}}})) == ("ADDED", {"metadata": {"uid": "u"}})
    with pytest.raises(WatchExpired, match="too old"):
        watch_event(json.dumps({"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}))
    with pytest.raises(ValueError, match="status 500"):
        watch_event(json.dumps({"type": "ERROR", "object": {"code": 500, "message": "boom"}}))
    with pytest.raises(ValueError, match="carries no object"):
        watch_event(json.dumps({"type": "ADDED", "object": [1]}))


def test_more_pods_than_the_bound_stop_the_cache_answering_and_a_fresh_read_refuses_them():
    source = Source([versioned(gpu_pod(f"p{i}"), i + 1) for i in range(3)])
    cache = NodePodCache(source, NODE, Counting(), max_pods=2)
    cache.relist()
    assert cache.snapshot() is None  # callers fall back to a LIST, as before the cache
    with pytest.raises(ValueError, match="has 3 pods: more than max_pods=2"):
        cache.fresh()
    del source.pods[next(iter(source.pods))]
    cache.relist()
    assert cache.snapshot() is not None and len(cache.snapshot().pods) == 2  # type: ignore[union-attr]
    cache.apply("ADDED", versioned(gpu_pod("late"), 50))  # one more by the watch: past the bound again
    assert cache.snapshot() is None
    with pytest.raises(ValueError, match="max_pods=0"):
        NodePodCache(source, NODE, Counting(), max_pods=0)


def test_finished_pods_count_for_nothing_so_a_tenant_parking_them_on_a_node_cannot_stop_its_allocates():
    """Failed and Succeeded pods were kept and counted: past max_pods of them (a tenant creates
    pods with spec.nodeName that kubelet rejects; quota counts only unfinished pods) the cache
    stopped answering and the LIST fallback refused, so every Allocate on the node failed
    (helper audit, 2026-12-01). They are now left out, as every reader treats them as gone."""
    parked = [versioned(gpu_pod(f"parked{i}", phase="Failed"), i + 1) for i in range(5)]
    live = versioned(gpu_pod("live"), 10)
    source = Source([*parked, live])
    cache = NodePodCache(source, NODE, Counting(), max_pods=2)
    cache.relist()
    snap = cache.snapshot()
    assert snap is not None and [p["metadata"]["name"] for p in snap.pods] == ["live"]
    assert [p["metadata"]["name"] for p in cache.fresh().pods] == ["live"]
    # a pod that finishes is dropped as a deleted one is; one more finished pod changes nothing
    done = versioned(live, 11)
    done["status"]["phase"] = "Succeeded"
    cache.apply("MODIFIED", done)
    cache.apply("ADDED", versioned(gpu_pod("parked-late", phase="Failed"), 12))
    snap = cache.snapshot()
    assert snap is not None and snap.pods == () and snap.derived == ()


def test_a_source_without_a_watch_is_read_by_a_list_every_time():
    source = Source([versioned(gpu_pod("a"), 1)])
    view = node_pods(type("Plain", (), {"pods_on_node": source.pods_on_node})(), NODE, Counting())
    assert isinstance(view, ListedPods) and view.snapshot() is None
    assert view.fresh().derived == ("a",) and view.fresh().listed and source.lists == 2


# ---- Allocate on the watched pods --------------------------------------------------------------


@pytest.fixture()
def parts(tmp_path):
    config = ManagerConfig(NODE, (CORE,), plugin_dir=tmp_path / "plugins", state_dir=tmp_path / "state", record_verifier=VERIFIER)
    store = Store(tmp_path / "meta.db")
    store.sync_cards(list(CARDS.values()))
    yield config, store
    store.close()


def admission(parts, source: Source) -> tuple[Allocator, NodePodCache, ManagerMetrics]:
    config, store = parts
    metrics = ManagerMetrics.create(NODE)
    holder: dict[str, Allocator] = {}
    cache: NodePodCache = NodePodCache(source, NODE, lambda p: holder["a"].examine(p))
    allocator = Allocator(config, CARDS, CardHealth(CARDS), store, source, metrics, lambda: Policy.FIXED_SHARE,
                          view=cache, writer=AnnotationWriter(source.patch_pod_annotations))
    holder["a"] = allocator
    cache.relist()
    return allocator, cache, metrics


def units(card: int, count: int) -> tuple[str, ...]:
    return tuple(f"qgpu-core-{card}-{i}" for i in range(count))


def fallbacks(metrics: ManagerMetrics) -> float:
    return metrics.registry.get_sample_value("qgpu_allocate_fallback_lists_total", {"resource": CORE.name}) or 0.0


def test_steady_state_allocate_reads_no_list_and_writes_nothing_before_it_returns(parts):
    source = Source([versioned(gpu_pod("a"), 1)])
    allocator, _, metrics = admission(parts, source)
    lists = source.lists
    grant = allocator.allocate(CORE, units(0, 30))
    assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"
    assert source.lists == lists and fallbacks(metrics) == 0
    assert source.patches == []  # queued, written after Allocate returned
    assert allocator.writer.run_once() and source.patches == [("default", "a", {"qgpu.io/assigned": '["main"]'})]


def test_a_pod_bound_a_moment_ago_that_the_watch_has_not_delivered_is_matched_by_one_list(parts):
    source = Source([])
    allocator, cache, metrics = admission(parts, source)
    source.put(gpu_pod("just-bound"))  # in the apiserver, not yet in the watch
    lists = source.lists
    grant = allocator.allocate(CORE, units(0, 30))
    assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"
    assert source.lists == lists + 1 and fallbacks(metrics) == 1
    assert cache.snapshot().pods == ()  # type: ignore[union-attr]  # the cache learns by its watch, not by the fallback


def test_a_deleted_pod_the_watch_still_shows_does_not_block_the_card_after_a_list(parts):
    old = versioned(gpu_pod("old", core=80, bind_time=1), 1)
    source = Source([old])
    allocator, cache, metrics = admission(parts, source)
    allocator.allocate(CORE, units(0, 80))
    del source.pods[old["metadata"]["uid"]]  # deleted: the watch has not said so yet
    newer = source.put(gpu_pod("new", core=80, bind_time=2))
    cache.apply("ADDED", newer)  # the new pod is delivered; the deletion still lags
    grant = allocator.allocate(CORE, units(0, 80))
    assert grant.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0" and fallbacks(metrics) == 1


def test_a_record_that_fails_verification_is_examined_once_and_refused_every_time(parts, monkeypatch):
    forged = versioned(gpu_pod("forged", signed=False), 1)
    source = Source([forged])
    checks: list[str] = []
    real = matching.trusted_record
    monkeypatch.setattr(matching, "trusted_record", lambda p, v: checks.append(p["metadata"]["name"]) or real(p, v))
    allocator, _, metrics = admission(parts, source)
    for _ in range(3):
        with pytest.raises(AllocateRefused, match="forged.*signature is missing"):
            allocator.allocate(CORE, units(0, 30))
    assert checks.count("forged") == 1  # the fallback LISTs find the version the cache already examined
    assert fallbacks(metrics) == 3
    assert metrics.registry.get_sample_value("qgpu_untrusted_records_total", {"resource": CORE.name}) == 3


def test_allocate_reuses_the_match_get_preferred_allocation_made(parts, monkeypatch):
    source = Source([versioned(gpu_pod("a", card=1), 1)])
    allocator, _, _ = admission(parts, source)
    chosen: list[int] = []
    real = matching.choose
    monkeypatch.setattr(matching, "choose", lambda *a: chosen.append(1) or real(*a))
    ids = allocator.preferred(CORE, [f"qgpu-core-{c}-{i}" for c in (0, 1) for i in range(100)], [], 30)
    assert all(d.startswith("qgpu-core-1-") for d in ids)
    allocator.allocate(CORE, tuple(ids))
    assert len(chosen) == 1


def test_the_reconciler_confirms_a_release_on_a_list_so_a_pod_the_watch_lags_is_kept(parts):
    config, store = parts
    source = Source([])
    allocator, cache, _ = admission(parts, source)
    source.put(gpu_pod("late"))
    allocator.allocate(CORE, units(0, 30))  # matched by the fallback LIST; the watch has not delivered it
    reconciler = Reconciler(config, store, source, allocator.lock, view=cache, writer=allocator.writer)
    assert reconciler.release_gone() == {} and len(store.grants()) == 1
    source.pods.clear()
    assert list(reconciler.release_gone()) == [gpu_pod("late")["metadata"]["uid"]] and store.grants() == []


def test_the_reconciler_reissues_an_assigned_annotation_that_never_landed(parts):
    config, store = parts
    source = Source([versioned(gpu_pod("a"), 1)])
    allocator, cache, _ = admission(parts, source)
    allocator.allocate(CORE, units(0, 30))
    allocator.writer = AnnotationWriter(source.patch_pod_annotations)  # the queued write lost (a crash)
    reconciler = Reconciler(config, store, source, allocator.lock, view=cache, writer=allocator.writer)
    reconciler.release_gone()
    assert allocator.writer.run_once() and source.patches == [("default", "a", {"qgpu.io/assigned": '["main"]'})]
