"""The parts of the extender's cache that have logic of their own (issue 24 §2): the per-node
index of bookings answers what a scan of every booking answered, in the same order; releasing a
booking ends its hold while setting it aside does not; the node view says when the state must be
rebuilt; an untrusted record is reported once per change; the pod mirror stays bounded."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from qgpu_runtime.contract.leases import Commitment
from qgpu_runtime.extender import memo, podmirror
from qgpu_runtime.extender.committed import PHANTOM
from qgpu_runtime.extender.memo import PARSED_WEIGHT, ParsedRequests
from qgpu_runtime.extender.nodeview import NodeView
from qgpu_runtime.extender.pacing import ChangePacer
from qgpu_runtime.extender.podmirror import PodMirror
from qgpu_runtime.extender.recordtrust import UntrustedRecords
from qgpu_runtime.model.requests import (
    DEFAULT_LIMITS,
    MAX_MODEL_NAME_CHARS,
    MAX_MODEL_NAMES,
    CardLimits,
    RequestError,
    parse_pod,
)
from qgpu_runtime.placement import engine
from tests.extender.test_kube_cache import SEC, bind_locally, cache, node, pod


def _scanned(c, node_name: str, except_key: str = "") -> list[Commitment]:
    """booked_on as it was before the index: every booking in the cluster, in the state's order."""
    with c.lock:
        out = []
        for key, placement in c.state().bookings.items():
            if placement.node != node_name or key == except_key or c._pods.held(key) or key.startswith(PHANTOM):
                continue
            entry = c._pods.entry(key)
            out.append(Commitment.of(entry.uid if entry and entry.uid else key, key, placement, 0))
        return out


def test_booked_on_answers_what_a_scan_of_every_booking_answered():
    rng = random.Random(24)
    c = cache(ttl_s=5)
    c.replace_nodes([node(n, n_cards=2) for n in "abcd"])
    now = SEC
    pods: dict[str, dict] = {}
    for step in range(400):
        now += rng.randrange(SEC // 2)
        name = f"p{rng.randrange(40)}"
        p = pods.get(name) or pod(name, core=rng.choice((10, 25, 50)), memory=rng.choice((1, 4, 8)))
        action = rng.randrange(8)
        try:
            if action == 0:
                c.filter(p, parse_pod(p), list("abcd"), now_ns=now)
            elif action == 1:
                pods[name] = bind_locally(c, p, rng.choice("abcd"), now)
            elif action == 2 and name in pods:
                c.apply_pod("MODIFIED", pods[name])  # the watch delivers our record
            elif action == 3:
                c.unreserve(p, c._pods.pinned(f"ns/{name}") or "")  # a failed bind of what this key holds
            elif action == 4:
                c.apply_pod("DELETED", p)
                pods.pop(name, None)
            elif action == 5:
                c.expire(now)
            elif action == 6:
                c.prioritize(p, parse_pod(p), list("abcd"))
            elif step % 50 == 7:
                c.replace_nodes([node(n, n_cards=2) for n in rng.sample("abcde", 4)])
        except engine.Unschedulable:
            pass
        for n in "abcde":
            for except_key in ("", f"ns/{name}"):
                assert c.committed.booked_on(n, except_key) == _scanned(c, n, except_key), (step, n)


def test_release_ends_the_hold_and_bumps_the_version_set_aside_does_neither():
    c = cache()
    x = pod("x")
    c.reserve(x, parse_pod(x), "a", 1)
    state, booked, pods = c.state(), c._booked, c._pods
    placement = c.booking("ns/x")
    assert placement is not None and booked.keys_on("a") == ["ns/x"]
    pods.hold("ns/x", 1)
    version = booked.version
    assert booked.set_aside(state, "ns/x") == placement
    assert pods.held("ns/x") and booked.version == version and booked.keys_on("a") == []
    booked.commit(state, "ns/x", placement)
    assert booked.keys_on("a") == ["ns/x"] and booked.version == version + 1
    assert booked.release(state, "ns/x") == placement
    assert not pods.held("ns/x") and booked.version == version + 2 and booked.keys_on("a") == []


def test_a_rebuild_indexes_the_bookings_it_replays():
    c = cache()
    p = bind_locally(c, pod("p"), "a", 1)
    c.apply_pod("MODIFIED", p)
    c.replace_nodes([node("a"), node("b"), node("c")])  # the node set changed: the state is rebuilt
    assert c.booking("ns/p") is not None and c._booked.keys_on("a") == ["ns/p"]
    assert [b.pod for b in c.committed.booked_on("a")] == ["ns/p"]


def test_the_node_view_says_when_the_state_must_be_rebuilt():
    problems: list[str] = []
    view = NodeView(problems.append)
    assert view.apply("ADDED", node("a")) is True
    assert view.apply("MODIFIED", node("a")) is False  # same spec: the state stands
    assert view.apply("MODIFIED", node("a", n_cards=3)) is True
    assert view.apply("DELETED", {"metadata": {"name": "a"}}) is True
    assert view.apply("DELETED", {"metadata": {"name": "a"}}) is False
    assert view.names() == [] and problems == []


def test_a_node_flapping_its_spec_rebuilds_the_state_a_few_times_then_once_per_interval():
    """A compromised node alternating two valid inventories (a card's memory 32768 <-> 16384)
    rebuilt the whole ClusterState under the cache's one lock on every change (helper audit,
    2026-12-01). It may change CHANGE_BURST times at once, then once per interval; its latest
    spec waits and applies when it may change again; another node is not held back."""
    now = [100.0]
    view = NodeView(lambda _: None, ChangePacer(lambda: now[0], burst=3, interval_s=5.0))
    assert view.apply("ADDED", node("a")) is True  # the first of three
    flips = [view.apply("MODIFIED", node("a", memory_mib=m)) for m in [16384, 32768] * 10]
    # the burst's last two, then every change away from the current spec waits (and every change
    # back to it drops what waited)
    assert flips == [True, True] + [False] * 18 and view.paced.held_back == 9
    assert view.spec("a").cards[0].memory_mib == 32768 and view.paced.waiting == {}  # the last flip came back to it
    assert view.apply("MODIFIED", node("a", memory_mib=8192)) is False  # waits
    assert view.take_due() is False and view.spec("a").cards[0].memory_mib == 32768
    assert view.apply("ADDED", node("b")) is True  # other nodes change as ever
    now[0] += 5.0
    assert view.take_due() is True and view.spec("a").cards[0].memory_mib == 8192 and view.paced.waiting == {}
    assert view.take_due() is False  # nothing waits: no work
    # a node that changes rarely is never held back
    for _ in range(4):
        now[0] += 5.0
        assert view.apply("MODIFIED", node("b", n_cards=3 if _ % 2 else 1)) is True


def test_a_flapping_node_costs_the_cache_one_rebuild_per_interval():
    c = cache()
    now = [c._nodes.paced.pacer.clock()]
    c._nodes.paced.pacer.clock = lambda: now[0]  # the test's clock, from where the cache's was
    c.state()
    versions = [c._booked.version]
    for i in range(40):
        c.apply_node("MODIFIED", node("a", memory_mib=16384 if i % 2 == 0 else 32768))
        c.state()
        versions.append(c._booked.version)
    rebuilds = len(set(versions)) - 1
    assert rebuilds <= 10, rebuilds  # the burst (10), not forty
    c.apply_node("MODIFIED", node("a", memory_mib=8192))
    now[0] += 60.0
    assert c.state().card_mem_cap[c.state().index["a"], 0] != 8192  # waits for a top-level call
    c.take_due_nodes()  # the expiry loop's, every period (a node event does the same)
    assert c.state().card_mem_cap[c.state().index["a"], 0] == 8192  # the latest, once due


def test_an_untrusted_record_is_reported_once_per_change():
    problems: list[str] = []
    records = UntrustedRecords(problems.append)
    records.note("ns/p", "unsigned")
    records.note("ns/p", "unsigned")
    records.note("ns/p", "signed for another pod")
    assert len(problems) == 2 and records.copy() == {"ns/p": "signed for another pod"}
    records.note("ns/p", None)
    assert records.copy() == {}


def test_the_pod_mirror_keeps_a_bounded_number_of_seen_and_gone_pods(monkeypatch):
    monkeypatch.setattr(podmirror, "SEEN_PODS", 3)
    monkeypatch.setattr(podmirror, "GONE_PODS", 2)
    mirror = PodMirror()
    for i in range(5):
        mirror.saw(f"u{i}", {"metadata": {"uid": f"u{i}"}})
        mirror.link(f"u{i}", f"ns/p{i}")
    assert [mirror.seen(f"u{i}") is not None for i in range(5)] == [False, False, True, True, True]
    for i in range(3):
        mirror.forget(f"u{i}")
    assert [mirror.gone(f"u{i}") for i in range(3)] == [False, True, True]
    assert mirror.key_of("u0") is None and mirror.key_of("u3") == "ns/p3"


def test_a_node_change_keeps_holds_and_binds_in_flight():
    """A node joining (or any change of the node set) rebuilds the state; filter's tentative hold
    and a bind's booking whose record is not written yet have nothing to be rebuilt from, so they
    are replayed from the state set aside. Before this, they were lost and the next filter could
    book the same card for another pod."""
    c = cache()
    c.replace_nodes([node("a", n_cards=1)])
    held, inflight, other = pod("held", core=60, memory=8), pod("inflight", core=30, memory=4), pod("other", core=60, memory=8)
    c.filter(held, parse_pod(held), ["a"], now_ns=SEC)
    c.reserve(inflight, parse_pod(inflight), "a", SEC)
    before = {k: c.booking(k) for k in ("ns/held", "ns/inflight")}
    assert all(before.values())
    c.apply_node("ADDED", node("b", n_cards=1))
    assert {k: c.booking(k) for k in before} == before
    outcome = c.filter(other, parse_pod(other), ["a", "b"], now_ns=2 * SEC)
    assert c.booking("ns/other").node == "b", outcome


# -- ParsedRequests: a pod version parsed once for filter, prioritize and bind ----------------------



def _counting_parse(monkeypatch) -> list[str]:
    calls: list[str] = []

    def parse(p, limits):
        calls.append(p["metadata"]["name"])
        return parse_pod(p, limits)

    monkeypatch.setattr(memo, "parse_pod", parse)
    return calls


def test_a_pod_version_is_parsed_once_and_a_new_version_again(monkeypatch):
    calls = _counting_parse(monkeypatch)
    parsed = ParsedRequests()
    first = parsed.of(pod("p", version="7"), DEFAULT_LIMITS)
    assert parsed.of(pod("p", version="7"), DEFAULT_LIMITS) is first and calls == ["p"]
    resized = parsed.of(pod("p", core=50, version="8"), DEFAULT_LIMITS)  # a new version: parsed, not remembered
    assert resized.containers[0].core_milli == 500 and first.containers[0].core_milli == 300 and calls == ["p", "p"]
    other_limits = CardLimits(gib_per_shared_pod=8)
    parsed.of(pod("p", version="8"), other_limits)  # the limits are part of the answer
    assert calls == ["p", "p", "p"]


def test_a_pod_without_uid_or_version_and_a_pod_that_does_not_parse_are_parsed_every_time(monkeypatch):
    calls = _counting_parse(monkeypatch)
    parsed = ParsedRequests()
    unversioned = pod("u")
    parsed.of(unversioned, DEFAULT_LIMITS)
    parsed.of(unversioned, DEFAULT_LIMITS)
    no_uid = pod("n", version="3")
    no_uid["metadata"]["uid"] = ""
    parsed.of(no_uid, DEFAULT_LIMITS)
    parsed.of(no_uid, DEFAULT_LIMITS)
    bad = pod("b", core=130, version="4")  # more than one card but not whole cards
    for _ in range(2):
        with pytest.raises(RequestError):
            parsed.of(bad, DEFAULT_LIMITS)
    assert calls == ["u", "u", "n", "n", "b", "b"] and len(parsed) == 0


def test_the_parsed_pods_are_bounded_oldest_first(monkeypatch):
    calls = _counting_parse(monkeypatch)
    parsed = ParsedRequests(size=3)
    pods = [pod(f"p{i}", version="1") for i in range(4)]
    for p in pods[:3]:
        parsed.of(p, DEFAULT_LIMITS)
    parsed.of(pods[0], DEFAULT_LIMITS)  # used again: now the newest
    parsed.of(pods[3], DEFAULT_LIMITS)  # p1, the least recently used, goes
    assert len(parsed) == 3
    calls.clear()
    parsed.of(pods[0], DEFAULT_LIMITS)
    parsed.of(pods[1], DEFAULT_LIMITS)
    assert calls == ["p1"]


def test_a_newer_version_of_a_pod_replaces_the_older_one(monkeypatch):
    """Every status write gives a pod a new resourceVersion; the verbs ask about the latest. Each
    version used to stay for 4,096 more parses."""
    calls = _counting_parse(monkeypatch)
    parsed = ParsedRequests()
    for version in range(1, 101):
        parsed.of(pod("p", version=str(version)), DEFAULT_LIMITS)
    assert len(parsed) == 1 and parsed.weight == 2
    calls.clear()
    parsed.of(pod("p", version="100"), DEFAULT_LIMITS)
    parsed.of(pod("p", version="99"), DEFAULT_LIMITS)  # parsed again, and now the one kept
    assert calls == ["p"] and len(parsed) == 1


def test_a_deleted_pod_is_forgotten_and_another_pods_entry_stays(monkeypatch):
    calls = _counting_parse(monkeypatch)
    parsed = ParsedRequests()
    parsed.of(pod("gone", version="1"), DEFAULT_LIMITS)
    parsed.of(pod("kept", version="1"), DEFAULT_LIMITS)
    parsed.forget("uid-gone")
    parsed.forget("uid-never-seen")
    assert len(parsed) == 1 and parsed.weight == 2
    calls.clear()
    parsed.of(pod("kept", version="1"), DEFAULT_LIMITS)
    parsed.of(pod("gone", version="1"), DEFAULT_LIMITS)
    assert calls == ["gone"]


def _at_the_model_bound(i: int) -> dict:
    """A pod whose three model lists are at the parser's bound: 16 names of 96 characters each."""
    names = [f"NVIDIA {n:02d}" + "X" * 87 for n in range(MAX_MODEL_NAMES)]
    assert {len(n) for n in names} == {MAX_MODEL_NAME_CHARS}
    return pod(f"p{i}", version="1", annotations={
        "qgpu.io/gpu-model": "|".join(names), "nvidia.com/use-gputype": ",".join(names),
        "nvidia.com/nouse-gputype": ",".join(n.replace("NVIDIA", "TESLA") for n in names)})


def _retained(run) -> int:
    """Bytes still allocated once ``run`` returned and its garbage is collected."""
    gc.collect()
    tracemalloc.start()
    try:
        run()
        gc.collect()
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return current


def test_a_hundred_pods_at_the_model_bound_keep_little_and_nothing_once_deleted():
    """A tenant's pods created, filtered and deleted over and over. At 255 KiB of names a pod
    (which the parser now refuses) each UID kept ~3.2 MiB for 4,096 UIDs, past the extender's
    800 Mi; at the bound a pod keeps under 16 KiB, and a deleted one nothing."""
    parsed = ParsedRequests()
    pods = [_at_the_model_bound(i) for i in range(100)]

    def filter_each() -> None:
        for p in pods:
            parsed.of(p, DEFAULT_LIMITS)

    assert _retained(filter_each) < 100 * 16 * 1024
    assert len(parsed) == 100 and parsed.weight == 100 * (1 + 1 + 3 * MAX_MODEL_NAMES)

    recycled = ParsedRequests()

    def filter_then_delete_each() -> None:  # created, filtered, deleted (forgotten)
        for p in pods:
            recycled.of(p, DEFAULT_LIMITS)
        for p in pods:
            recycled.forget(p["metadata"]["uid"])

    assert _retained(filter_then_delete_each) < 64 * 1024
    assert len(recycled) == 0 and recycled.weight == 0


def test_what_the_memo_keeps_is_bounded_by_its_weight_whatever_pods_carry():
    """The apiserver bounds a pod's containers only by its 1.5 MiB: thousands of GPU containers
    parse (each asks one card). Each counts against the memo's weight, so pods of many containers
    make it keep fewer pods, never more containers in all (by default 16,384, ~3 MiB); a pod
    heavier than the whole memo is parsed, not kept."""
    def crowded(i: int, n: int) -> dict:
        return {"metadata": {"name": f"p{i}", "namespace": "ns", "uid": f"u{i}", "resourceVersion": "1"},
                "spec": {"containers": [{"name": f"c{j}", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
                                        for j in range(n)]}}

    assert PARSED_WEIGHT == 16_384
    parsed = ParsedRequests(weight=1000)
    kept = _retained(lambda: [parsed.of(crowded(i, 300), DEFAULT_LIMITS) for i in range(30)])
    assert len(parsed) == 3 and parsed.weight == 3 * 301
    assert kept < 2**19  # all 30 kept: ~1.8 MiB
    assert len(parsed.of(crowded(99, 1000), DEFAULT_LIMITS).containers) == 1000 and len(parsed) == 3


def test_the_cache_forgets_a_pods_parse_when_the_watch_says_it_was_deleted():
    c = cache()
    p = pod("p", version="1")
    c.apply_pod("ADDED", p)
    c.requests.of(p, DEFAULT_LIMITS)
    assert len(c.requests) == 1
    c.apply_pod("DELETED", p)
    assert len(c.requests) == 0 and c.requests.weight == 0
