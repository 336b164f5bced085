"""One namespace GPU quota across dialects (issue 22 §5): every dialect's share of a pod is charged
against ``gpu.qgpu.io/core`` and ``gpu.qgpu.io/memory``, with the namespace's claims, through the
same reservation ledger as claims. Pure charge rules, then ClaimQuota.check_pod with the stand-in API
of test_claim_quota_serving.py; the same against the real kube-apiserver in
tests/k8s/test_e2e_pod_quota.py."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract.leases import Reservation
from qgpu_runtime.webhook.claimquota import Usage
from qgpu_runtime.webhook.podquota import ClaimSeen, pod_usage, pods_usage
from qgpu_runtime.webhook.quota import Verdict
from tests.webhook.test_claim_quota_serving import NS, FakeApi, claim, guard
from tests.webhook.test_claim_quota_serving import review as claim_review

CARD = 80 * 1024  # the default memory charge of a whole card: the largest card qgpu admits


def pod(name: str, resources: dict[str, Any], *, annotations: dict | None = None, phase: str | None = None) -> dict:
    doc: dict[str, Any] = {"metadata": {"name": name, "namespace": NS, "annotations": annotations or {}},
                           "spec": {"containers": [{"name": "c", "resources": {"limits": resources}}]}}
    if phase:
        doc["status"] = {"phase": phase}
    return doc


def review(name: str, resources: dict[str, Any], **extra: Any) -> dict:
    return {"uid": "u-" + name, "operation": "CREATE", "namespace": NS, "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "object": pod(name, resources), **extra}


@pytest.mark.parametrize("resources, charge", [
    ({"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "4"}, Usage(300, 4096)),
    ({"tke.cloud.tencent.com/qgpu-core": "200"}, Usage(2000, 2 * CARD)),
    ({"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "8"}, Usage(500, 8 * 256)),
    ({"tencent.com/vcuda-core": "100"}, Usage(1000, CARD)),
    ({"nvidia.com/gpu": "2"}, Usage(2000, 2 * CARD)),
    ({"tensorstack.dev/nvidia-gpu": "1"}, Usage(1000, CARD)),
    ({"tensorstack.dev/nvidia-gpu-percent": "50"}, Usage(10, CARD // 2)),  # no core named: the least share's
    ({"tensorstack.dev/nvidia-gpu-node": "1"}, Usage(8000, 8 * CARD)),
    ({"cpu": "1"}, Usage()),
])
def test_every_dialect_is_charged_in_the_one_currency(resources, charge):
    assert pod_usage(pod("p", resources)) == charge


def test_a_finished_pod_holds_nothing():
    assert pod_usage(pod("p", {"nvidia.com/gpu": "1"}, phase="Succeeded")) == Usage()
    assert pod_usage(pod("p", {"nvidia.com/gpu": "1"}, phase="Failed")) == Usage()
    assert pod_usage(pod("p", {"nvidia.com/gpu": "1"}, phase="Running")) == Usage(1000, CARD)


WHOLE_NODE = Usage(8000, 8 * CARD)  # the most one container may be charged: every card a node may hold


def test_a_pod_the_parser_refuses_is_charged_the_most_any_reading_of_its_containers_could_be():
    assert pod_usage(pod("p", {"tke.cloud.tencent.com/qgpu-core": "abc"})) == WHOLE_NODE
    assert pod_usage(pod("p", {"tensorstack.dev/nvidia-gpu-node": "1"}, annotations={"qgpu.io/gpu-model": "|"})) == WHOLE_NODE
    two = pod("p", {"nvidia.com/gpu": "3"}, annotations={"tke.cloud.tencent.com/app-class": "x"})
    two["spec"]["containers"].append({"name": "d", "resources": {"limits": {"tencent.com/vcuda-core": "150"}}})
    two["spec"]["containers"].append({"name": "cpu", "resources": {"limits": {"cpu": "1"}}})
    # the cards the resources declare (fixed once the pod exists), each whole at the largest memory
    assert pod_usage(two) == Usage(5000, 5 * CARD)


def test_a_pod_admitted_under_larger_limits_is_charged_its_cards_not_a_whole_node():
    """A HAMi pod from before the migration asking 100,000 MiB of a card (an H200's share) is one the
    parser refuses under the default 80 GiB limit: charged one whole card, not a node of 8, so one
    such pod does not lock its namespace out of its quota."""
    hami = pod("p", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "100000"})
    assert pod_usage(hami) == Usage(1000, CARD)


def kai_pod(annotations: dict[str, str]) -> dict:
    doc = pod("kai", {"nvidia.com/gpu": annotations.get("gpu-fraction-num-devices", "1")}, annotations=annotations)
    doc["spec"]["schedulerName"] = "kai-scheduler"
    doc["spec"]["containers"].append({"name": "side", "resources": {}})  # a KAI share may name any container
    return doc


@pytest.mark.parametrize("valid", [
    pod("p", {"nvidia.com/gpu": "8"}),
    pod("p", {"tensorstack.dev/nvidia-gpu-node": "1"}),
    pod("p", {"tke.cloud.tencent.com/qgpu-core": "800"}),
    pod("p", {"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "80"}),
    pod("p", {"nvidia.com/gpu": "8", "nvidia.com/gpumem": str(CARD)}),
    kai_pod({"gpu-fraction": "0.99", "gpu-fraction-num-devices": "8"}),
    kai_pod({"gpu-memory": str(CARD), "gpu-fraction-num-devices": "8", "gpu-fraction-container-name": "side"}),
], ids=["nvidia-8", "t9k-node", "qgpu-8-cards", "qgpu-share-80g", "hami-8x80g", "kai-0.99x8", "kai-80g-x8-side"])
@pytest.mark.parametrize("broken", [
    {"tke.cloud.tencent.com/app-class": "x"}, {"qgpu.io/gpu-model": "|"}, {"nvidia.com/use-gputype": ","},
    {"nvidia.com/nouse-gputype": ","}, {"gpu-fraction": "2"}, {"gpu-fraction-container-name": "nobody"},
], ids=["app-class", "gpu-model", "use-gputype", "nouse-gputype", "kai-fraction", "kai-container"])
def test_annotating_a_pod_into_a_refusal_never_lowers_its_charge(valid, broken):
    """Issue F1: `kubectl annotate pod big tke.cloud.tencent.com/app-class=x` took an 8-card pod's
    charge down to one card. A tenant that breaks its own pod now only over-charges itself."""
    admitted = pod_usage(valid)
    changed = {**valid, "metadata": {**valid["metadata"], "annotations": {**valid["metadata"]["annotations"], **broken}}}
    assert admitted != Usage()
    charged = pod_usage(changed)
    assert charged.core_milli >= admitted.core_milli and charged.memory_mib >= admitted.memory_mib, (admitted, charged)


def test_in_a_dra_namespace_nvidia_gpu_is_charged_as_kube_schedulers_claim_not_as_the_pod():
    pinned = pod("p", {"nvidia.com/gpu": "1"})
    pinned["spec"]["nodeSelector"] = {"qgpu.io/pool-mode": "dra"}  # what /mutate-dra adds
    assert pod_usage(pinned, dra_namespace=True) == Usage()
    kept = pod("p", {"nvidia.com/gpu": "1"}, annotations={"qgpu.io/gpu-mode": "device-plugin"})
    assert pod_usage(kept, dra_namespace=True) == Usage(1000, CARD)
    assert pod_usage(pod("p", {"tencent.com/vcuda-core": "100"}), dra_namespace=True) == Usage(1000, CARD)


def test_in_a_dra_namespace_a_kai_share_moved_onto_a_claim_is_charged_as_the_claim_only():
    """/mutate-dra turns KAI's annotated share into a claim and removes the container's
    nvidia.com/gpu; the annotations stay. The claim is charged as a claim: the pod was charged the
    same share again."""
    converted = kai_pod({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"})
    container = converted["spec"]["containers"][0]
    container["resources"] = {"claims": [{"name": "qgpu-0"}]}
    converted["spec"]["resourceClaims"] = [{"name": "qgpu-0", "resourceClaimTemplateName": "qgpu-kai"}]
    assert pod_usage(converted, dra_namespace=True) == Usage()
    # one the webhook did not convert (no claim, as while it was down) keeps its charge
    bare = kai_pod({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"})
    bare["spec"]["containers"][0]["resources"] = {}
    assert pod_usage(bare, dra_namespace=True) == pod_usage(bare) != Usage()
    # a KAI container that still asks nvidia.com/gpu can take cards from a device plugin: charged
    unconverted = kai_pod({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"})
    charged = pod_usage(unconverted)
    assert charged != Usage() and pod_usage(unconverted, dra_namespace=True) == charged
    # as is a pod that kept its resources for a device plugin, and every pod outside a DRA namespace
    kept = {**converted, "metadata": {**converted["metadata"], "annotations": {
        **converted["metadata"]["annotations"], "qgpu.io/gpu-mode": "device-plugin"}}}
    assert pod_usage(kept, dra_namespace=True) == pod_usage(converted) == charged


def test_pods_of_other_namespaces_and_the_pod_being_admitted_are_skipped():
    other = pod("x", {"nvidia.com/gpu": "1"})
    other["metadata"]["namespace"] = "elsewhere"
    listed = [other, pod("self", {"nvidia.com/gpu": "1"}), pod("b", {"nvidia.com/gpu": "1"})]
    assert pods_usage(listed, NS, skip="self") == Usage(1000, CARD)


@pytest.mark.parametrize("shares", [
    pod("p", {"nvidia.com/gpu": "8", "nvidia.com/gpumem": "1"}),  # HAMi: 1 MiB and no cores on 8 cards
    kai_pod({"gpu-memory": "1", "gpu-fraction-num-devices": "8"}),  # KAI: 1 MiB on 8 cards
    pod("p", {"tke.cloud.tencent.com/qgpu-core": "1", "tke.cloud.tencent.com/qgpu-memory": "1"}),
], ids=["hami-1mib-x8", "kai-1mib-x8", "qgpu-1-1"])
def test_a_share_is_charged_at_least_the_least_share_a_card_gives(shares):
    """Each share holds one of its card's pod slots: eight 1 MiB shares with no core were charged 8
    MiB and 0 core, so a 16 GiB quota let a tenant fill the slots of thousands of cards, and a
    core-only quota none at all. Now at least what a claim's share consumes: 10 core, 1 GiB."""
    cards = 1 if "tke.cloud.tencent.com/qgpu-core" in str(shares) else 8
    assert pod_usage(shares) == Usage(cards * 10, cards * 1024)


def test_memory_only_shares_are_stopped_by_a_core_only_quota():
    """A namespace capped on gpu.qgpu.io/core alone, its 1000 core used: T9k percent and HAMi memory
    shares, which name no core, are refused, where they used to be admitted without end."""
    api = FakeApi(hard_core=1000, pods=[pod("full", {"nvidia.com/gpu": "1"})])
    api.quotas = [{"metadata": {"name": "gpu"}, "spec": {"hard": {"gpu.qgpu.io/core": "1000"}}}]
    for resources in ({"tensorstack.dev/nvidia-gpu-percent": "100"}, {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1"}):
        verdict = guard(api).check_pod(review("more", resources))
        assert not verdict.allowed, resources
        assert "gpu.qgpu.io/core used 1000 + requested 10 > hard 1000" in verdict.message


def test_a_namespace_capped_in_one_dialect_cannot_take_cards_in_another():
    """The issue's bypass: the quota holds 1.0 card; a qgpu share of 0.6 is running, and a card
    asked as vcuda-core or nvidia.com/gpu is refused, naming the quota and the numbers."""
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD, pods=[pod("running", {"tke.cloud.tencent.com/qgpu-core": "60", "tke.cloud.tencent.com/qgpu-memory": "1"})])
    for resources in ({"tencent.com/vcuda-core": "100"}, {"nvidia.com/gpu": "1"}, {"tensorstack.dev/nvidia-gpu": "1"}):
        verdict = guard(api).check_pod(review("more", resources))
        assert (verdict.allowed, verdict.code) == (False, 422)
        assert "Pod team-a/more: exceeded quota 'gpu'" in verdict.message
        assert "gpu.qgpu.io/core used 600 + requested 1000 > hard 1000" in verdict.message
    assert guard(api).check_pod(review("fits", {"tencent.com/vcuda-core": "40", "tencent.com/vcuda-memory": "4"})) == Verdict(True)


def test_pods_and_claims_draw_on_the_same_quota():
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD, claims=[claim("c", 500)])
    assert not guard(api).check_pod(review("p", {"nvidia.com/gpu": "1"})).allowed
    assert guard(api).check_pod(review("p", {"tke.cloud.tencent.com/qgpu-core": "50", "tke.cloud.tencent.com/qgpu-memory": "1"})).allowed
    assert api.reservations() == {"pod:p": Reservation(500, 1024, 1030.0)}
    verdict = guard(api)(claim_review("c2", 100))
    assert not verdict.allowed and "used 1000 + requested 100 > hard 1000" in verdict.message


def test_a_pod_admitted_a_moment_ago_counts_until_listed_then_as_itself():
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD)
    assert guard(api).check_pod(review("a", {"nvidia.com/gpu": "1"})) == Verdict(True)
    assert api.calls == ["quotas", "read", "claims", "pods", "write"]
    assert not guard(api).check_pod(review("b", {"nvidia.com/gpu": "1"})).allowed  # a is reserved, not yet listed
    api.pods.append(pod("a", {"nvidia.com/gpu": "1"}))
    assert not guard(api).check_pod(review("b", {"nvidia.com/gpu": "1"})).allowed  # a listed: counted once
    api.pods[0]["status"] = {"phase": "Succeeded"}
    assert guard(api).check_pod(review("b", {"nvidia.com/gpu": "1"})) == Verdict(True)  # a finished: released
    assert set(api.reservations()) == {"pod:b"}


def test_a_dra_webhook_reads_the_namespace_label_and_leaves_nvidia_gpu_to_the_claim():
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD, claims=[claim("c", 1000)], namespace_labels={"qgpu.io/gpu-mode": "dra"})
    converted = review("p", {"nvidia.com/gpu": "1"})
    converted["object"]["spec"]["nodeSelector"] = {"qgpu.io/pool-mode": "dra"}  # /mutate-dra ran before /validate
    assert guard(api, dra=True).check_pod(converted) == Verdict(True)
    assert "namespace" in api.calls and "write" not in api.calls  # charged nothing: nothing reserved
    assert not guard(FakeApi(hard_core=1000, hard_memory=10 * CARD, claims=[claim("c", 1000)])).check_pod(review("p", {"nvidia.com/gpu": "1"})).allowed


def test_no_qgpu_quota_costs_one_list_and_other_objects_are_not_judged():
    api = FakeApi(hard_core=None)
    assert guard(api).check_pod(review("p", {"nvidia.com/gpu": "8"})) == Verdict(True)
    assert api.calls == ["quotas"]
    api = FakeApi()
    assert guard(api).check_pod({**review("p", {"nvidia.com/gpu": "8"}), "operation": "UPDATE"}) == Verdict(True)
    assert guard(api).check_pod(review("p", {"cpu": "1"})) == Verdict(True)
    assert api.calls == ["quotas"]


def test_a_dry_run_pod_is_judged_and_reserves_nothing():
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD)
    assert guard(api).check_pod(review("p", {"nvidia.com/gpu": "1"}, dryRun=True)) == Verdict(True)
    assert "write" not in api.calls
    assert not guard(api).check_pod(review("p", {"nvidia.com/gpu": "2"}, dryRun=True)).allowed


def test_a_failed_pod_list_is_a_500_naming_it():
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD)
    api.fail["pods"] = ApiException(status=403, reason="Forbidden")
    verdict = guard(api).check_pod(review("p", {"nvidia.com/gpu": "1"}))
    assert (verdict.allowed, verdict.code) == (False, 500)
    assert verdict.message.startswith("qgpu: Pod team-a/p: the GPU quota cannot be checked, so the pod is refused (fail closed; try again): "
                                      "listing Pods of namespace 'team-a': the apiserver answered 403 Forbidden")


def test_an_apiserver_without_resource_claims_has_none_to_count():
    """Device-plugin clusters before Kubernetes 1.34 serve no resource.k8s.io/v1: its 404 is no claims."""
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD)
    api.fail["claims"] = ApiException(status=404, reason="Not Found")
    assert guard(api).check_pod(review("p", {"nvidia.com/gpu": "1"})) == Verdict(True)
    api.fail["pods"] = ApiException(status=404, reason="Not Found")
    assert guard(api).check_pod(review("q", {"nvidia.com/gpu": "1"})).code == 500  # only the claims' API may be absent


def test_a_pod_deleted_after_this_replica_saw_it_stored_stops_counting_before_its_entry_is_pruned():
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD)
    replica = guard(api)
    assert replica.check_pod(review("a", {"nvidia.com/gpu": "1"})) == Verdict(True)
    api.pods.append(pod("a", {"nvidia.com/gpu": "1"}))
    assert not replica.check_pod(review("b", {"nvidia.com/gpu": "1"})).allowed  # refused: no write, pod:a stays in the ledger
    assert set(api.reservations()) == {"pod:a"}
    api.pods.clear()  # a deleted
    assert replica.check_pod(review("b", {"nvidia.com/gpu": "1"})) == Verdict(True)
    assert not guard(api).check_pod(review("c", {"nvidia.com/gpu": "1"})).allowed  # b reserved


def test_a_pod_from_before_the_namespace_was_labelled_dra_is_still_charged():
    """`nvidia.com/gpu: 8` admitted before the namespace was labelled qgpu.io/gpu-mode=dra runs on a
    device-plugin node, which grants the cards with no claim. Skipped as a converted pod's, it was
    charged nothing once the label came, and its quota admitted the same cards again."""
    before = pod("p", {"nvidia.com/gpu": "8"})
    assert pod_usage(before, dra_namespace=True) == pod_usage(before) == Usage(8000, 8 * CARD)
    # one whose cards kube-scheduler's extended-resource claim carries says so in its status
    # (admitted before /mutate-dra pinned pods): charged as that claim, not twice
    claimed = {**before, "metadata": {**before["metadata"], "uid": "pod-uid"},
               "status": {"extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-x"}}}
    made = {"p-extended-resources-x": ClaimSeen(Usage(8000, 8 * CARD), "pod-uid")}
    assert pod_usage(claimed, dra_namespace=True, claims=made) == Usage()


def test_an_extended_resource_claim_status_lowers_a_charge_only_by_a_claim_the_pod_controls():
    """``status.extendedResourceClaimStatus`` is pod status: NodeRestriction keeps the pod's node from
    changing it, but anyone who may write pods/status can. Believed on its own, a name pointing at
    no claim, another pod's claim or a one-share claim took eight cards off the namespace's quota."""
    base = pod("p", {"nvidia.com/gpu": "8"})
    claimed = {**base, "metadata": {**base["metadata"], "uid": "pod-uid"},
               "status": {"extendedResourceClaimStatus": {"resourceClaimName": "x"}}}
    eight = Usage(8000, 8 * CARD)
    assert pod_usage(claimed, dra_namespace=True) == eight  # no claims listed: nothing to check it against
    assert pod_usage(claimed, dra_namespace=True, claims={}) == eight  # the named claim does not exist
    assert pod_usage(claimed, dra_namespace=True, claims={"x": ClaimSeen(eight, "other-pod")}) == eight
    assert pod_usage(claimed, dra_namespace=True, claims={"x": ClaimSeen(eight, None)}) == eight
    # a claim the pod controls counts as far as its own charge goes: pod and claim together are
    # charged the larger of the two
    small = Usage(10, 1024)
    assert pod_usage(claimed, dra_namespace=True, claims={"x": ClaimSeen(small, "pod-uid")}) == Usage(7990, 8 * CARD - 1024)
    assert pod_usage(claimed, dra_namespace=True, claims={"x": ClaimSeen(eight, "pod-uid")}) == Usage()
    no_uid = {**claimed, "metadata": {k: v for k, v in claimed["metadata"].items() if k != "uid"}}
    assert pod_usage(no_uid, dra_namespace=True, claims={"x": ClaimSeen(eight, "")}) == eight
    assert pod_usage(claimed, claims={"x": ClaimSeen(eight, "pod-uid")}) == eight  # not a DRA namespace


def test_the_quota_check_reads_the_controller_of_the_claim_a_pods_status_names():
    """Through ClaimQuota.check_pod: a running `nvidia.com/gpu: 1` pod whose status names a claim is
    charged nothing only when that claim is listed and controlled by the pod (as kube-scheduler
    makes it); then the claim's own charge counts."""
    def running(owner: str | None) -> tuple[dict, dict]:
        old = pod("old", {"nvidia.com/gpu": "1"})
        old["metadata"]["uid"] = "old-uid"
        old["status"] = {"phase": "Running", "extendedResourceClaimStatus": {"resourceClaimName": "old-gpu"}}
        made = claim("old-gpu", 10)  # a one-share claim: the least a tenant could write
        if owner is not None:
            made["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": "old", "uid": owner,
                                                    "controller": True}]
        return old, made

    for owner in (None, "someone-else"):
        old, made = running(owner)
        api = FakeApi(hard_core=1000, hard_memory=10 * CARD, pods=[old], claims=[made],
                      namespace_labels={"qgpu.io/gpu-mode": "dra"})
        share = review("share", {"tke.cloud.tencent.com/qgpu-core": "10"})
        verdict = guard(api, dra=True).check_pod(share)
        assert not verdict.allowed and "used 1010" in verdict.message, (owner, verdict)  # the pod's card and the claim
    old, made = running("old-uid")
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD, pods=[old], claims=[made], namespace_labels={"qgpu.io/gpu-mode": "dra"})
    verdict = guard(api, dra=True).check_pod(review("share", {"tke.cloud.tencent.com/qgpu-core": "10"}))
    assert not verdict.allowed and "used 1000" in verdict.message  # the card, once: the claim's 10 and the pod's remaining 990


def mirror_pod(name: str, resources: dict[str, Any], node: str = "gpu-node-1") -> dict:
    """A static pod's mirror as a node creates it: NodeRestriction lets it into any namespace, bound
    to itself, with the kubelet's annotation and its Node as controller."""
    doc = pod(name, resources, annotations={"kubernetes.io/config.mirror": "0f3c9b2e5d7a4c1b8e6f2a9d0c3b7e51"})
    doc["spec"]["nodeName"] = node
    doc["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": "n", "controller": True}]
    return doc


def test_a_mirror_pod_is_charged_nothing_and_a_node_owner_alone_proves_nothing():
    assert pod_usage(mirror_pod("m", {"nvidia.com/gpu": "8"})) == Usage()
    owned = mirror_pod("m", {"nvidia.com/gpu": "8"})
    del owned["metadata"]["annotations"]["kubernetes.io/config.mirror"]  # any pod's owner may write a Node reference
    assert pod_usage(owned) == Usage(8000, 8 * CARD)


def test_a_compromised_nodes_mirror_pods_do_not_use_up_a_victim_namespaces_quota():
    """A node's mirror pods of `nvidia.com/gpu: 8` in the victim's namespace were charged to its
    quota: the victim's next GPU pod was refused while those pods held no card any scheduler booked.
    A mirror pod under admission is admitted and reserves nothing."""
    api = FakeApi(hard_core=1000, hard_memory=10 * CARD, pods=[mirror_pod(f"m{i}", {"nvidia.com/gpu": "8"}) for i in range(3)])
    assert guard(api).check_pod(review("victim", {"nvidia.com/gpu": "1"})) == Verdict(True)
    more = {**review("m3", {}), "object": mirror_pod("m3", {"nvidia.com/gpu": "8"})}
    assert guard(api).check_pod(more) == Verdict(True)
    assert set(api.reservations()) == {"pod:victim"}
