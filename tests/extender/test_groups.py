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

from qgpu_runtime.contract.names import MIRROR_POD
from qgpu_runtime.extender.binder import Binder, BindError
from qgpu_runtime.extender.cache import AllocationCache, GroupError
from qgpu_runtime.extender.groups import (
    GROUP_LABEL,
    MAX_GROUP_MEMBERS,
    MIN_MEMBER_ANNOTATION,
    GroupKey,
    Groups,
    Listed,
    group_of,
    min_members,
)
from qgpu_runtime.model.requests import DEFAULT_LIMITS, parse_pod
from qgpu_runtime.placement.policies import make_policy
from tests.extender.test_kube_cache import bind_locally, node, pod
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


@pytest.mark.parametrize("raw", ["\u00b2", "\u2460", "\u0664", "\uff14", "064", "9" * 5000])
def test_a_min_member_of_other_digits_than_ascii_or_too_many_is_a_group_error_naming_the_value_cut(raw):
    """``str.isdigit`` passes a superscript two, a circled one, Arabic-Indic and fullwidth digits, and
    ``int`` then raised a ValueError (a 5,000-digit string too), which no caller caught."""
    p = member("p", annotations={MIN_MEMBER_ANNOTATION: raw})
    with pytest.raises(GroupError, match=rf"pod ns/p: annotation {MIN_MEMBER_ANNOTATION}=.*: must be an integer in 1\.\.64") as e:
        min_members(p)
    assert len(str(e.value)) < 200


def test_a_tenant_pod_with_a_unicode_min_member_stops_neither_the_watch_nor_a_relist():
    """One tenant pod (the group label, ``qgpu.io/group-min-member: "\u00b2"``, no GPU asked) raised
    from every watch event and every relist, so the extender's cache never synced again."""
    c = group_cache()
    bad = member("evil", namespace="tenant", core=0)
    bad["spec"]["containers"][0]["resources"] = {}
    bad["metadata"]["annotations"] = {MIN_MEMBER_ANNOTATION: "\u00b2"}
    c.apply_pod("ADDED", bad)  # the watch event
    victim = pod("victim", core=50, memory=4)
    c.replace_pods([bad, bind_locally(c, victim, "a", time.time_ns())])  # the relist
    assert c.booking("ns/victim").node == "a" and c.unapplied() == {}
    with pytest.raises(GroupError, match=f"annotation {MIN_MEMBER_ANNOTATION}='\u00b2'"):  # its own filter says why
        c.filter(bad, parse_pod(bad), ["a", "b"], now_ns=time.time_ns())


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


# -- mirror pods: a compromised node's, in any namespace ---------------------------------------------

def mirror(name: str, group: str = "g", namespace: str = "ns", node_name: str = "a", **annotations: str) -> dict:
    """A static pod's mirror as a node creates it (NodeRestriction: bound to itself, any labels)."""
    p = member(name, group, namespace, core=0, node_name=node_name,
               annotations={MIRROR_POD: "0f3c9b2e5d7a4c1b8e6f2a9d0c3b7e51", **annotations})
    p["spec"]["containers"][0]["resources"] = {}
    p["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": "node-uid",
                                         "controller": True}]
    return p


def test_a_mirror_pod_is_no_member_of_the_group_its_label_names():
    assert group_of(mirror("m")) is None
    assert Listed.of(mirror("m")) is None
    by_owner = mirror("m")
    del by_owner["metadata"]["annotations"][MIRROR_POD]  # a Node as its controller says the same
    assert group_of(by_owner) is None
    not_controller = mirror("m")
    del not_controller["metadata"]["annotations"][MIRROR_POD]
    not_controller["metadata"]["ownerReferences"][0]["controller"] = False
    assert group_of(not_controller) == GroupKey("ns", "g")
    listed = Listed.of(member("p0"))
    assert listed is not None and listed.key == "ns/p0"


def test_a_nodes_mirror_pod_cannot_raise_a_victims_group_size_and_block_it(apiserver):
    """A compromised node creates a mirror pod in the victim's namespace with the victim's group
    label and ``group-min-member: 64``: the victim's group of one waited for 63 more members."""
    c = group_cache()
    binder = Binder(apiserver.api, c, DEFAULT_LIMITS, signer=SIGNER)
    created(c, apiserver, mirror("kube-proxy-a", **{MIN_MEMBER_ANNOTATION: "64"}))
    p0 = member("p0")
    created(c, apiserver, p0)
    filtered(c, p0)
    binder.bind("ns", "p0", "uid-p0", "a")
    assert apiserver.names() == ["p0"]


def test_a_nodes_bound_mirror_pods_do_not_complete_a_victims_group(apiserver):
    """Mirror pods are bound: counted as placed members, they let a group of two "complete" with
    one real member, bound alone."""
    c = group_cache()
    binder = Binder(apiserver.api, c, DEFAULT_LIMITS, signer=SIGNER)
    created(c, apiserver, mirror("fake-0"), mirror("fake-1", node_name="b"))
    p0 = member("p0", annotations={MIN_MEMBER_ANNOTATION: "2"})
    created(c, apiserver, p0)
    filtered(c, p0)
    with pytest.raises(BindError, match="waits for 1 more of 2"):
        binder.bind("ns", "p0", "uid-p0", "a")
    assert apiserver.bound == []


def test_mirror_pods_past_the_member_bound_in_the_list_do_not_refuse_a_victims_group(apiserver):
    """The group's LIST asks for at most 64 members: 65 mirror pods with the label made every bind
    of the group "more than 64 live members", for as long as they exist."""
    c = group_cache()
    binder = Binder(apiserver.api, c, DEFAULT_LIMITS, signer=SIGNER)
    apiserver.pods.extend(mirror(f"m{i}") for i in range(MAX_GROUP_MEMBERS + 1))
    p0 = member("p0")
    created(c, apiserver, p0)
    filtered(c, p0)
    binder.bind("ns", "p0", "uid-p0", "a")
    assert apiserver.names() == ["p0"]
