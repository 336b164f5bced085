"""node/tenants.py: the store's rows, from either door, as the isolation engine's tenants (pure)."""

from __future__ import annotations

from qgpu_runtime.isolation.engine import CardQuota
from qgpu_runtime.model import AppClass
from qgpu_runtime.node.store import PreparedClaim, ReservedPod, Share
from qgpu_runtime.node.tenants import dominant_class, tenants_of

NS = "ns"


def _claim(uid: str, name: str, pods: tuple[ReservedPod, ...] = ()) -> PreparedClaim:
    return PreparedClaim(uid, NS, name, (), "", 1, pods)


def _row(workload_id: str, workload: str, container: str, card: int, core: int, memory: int = 1024, klass: str = "normal") -> Share:
    return Share(workload_id, NS, workload, container, card, f"GPU-{card}", core, memory, klass, 1)


def _pod(uid: str, name: str, containers: dict[str, list[dict]], claims: dict[str, str], namespace: str = NS) -> dict:
    return {"metadata": {"uid": uid, "name": name, "namespace": namespace},
            "spec": {"resourceClaims": [{"name": e, "resourceClaimName": c} for e, c in claims.items()],
                     "containers": [{"name": c, "resources": {"claims": refs}} for c, refs in containers.items()]}}


def _summary(found) -> dict[str, tuple[str, tuple[CardQuota, ...]]]:
    return {key: (w.klass.value, w.cards) for key, (_, w) in found.items()}


def test_a_device_plugin_container_is_keyed_as_always():
    pod = _pod("p1", "web", {"main": []}, {})
    found = tenants_of([_row("p1", "web", "main", 0, 300)], [], {"p1": pod})
    assert _summary(found) == {"ns/web/main": ("normal", (CardQuota(0, 300, 1024),))}


def test_a_container_naming_one_request_holds_only_that_requests_rows():
    claim = _claim("c1", "multi")
    rows = [_row("c1", "multi", "train", 0, 300), _row("c1", "multi", "infer", 1, 200), _row("c1", "multi", "infer[2]", 1, 100)]
    pod = _pod("p1", "p", {"a": [{"name": "g", "request": "train"}], "b": [{"name": "g", "request": "infer"}]}, {"g": "multi"})
    assert _summary(tenants_of(rows, [claim], {"p1": pod})) == {
        "ns/p/a": ("normal", (CardQuota(0, 300, 1024),)),
        "ns/p/b": ("normal", (CardQuota(1, 300, 2048),))}


def test_containers_chained_through_shared_claims_are_one_tenant_counting_each_claim_once():
    x, y = _claim("cx", "x"), _claim("cy", "y")
    rows = [_row("cx", "x", "gpu", 0, 300), _row("cy", "y", "gpu", 0, 200, klass="offline")]
    pod = _pod("p1", "p", {"a": [{"name": "x"}], "b": [{"name": "x"}, {"name": "y"}]}, {"x": "x", "y": "y"})
    found = tenants_of(rows, [x, y], {"p1": pod})
    ((ref, workload),) = found.values()
    assert ref.key == "ns/p/a+ns/p/b" and (ref.pod, ref.container) == ("p", "a+b")
    assert (workload.klass, workload.cards) == (AppClass.NORMAL, (CardQuota(0, 500, 2048),))


def test_a_claim_of_the_same_name_in_another_namespace_is_not_linked():
    pod = _pod("p1", "p", {"main": [{"name": "g"}]}, {"g": "shared"}, namespace="other")
    assert tenants_of([_row("c1", "shared", "gpu", 0, 300)], [_claim("c1", "shared")], {"p1": pod}) == {}


def test_rows_of_pods_that_are_not_live_make_no_tenant():
    claim = _claim("c1", "g", (ReservedPod("gone", "old"),))
    rows = [_row("c1", "g", "gpu", 0, 300), _row("gone-dp", "old", "main", 0, 100)]
    assert tenants_of(rows, [claim], {}) == {}


def test_the_reserved_pod_links_containers_whose_claim_entry_is_unresolved():
    claim = _claim("c1", "tpl-abc", (ReservedPod("p1", "p"),))
    pod = {"metadata": {"uid": "p1", "name": "p", "namespace": NS},
           "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
                    "containers": [{"name": "main", "resources": {"claims": [{"name": "gpu"}]}}, {"name": "side"}]}}
    assert list(tenants_of([_row("c1", "tpl-abc", "gpu", 0, 300)], [claim], {"p1": pod})) == ["ns/p/main"]
    other = {**pod, "metadata": {"uid": "p2", "name": "q", "namespace": NS}}
    assert tenants_of([_row("c1", "tpl-abc", "gpu", 0, 300)], [claim], {"p2": other}) == {}  # not reserved for it


def test_online_wins_then_normal_and_offline_only_when_everything_is_offline():
    assert dominant_class(["offline", "online", "normal"]) == "online"
    assert dominant_class(["offline", "normal"]) == "normal"
    assert dominant_class(["offline"]) == "offline" and dominant_class([]) == "normal"


def test_quotas_on_one_card_add_up_and_core_stops_at_the_whole_card():
    x, y = _claim("cx", "x"), _claim("cy", "y")
    rows = [_row("cx", "x", "gpu", 0, 700), _row("cy", "y", "gpu", 0, 600)]
    pod = _pod("p1", "p", {"main": [{"name": "x"}, {"name": "y"}]}, {"x": "x", "y": "y"})
    assert _summary(tenants_of(rows, [x, y], {"p1": pod})) == {"ns/p/main": ("normal", (CardQuota(0, 1000, 2048),))}


def test_a_sidecar_init_container_referencing_a_claim_is_a_member_too():
    pod = _pod("p1", "p", {"main": [{"name": "g"}]}, {"g": "shared"})
    pod["spec"]["initContainers"] = [{"name": "sidecar", "restartPolicy": "Always", "resources": {"claims": [{"name": "g"}]}}]
    ((ref, _),) = tenants_of([_row("c1", "shared", "gpu", 0, 300)], [_claim("c1", "shared")], {"p1": pod}).values()
    assert [m.container for m in ref.members] == ["main", "sidecar"]
