"""Namespace quota on the GPU core and memory asked by ResourceClaims of qgpu's DeviceClasses."""

from __future__ import annotations

import pytest

from qgpu_runtime.contract.dra import SHARED_CLASS, WHOLE_CLASS
from qgpu_runtime.webhook.claimquota import (
    CORE_QUOTA,
    MEMORY_QUOTA,
    ClaimQuotaError,
    Refusal,
    Usage,
    check_claim,
    claim_admission,
    claim_usage,
    quota_limits,
)

NS = "team-a"
CARD_MIB = 32768


def request(cls=SHARED_CLASS, core=None, memory=None, count=None, name="gpu", **extra):
    exactly = {"deviceClassName": cls, **extra}
    asked = {k: v for k, v in (("core", core), ("memory", memory)) if v is not None}
    if asked:
        exactly["capacity"] = {"requests": asked}
    if count is not None:
        exactly["count"] = count
    return {"name": name, "exactly": exactly}


def claim(*requests, name="c", namespace=NS):
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"devices": {"requests": list(requests)}}}


def quota(core=None, memory=None, name="gpu", **other):
    hard = dict(other)
    if core is not None:
        hard[CORE_QUOTA] = core
    if memory is not None:
        hard[MEMORY_QUOTA] = memory
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": name, "namespace": NS}, "spec": {"hard": hard}}


def usage(*requests):
    return claim_usage(claim(*requests), default_memory_mib=CARD_MIB)


# -- what a claim asks ------------------------------------------------------------------------


def test_a_share_asks_the_capacity_it_names():
    assert usage(request(core="300", memory="4096")) == Usage(300, 4096)


def test_count_multiplies_the_share():
    assert usage(request(core="250", memory="2048", count=3)) == Usage(750, 6144)


def test_the_largest_allocatable_count_is_charged():
    assert usage(request(WHOLE_CLASS, count=32)) == Usage(32000, 32 * CARD_MIB)


def test_a_request_naming_no_capacity_asks_the_whole_card():
    assert usage(request(WHOLE_CLASS, count=2)) == Usage(2000, 2 * CARD_MIB)


def test_a_request_naming_only_core_is_charged_the_whole_card_memory():
    assert usage(request(core="100")) == Usage(100, CARD_MIB)


def test_json_integers_count_like_strings():
    assert usage(request(core=300, memory=4096)) == Usage(300, 4096)


def test_requests_add_up():
    assert usage(request(core="300", memory="1024", name="a"), request(WHOLE_CLASS, name="b")) == Usage(1300, 1024 + CARD_MIB)


def test_other_drivers_classes_count_nothing():
    assert usage(request("gpu.nvidia.com", core="7", count=4), request("fpga.example.com")) == Usage()


def test_a_claim_without_requests_asks_nothing():
    assert claim_usage({"metadata": {"name": "x", "namespace": NS}, "spec": {}}) == Usage()


def test_a_prioritized_list_is_charged_its_largest_qgpu_alternative():
    req = {"name": "gpu", "firstAvailable": [
        {"name": "big", "deviceClassName": WHOLE_CLASS},
        {"name": "small", "deviceClassName": SHARED_CLASS, "capacity": {"requests": {"core": "200", "memory": "40960"}}},
        {"name": "other", "deviceClassName": "gpu.nvidia.com", "count": 8},
    ]}
    assert usage(req) == Usage(1000, 40960)


def test_the_default_memory_is_the_largest_card_qgpu_admits_unless_told():
    assert claim_usage(claim(request(core="100"))).memory_mib == 80 * 1024


@pytest.mark.parametrize("value,core", [("1k", 1000), ("5e2", 500), ("300", 300), ("+70", 70), ("7e1", 70)])
def test_capacities_are_read_as_the_apiserver_serves_them(value, core):
    """kube-apiserver canonicalises quantities: a claim written with 1000 is served with 1k."""
    assert usage(request(core=value, memory="1024")).core_milli == core


@pytest.mark.parametrize("core,memory,charged", [
    ("1", "1", Usage(10, 1024)), ("0", "0", Usage(10, 1024)), ("1.0", "2000", Usage(10, 2048)), ("+7", "1025", Usage(10, 2048)),
    ("995", "16383", Usage(1000, 16384)), ("1600", "1024", Usage(1600, 1024))])
def test_a_request_is_charged_what_the_allocator_consumes(core, memory, charged):
    """The slices' requestPolicy rounds a request up (core to steps of 10 from 10, memory to whole
    GiB from 1 GiB): {core: 1, memory: 1} takes 10 and 1024 of the card. Charged as asked, a
    namespace holding core 1000 and memory 16384 was admitted a hundred of them: ten times its core,
    a hundred GiB of memory. A request above a whole card, which fits no card, keeps its figure."""
    assert usage(request(core=core, memory=memory)) == charged
    assert usage(request(core=core, memory=memory, count=3)) == Usage(3 * charged.core_milli, 3 * charged.memory_mib)


def test_tiny_claims_fill_the_quota_at_what_they_take():
    """The reproduction: quota core 1000, memory 16384; claims of {core: 1, memory: 1} each take 10
    and 1024 of a card. The seventeenth is refused for memory (it was the hundred-and-first, for
    nothing)."""
    tiny = request(core="1", memory="1")
    hard = [quota(core="1000", memory="16384")]
    existing = [claim(tiny, name=f"t{i}") for i in range(16)]
    (refusal,) = check_claim(claim(tiny, name="t16"), existing, hard)
    assert "gpu.qgpu.io/memory used 16384 + requested 1024 > hard 16384" in refusal.message("t16")
    assert check_claim(claim(tiny, name="t15"), existing[:15], hard) == []


@pytest.mark.parametrize("value", ["-100", -100, "1.5", "500m", "1Gi", "64Mi", "", " 100", "0x10", "١٠٠", "NaN",
                                   "1" * 20, 2**63, "1e600000", True, None, [100], {"v": 1}, 1.0])
def test_a_capacity_that_is_not_a_whole_number_is_refused(value):
    with pytest.raises(ClaimQuotaError) as e:
        usage(request(core=value if value is not None else "x", memory="1024"))
    assert "spec.devices.requests[0].exactly.capacity.requests.core" in str(e.value)
    assert "non-negative whole number in qgpu's units" in str(e.value)


def test_a_huge_value_is_cut_in_the_message():
    with pytest.raises(ClaimQuotaError) as e:
        usage(request(core="9" * 1000))
    assert "(1002 characters)" in str(e.value) and len(str(e.value)) < 400


@pytest.mark.parametrize("count", [0, -1, 33, 1 << 70, "2", 1.5, True])
def test_a_bad_count_is_refused(count):
    with pytest.raises(ClaimQuotaError, match=r"requests\[0\]\.exactly\.count="):
        usage(request(core="100", count=count))


def test_allocation_mode_all_is_charged_the_most_cards_a_node_may_have():
    """A T9k whole-node pod's claim: every card of the node, known only after allocation."""
    assert usage(request(WHOLE_CLASS, allocationMode="All")) == Usage(8000, 8 * CARD_MIB)


def test_an_unknown_allocation_mode_is_refused():
    with pytest.raises(ClaimQuotaError, match="allocationMode='Some': must be ExactCount or All"):
        usage(request(WHOLE_CLASS, allocationMode="Some"))


@pytest.mark.parametrize("devices", [{"requests": "gpu"}, {"requests": ["gpu"]}])
def test_malformed_requests_are_refused_with_the_field(devices):
    with pytest.raises(ClaimQuotaError, match="spec.devices.requests"):
        claim_usage({"metadata": {"name": "x", "namespace": NS}, "spec": {"devices": devices}})


# -- the quota declaration --------------------------------------------------------------------


def test_only_qgpu_entries_of_a_quota_are_read():
    assert quota_limits([quota(core="4000", memory="65536", **{"requests.cpu": "4"})]) == [
        ("gpu", CORE_QUOTA, 4000), ("gpu", MEMORY_QUOTA, 65536)]


def test_quota_values_are_read_as_the_apiserver_serves_them():
    assert quota_limits([quota(core="4k", memory="65536")]) == [("gpu", CORE_QUOTA, 4000), ("gpu", MEMORY_QUOTA, 65536)]


@pytest.mark.parametrize("hard", ["-1", "64Gi", "2.5", "100m"])
def test_a_quota_value_that_is_not_a_whole_number_is_refused_naming_the_quota(hard):
    with pytest.raises(ClaimQuotaError, match=r"ResourceQuota gpu: spec.hard\['gpu.qgpu.io/core'\]"):
        quota_limits([quota(core=hard)])


# -- admission --------------------------------------------------------------------------------


def test_a_claim_within_the_quota_is_admitted():
    existing = [claim(request(core="500", memory="8192"), name="old")]
    assert check_claim(claim(request(core="500", memory="8192")), existing, [quota(core="1000", memory="16384")]) == []


def test_a_claim_beyond_the_core_quota_is_refused_with_used_requested_and_hard():
    existing = [claim(request(core="600", memory="1024"), name="old")]
    refusals = check_claim(claim(request(core="500", memory="1024")), existing, [quota(core="1000")], CARD_MIB)
    assert refusals == [Refusal(NS, "gpu", CORE_QUOTA, 600, 500, 1000)]
    assert refusals[0].message("c") == (
        "ResourceClaim team-a/c: exceeded quota 'gpu' in namespace 'team-a': gpu.qgpu.io/core used 600 + "
        "requested 500 > hard 1000 (thousandths of a card)")


def test_the_memory_quota_counts_mib():
    existing = [claim(request(core="100", memory="12288"), name="old")]
    refusals = check_claim(claim(request(core="100", memory="8192")), existing, [quota(memory="16384")])
    assert [(r.resource, r.used, r.requested, r.hard) for r in refusals] == [(MEMORY_QUOTA, 12288, 8192, 16384)]


def test_every_quota_of_the_namespace_must_hold():
    quotas = [quota(core="8000", name="wide"), quota(core="1000", name="tight")]
    refusals = check_claim(claim(request(WHOLE_CLASS, count=2)), [], quotas, CARD_MIB)
    assert [r.quota for r in refusals] == ["tight"]


def test_reaching_the_hard_limit_exactly_is_allowed():
    existing = [claim(request(core="700", memory="1024"), name="old")]
    assert check_claim(claim(request(core="300", memory="1024")), existing, [quota(core="1000")]) == []


def test_without_a_qgpu_quota_everything_is_admitted():
    assert check_claim(claim(request(WHOLE_CLASS, count=8)), [], [quota(**{"requests.cpu": "1"})]) == []


def test_a_claim_of_another_driver_is_admitted_whatever_the_quota():
    assert check_claim(claim(request("gpu.nvidia.com", count=8)), [], [quota(core="0", memory="0")]) == []


def test_claims_of_other_drivers_and_namespaces_and_the_claim_itself_are_not_counted():
    existing = [claim(request("gpu.nvidia.com", count=8), name="nv"),
                claim(request(WHOLE_CLASS, count=4), name="elsewhere", namespace="team-b"),
                claim(request(core="900", memory="1024"), name="c")]  # the new claim, seen again
    assert check_claim(claim(request(core="900", memory="1024")), existing, [quota(core="1000")]) == []


def test_an_unreadable_existing_claim_is_charged_a_whole_card():
    existing = [claim(request(core="-5"), name="bad")]
    refusals = check_claim(claim(request(core="100", memory="1024")), existing, [quota(core="1000")], CARD_MIB)
    assert [(r.used, r.requested) for r in refusals] == [(1000, 100)]


def test_a_bad_new_claim_is_an_error_not_a_silent_admission():
    with pytest.raises(ClaimQuotaError):
        check_claim(claim(request(core="1e-3")), [], [quota(core="1000")])


# -- the admission request --------------------------------------------------------------------


def admission(obj, operation="CREATE", kind="ResourceClaim", group="resource.k8s.io"):
    return {"uid": "u1", "operation": operation, "namespace": NS,
            "kind": {"group": group, "version": "v1", "kind": kind}, "object": obj}


def test_a_claim_create_beyond_the_quota_is_denied_with_the_figures():
    new = claim(request(core="500", memory="1024"))
    del new["metadata"]["namespace"]  # the apiserver fills it in the review, not always in the object
    allowed, message = claim_admission(admission(new), [claim(request(core="600", memory="1024"), name="old")],
                                       [quota(core="1000")])
    assert not allowed
    assert message.startswith("qgpu: ResourceClaim team-a/c: exceeded quota 'gpu'")
    assert "used 600 + requested 500 > hard 1000" in message


def test_a_claim_create_within_the_quota_is_allowed():
    assert claim_admission(admission(claim(request(core="500", memory="1024"))), [], [quota(core="1000")]) == (True, "")


@pytest.mark.parametrize("review", [
    admission(claim(request(WHOLE_CLASS, count=8)), operation="UPDATE"),  # claim specs are immutable
    admission({"metadata": {"name": "p"}}, kind="Pod", group=""),
    admission(claim(request(WHOLE_CLASS, count=8)), group="example.com"),
])
def test_other_requests_are_not_judged(review):
    assert claim_admission(review, [], [quota(core="0")]) == (True, "")


def test_an_unreadable_claim_is_denied_naming_the_field():
    allowed, message = claim_admission(admission(claim(request(core="-1"))), [], [quota(core="1000")])
    assert not allowed and "capacity.requests.core='-1'" in message


def test_an_object_that_is_not_a_claim_is_denied():
    allowed, message = claim_admission(admission("nope"), [], [quota(core="1000")])
    assert not allowed and "must be a ResourceClaim object" in message


def test_without_a_qgpu_quota_even_a_malformed_claim_is_not_judged_here():
    assert check_claim(claim(request(core="-1")), [], [quota(**{"requests.cpu": "1"})]) == []


def test_a_broken_qgpu_quota_does_not_block_other_drivers_claims():
    assert check_claim(claim(request("gpu.nvidia.com")), [], [quota(core="4Ki")]) == []
    with pytest.raises(ClaimQuotaError, match="ResourceQuota gpu"):
        check_claim(claim(request(core="100", memory="1024")), [], [quota(core="4Ki")])
