"""T9k groups, all or none (issue 22 §2): membership, size, holds at bind, the bind that completes a
group, the timeout and its rest. The cache is the real one; the apiserver the binder POSTs Bindings
to is a real HTTP server that records them (the boundary a unit test cannot run)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from qgpu_runtime.extender.binder import Binder, BindError
from qgpu_runtime.extender.cache import AllocationCache, GroupError
from qgpu_runtime.extender.groups import (
    GROUP_LABEL,
    MAX_GROUP_MEMBERS,
    MIN_MEMBER_ANNOTATION,
    GroupKey,
    Groups,
    group_of,
    min_members,
)
from qgpu_runtime.model.requests import DEFAULT_LIMITS, parse_pod
from qgpu_runtime.placement.policies import make_policy
from tests.extender.test_kube_cache import node, pod
from tests.recordkeys import SIGNER, VERIFIER

SEC = 10**9


def member(name: str, group: str = "g", namespace: str = "ns", core: int = 100, **kwargs: object) -> dict:
    p = pod(name, core=core, memory=0, **kwargs)  # type: ignore[arg-type]
    p["metadata"]["namespace"] = namespace
    p["metadata"]["labels"] = {GROUP_LABEL: group}
    return p


def group_cache(timeout_s: int = 60, n_cards: int = 2) -> AllocationCache:
    c = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER, group_timeout_ns=timeout_s * SEC)
    c.replace_nodes([node("a", n_cards=n_cards), node("b", n_cards=n_cards)])
    c.replace_pods([])
    return c


class Apiserver:
    """A real HTTP server taking pods/binding POSTs (201 for each, or ``fail`` for the pod names in it)
    and answering LISTs of pods with the ``pods`` created in it, by namespace and group label."""

    def __init__(self) -> None:
        self.bound: list[tuple[str, str, dict]] = []  # (pod, node, annotations) in POST order
        self.fail: dict[str, int] = {}
        self.pods: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # noqa: ANN002
                pass

            def do_GET(self) -> None:  # noqa: N802
                url = urlparse(self.path)
                namespace = url.path.split("/")[4]
                selector = parse_qs(url.query)["labelSelector"][0]
                label, value = selector.split("=", 1)
                items = [p for p in outer.pods if p["metadata"]["namespace"] == namespace
                         and (p["metadata"].get("labels") or {}).get(label) == value]
                answer = json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                name = self.path.split("/")[-2]
                status = outer.fail.get(name, 201)
                if status == 201:
                    outer.bound.append((name, body["target"]["name"], body["metadata"].get("annotations") or {}))
                answer = json.dumps({"kind": "Status", "apiVersion": "v1", "code": status,
                                     "message": f"answered {status}"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        configuration = client.Configuration(host=f"http://127.0.0.1:{self.httpd.server_address[1]}")
        configuration.retries = False
        self.api = client.CoreV1Api(client.ApiClient(configuration))
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def names(self) -> list[str]:
        return [name for name, _, _ in self.bound]


@pytest.fixture
def apiserver() -> Iterator[Apiserver]:
    server = Apiserver()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def created(c: AllocationCache, server: Apiserver, *pods: dict) -> None:
    """Pods created at the apiserver and delivered by the watch."""
    for p in pods:
        server.pods.append(p)
        c.apply_pod("ADDED", p)


def filtered(c: AllocationCache, p: dict) -> None:
    c.apply_pod("ADDED", p)
    outcome = c.filter(p, parse_pod(p), ["a", "b"], now_ns=time.time_ns())
    assert outcome.passed, outcome


# -- identity, size, annotation ----------------------------------------------------------------------

def test_a_group_is_the_label_value_within_the_pods_namespace():
    assert group_of(member("p", "g", "team-a")) == GroupKey("team-a", "g")
    assert group_of(member("p", "g", "team-a")) != group_of(member("p", "g", "team-b"))
    assert group_of(pod("plain")) is None


@pytest.mark.parametrize("raw", ["0", "-1", "x", "2.5", str(MAX_GROUP_MEMBERS + 1)])
def test_a_bad_min_member_annotation_is_refused_naming_pod_annotation_value_and_rule(raw):
    p = member("p", annotations={MIN_MEMBER_ANNOTATION: raw})
    with pytest.raises(GroupError, match=rf"pod ns/p: annotation {MIN_MEMBER_ANNOTATION}='{raw}': must be an integer in 1\.\.64"):
        min_members(p)


def test_size_is_the_live_members_raised_to_the_largest_min_member():
    groups = Groups(60 * SEC)
    g = GroupKey("ns", "g")
    groups.observe("ns/p1", member("p1"), gone=False, bound=False)
    groups.observe("ns/p2", member("p2", annotations={MIN_MEMBER_ANNOTATION: "4"}), gone=False, bound=False)
    groups.observe("ns/other", member("other", namespace="other"), gone=False, bound=False)
    progress = groups.progress(g, "ns/p1", [])
    assert (progress.size, progress.placed, progress.members) == (4, 1, 2)
    assert progress.waiting() == f"group ns/g ({GROUP_LABEL}) waits for 3 more of 4 members to be placed"
    groups.observe("ns/p2", {"metadata": {"name": "p2", "namespace": "ns"}}, gone=True, bound=False)
    assert groups.progress(g, "ns/p1", []).complete  # p2 is gone: a group of one, placed


def test_bound_members_count_as_placed():
    groups = Groups(60 * SEC)
    groups.observe("ns/p1", member("p1"), gone=False, bound=True)
    groups.observe("ns/p2", member("p2"), gone=False, bound=False)
    assert groups.progress(GroupKey("ns", "g"), "ns/p2", []).complete


def test_a_group_of_more_than_the_bound_is_refused():
    groups = Groups(60 * SEC)
    for i in range(MAX_GROUP_MEMBERS):
        groups.observe(f"ns/p{i}", member(f"p{i}"), gone=False, bound=False)
    with pytest.raises(GroupError, match=f"group ns/g has {MAX_GROUP_MEMBERS + 1} live members: at most {MAX_GROUP_MEMBERS}"):
        groups.check_may_hold(GroupKey("ns", "g"), "ns/extra", 0)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * SEC

    def __call__(self) -> int:
        return self.now


def test_a_group_of_unstated_size_settles_until_its_newest_member_is_settle_old():
    """Pods created one after another join one group: a group none of whose pods carries the size
    annotation is not complete until its newest member has been known for the settle window."""
    clock = Clock()
    groups = Groups(60 * SEC, 5 * SEC, clock)
    g = GroupKey("ns", "g")
    groups.observe("ns/p1", member("p1"), gone=False, bound=False)
    first = groups.progress(g, "ns/p1", [])
    assert (first.size, first.placed, first.complete, first.settling_ns) == (1, 1, False, 5 * SEC)
    assert first.waiting() == (f"group ns/g ({GROUP_LABEL}) has all 1 known members placed and waits 5.0 s more for "
                               f"members still being created (its newest member appeared just now; the annotation "
                               f"{MIN_MEMBER_ANNOTATION} states the size and skips the wait)")
    clock.now += 3 * SEC
    groups.observe("ns/p2", member("p2"), gone=False, bound=False)  # the controller's next pod
    clock.now += 3 * SEC  # p1 is 6 s old, p2 3 s
    second = groups.progress(g, "ns/p1", [])
    assert (second.size, second.placed, second.complete) == (2, 1, False)
    assert "waits for 1 more of 2" in second.waiting()
    groups.observe("ns/p2", member("p2"), gone=False, bound=True)  # an update keeps when it was first seen
    assert groups.progress(g, "ns/p1", []).settling_ns == 2 * SEC
    clock.now += 2 * SEC
    assert groups.progress(g, "ns/p1", []).complete


def test_a_member_not_yet_watched_restarts_the_settle_and_a_stated_size_skips_it():
    clock = Clock()
    groups = Groups(60 * SEC, 5 * SEC, clock)
    g = GroupKey("ns", "g")
    groups.observe("ns/p1", member("p1"), gone=False, bound=False)
    clock.now += 10 * SEC
    assert groups.progress(g, "ns/p1", []).complete
    assert groups.progress(g, "ns/p9", []).settling_ns == 5 * SEC  # the arriving pod the watch has not shown
    groups.observe("ns/p2", member("p2", annotations={MIN_MEMBER_ANNOTATION: "2"}), gone=False, bound=True)
    assert groups.progress(g, "ns/p1", []).complete  # the size is stated: no wait


def test_the_settle_must_stay_below_the_timeout():
    with pytest.raises(ValueError, match="group settle .* below the timeout"):
        Groups(5 * SEC, 5 * SEC)


def test_a_settling_member_is_held_and_its_retry_after_the_window_binds_it(apiserver):
    clock = Clock()
    c = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER, group_timeout_ns=60 * SEC,
                        group_settle_ns=5 * SEC)
    c._groups.clock_ns = clock  # the window runs on a clock the test moves
    c.replace_nodes([node("a", n_cards=2), node("b", n_cards=2)])
    c.replace_pods([])
    binder = Binder(apiserver.api, c, DEFAULT_LIMITS, signer=SIGNER)
    p0 = member("p0")
    created(c, apiserver, p0)
    filtered(c, p0)
    with pytest.raises(BindError, match="waits 5.0 s more for members still being created"):
        binder.bind("ns", "p0", "uid-p0", "a")
    assert apiserver.bound == [] and c.booking("ns/p0").node == "a"
    clock.now += 5 * SEC
    binder.bind("ns", "p0", "uid-p0", "a")
    assert apiserver.names() == ["p0"]


# -- binds ----------------------------------------------------------------------------------------------

def test_a_group_of_three_that_fits_binds_all_three_at_the_third_bind(apiserver):
    c = group_cache()
    binder = Binder(apiserver.api, c, DEFAULT_LIMITS, signer=SIGNER)
    pods = [member(f"p{i}") for i in range(3)]
    created(c, apiserver, *pods)
    for p, target in zip(pods[:2], ("a", "a")):
        filtered(c, p)
        with pytest.raises(BindError, match=r"group ns/g .* waits for 2 more of 3|group ns/g .* waits for 1 more of 3"):
            binder.bind("ns", p["metadata"]["name"], p["metadata"]["uid"], target)
    assert apiserver.bound == []
    assert c.booking("ns/p0").node == "a" and c.booking("ns/p1").node == "a"  # held: nobody else takes them
    filtered(c, pods[2])
    binder.bind("ns", "p2", "uid-p2", "b")
    assert apiserver.names() == ["p0", "p1", "p2"]  # the held ones first, the completing one last
    assert [n for _, n, _ in apiserver.bound] == ["a", "a", "b"]
    assert all("qgpu.io/allocation" in notes for _, _, notes in apiserver.bound)


def test_a_held_member_filters_to_its_held_node_only_and_keeps_its_cards(apiserver):
    c = group_cache()
    binder = Binder(apiserver.api, c, DEFAULT_LIMITS, signer=SIGNER)
    p0, p1 = member("p0"), member("p1")
    created(c, apiserver, p1)
    filtered(c, p0)
    with pytest.raises(BindError, match="waits for 1 more of 2"):
        binder.bind("ns", "p0", "uid-p0", "b")
    held = c.booking("ns/p0")
    outcome = c.filter(p0, parse_pod(p0), ["a", "b"], now_ns=time.time_ns())
    assert outcome.passed == ["b"]
    assert "held on node b" in outcome.failed["a"]
    assert c.booking("ns/p0") == held


def test_the_timeout_releases_the_held_cards_and_the_group_rests(apiserver):
    c = group_cache(timeout_s=5, n_cards=1)
    binder = Binder(apiserver.api, c, DEFAULT_LIMITS, signer=SIGNER)
    p0, p1 = member("p0"), member("p1")
    created(c, apiserver, p1)
    filtered(c, p0)
    with pytest.raises(BindError):
        binder.bind("ns", "p0", "uid-p0", "a")
    assert c.booking("ns/p0") is not None
    now = time.time_ns()
    binder.expire_groups(now + 1 * SEC)
    assert c.booking("ns/p0") is not None  # not yet
    binder.expire_groups(now + 6 * SEC)
    assert c.booking("ns/p0") is None
    assert c.group_held("ns/p0") is None
    other = pod("other", core=100, memory=0)
    created(c, apiserver, other)
    assert c.filter(other, parse_pod(other), ["a"], now_ns=now + 6 * SEC).passed == ["a"]  # the card is free
    with pytest.raises(GroupError, match=r"group ns/g: its held placements were released after 5 s .* holds again in"):
        c.filter(p0, parse_pod(p0), ["a", "b"], now_ns=now + 7 * SEC)
    assert c.filter(p0, parse_pod(p0), ["a", "b"], now_ns=now + 12 * SEC).passed  # rested: may hold again


def test_a_deleted_member_drops_its_hold_and_the_rest_may_complete(apiserver):
    c = group_cache()
    binder = Binder(apiserver.api, c, DEFAULT_LIMITS, signer=SIGNER)
    p0, p1, p2 = member("p0"), member("p1"), member("p2")
    created(c, apiserver, p2)
    for p in (p0, p1):
        filtered(c, p)
        with pytest.raises(BindError):
            binder.bind("ns", p["metadata"]["name"], p["metadata"]["uid"], "a")
    c.apply_pod("DELETED", p0)
    assert c.booking("ns/p0") is None and c.group_held("ns/p0") is None
    filtered(c, p2)
    binder.bind("ns", "p2", "uid-p2", "b")
    assert apiserver.names() == ["p1", "p2"]


def test_a_member_whose_binding_fails_stays_held_and_its_next_bind_binds_it(apiserver):
    c = group_cache()
    binder = Binder(apiserver.api, c, DEFAULT_LIMITS, signer=SIGNER)
    p0, p1 = member("p0"), member("p1")
    created(c, apiserver, p1)
    filtered(c, p0)
    with pytest.raises(BindError):
        binder.bind("ns", "p0", "uid-p0", "a")
    apiserver.fail["p0"] = 403
    filtered(c, p1)
    binder.bind("ns", "p1", "uid-p1", "a")  # completes the group; p0's Binding is refused
    assert apiserver.names() == ["p1"]
    assert c.group_held("ns/p0") is not None and c.booking("ns/p0") is not None
    del apiserver.fail["p0"]
    c.filter(p0, parse_pod(p0), ["a", "b"], now_ns=time.time_ns())
    binder.bind("ns", "p0", "uid-p0", "a")
    assert apiserver.names() == ["p1", "p0"]


def test_another_namespaces_pod_with_the_same_label_is_not_a_member(apiserver):
    c = group_cache()
    binder = Binder(apiserver.api, c, DEFAULT_LIMITS, signer=SIGNER)
    mine, theirs = member("p0", namespace="ns"), member("x", namespace="other")
    created(c, apiserver, theirs)
    filtered(c, mine)
    binder.bind("ns", "p0", "uid-p0", "a")  # a group of one: bound at once, not held for "other"'s pod
    assert apiserver.names() == ["p0"]


def test_a_member_the_watch_has_not_delivered_yet_still_counts(apiserver):
    """kube-scheduler can bind the first pod of a group before the extender's watch saw the others:
    the apiserver's list of the group decides before the group counts as complete."""
    c = group_cache()
    binder = Binder(apiserver.api, c, DEFAULT_LIMITS, signer=SIGNER)
    p0, p1 = member("p0"), member("p1")
    apiserver.pods.append(p1)  # created, not yet in the watch
    created(c, apiserver, p0)
    filtered(c, p0)
    with pytest.raises(BindError, match="waits for 1 more of 2"):
        binder.bind("ns", "p0", "uid-p0", "a")
    assert apiserver.bound == []
