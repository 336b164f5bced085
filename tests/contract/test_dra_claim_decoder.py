"""One ResourceClaim decoder (contract/draclaim.py) for its three readers: the webhook's quota, the
extender's DRA view and the node's kubelet plugin read the same claim alike, and a malformed claim
is refused at admission, refused by the node, and treated conservatively by readers of stored
state (no preference in the extender, a whole card per request in the quota), never a crash.
Also the ResourceSlice decoder (contract/dra.py ``read_slice``) against its encoder."""

from __future__ import annotations

from typing import Any

import pytest

from qgpu_runtime.contract import dra, draclaim
from qgpu_runtime.contract.inventory import MAX_INDEX
from qgpu_runtime.extender.dra import Ask, DemandError, DraView, claim_asks, claim_usage
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.webhook.claimquota import CORE_QUOTA, ClaimQuotaError, Usage, check_claim, claim_admission
from qgpu_runtime.webhook.claimquota import claim_usage as quota_usage

CARD_MIB = 32768
NS = "team-a"


def _claim(*requests: dict[str, Any], name: str = "c", results: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"metadata": {"namespace": NS, "name": name, "uid": f"uid-{name}"},
                           "spec": {"devices": {"requests": list(requests)}}}
    if results is not None:
        doc["status"] = {"allocation": {"devices": {"results": results}}}
    return doc


def _exactly(cls: str = dra.SHARED_CLASS, core: Any = None, memory: Any = None, **extra: Any) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls, **extra}
    asked = {k: v for k, v in ((dra.CORE, core), (dra.MEMORY, memory)) if v is not None}
    if asked:
        exactly["capacity"] = {"requests": asked}
    return {"name": "gpu", "exactly": exactly}


def _result(pool: str = "node-a", device: str = "gpu-1", core: Any = "300", memory: Any = "4096") -> dict[str, Any]:
    return {"request": "gpu", "driver": dra.DRIVER, "pool": pool, "device": device, "shareID": "s",
            "consumedCapacity": {dra.CORE: core, dra.MEMORY: memory, dra.PODS: "1"}}


def _review(claim: dict[str, Any]) -> dict[str, Any]:
    return {"uid": "u", "operation": "CREATE", "namespace": NS, "kind": {"group": "resource.k8s.io", "kind": "ResourceClaim"},
            "object": claim}


QUOTA = {"metadata": {"name": "gpu", "namespace": NS}, "spec": {"hard": {CORE_QUOTA: "100k"}}}

# --- one claim, every reader ---------------------------------------------------------------------

SAME = [
    # (claim requests, decoded, extender asks, quota usage)
    ([_exactly(core="300", memory="4096")],
     [draclaim.ClaimRequest("gpu", (draclaim.DeviceAsk("gpu", dra.SHARED_CLASS, 1, 300, 4096),))],
     [Ask(300, 4096)], Usage(300, 4096)),
    ([_exactly(core="1k", memory="32k", count=2)],  # as the apiserver serves 1000 and 32000
     [draclaim.ClaimRequest("gpu", (draclaim.DeviceAsk("gpu", dra.SHARED_CLASS, 2, 1000, 32000),))],
     [Ask(1000, 32768)] * 2, Usage(2000, 65536)),  # both what the allocator consumes
    ([_exactly(dra.WHOLE_CLASS, count=2)],
     [draclaim.ClaimRequest("gpu", (draclaim.DeviceAsk("gpu", dra.WHOLE_CLASS, 2, None, None),))],
     [Ask(None, None)] * 2, Usage(2000, 2 * CARD_MIB)),
    ([{"name": "gpu", "firstAvailable": [
        {"name": "nv", "deviceClassName": "gpu.nvidia.com"},
        {"name": "t4", "deviceClassName": dra.SHARED_CLASS, "capacity": {"requests": {"core": "10", "memory": "4096"}}},
        {"name": "v100", "deviceClassName": dra.SHARED_CLASS, "capacity": {"requests": {"core": "10", "memory": "8192"}}}]}],
     [draclaim.ClaimRequest("gpu", (draclaim.DeviceAsk("gpu/t4", dra.SHARED_CLASS, 1, 10, 4096),
                                    draclaim.DeviceAsk("gpu/v100", dra.SHARED_CLASS, 1, 10, 8192)), prioritized=True)],
     [Ask(10, 4096)], Usage(10, 8192)),  # the allocator tries t4 first; the quota charges the largest
    ([_exactly("gpu.nvidia.com", count=4)], [], [], Usage()),
]


@pytest.mark.parametrize("requests, decoded, asks, usage", SAME)
def test_the_webhook_and_the_extender_read_a_claims_requests_with_one_decoder(requests, decoded, asks, usage):
    claim = _claim(*requests)
    assert draclaim.claim_requests(claim) == decoded
    assert claim_asks(claim["spec"]) == asks
    assert quota_usage(claim, CARD_MIB) == usage
    template = {"metadata": {"namespace": NS, "name": "t"}, "spec": {"spec": claim["spec"]}}
    assert draclaim.template_requests(template) == decoded


def test_the_node_and_the_extender_read_an_allocation_alike():
    claim = _claim(_exactly(core="300", memory="4096"), results=[_result(core="1k", memory="128k")])
    (share,) = draclaim.claim_shares(claim, "node-a")
    (usage,) = claim_usage(claim)
    assert (share.pool, share.device, share.core_milli, share.memory_mib) == (usage.node, usage.device, usage.core, usage.memory) \
        == ("node-a", "gpu-1", 1000, 128000)


# --- a malformed claim, every reader --------------------------------------------------------------

MALFORMED = [
    (_exactly(core="-1"), "spec.devices.requests[0].exactly.capacity.requests.core='-1': must be a non-negative whole number"),
    (_exactly(memory="4Gi"), "spec.devices.requests[0].exactly.capacity.requests.memory='4Gi': must be a non-negative whole number"),
    (_exactly(count=0), "spec.devices.requests[0].exactly.count=0: must be an integer 1..32"),
    (_exactly(count="2"), "spec.devices.requests[0].exactly.count='2': must be an integer 1..32"),
    (_exactly(allocationMode="Some"), "spec.devices.requests[0].exactly.allocationMode='Some': must be ExactCount or All"),
    (_exactly(capacity="x"), "spec.devices.requests[0].exactly.capacity='x': must be an object with a 'requests' object"),
]


@pytest.mark.parametrize("request_, words", MALFORMED)
def test_a_malformed_claim_is_refused_at_admission_naming_the_field(request_, words):
    claim = _claim(request_)
    with pytest.raises(draclaim.DraClaimError, match="^ResourceClaim team-a/c: ") as e:
        draclaim.claim_requests(claim)
    assert words in str(e.value)
    with pytest.raises(ClaimQuotaError):
        quota_usage(claim, CARD_MIB)
    allowed, message = claim_admission(_review(claim), [], [QUOTA])
    assert not allowed and message == f"qgpu: {e.value}"


@pytest.mark.parametrize("request_, words", MALFORMED)
def test_a_malformed_stored_claim_gives_the_extender_no_preference_and_no_crash(request_, words):
    claim = _claim(request_)
    with pytest.raises(DemandError, match="^ResourceClaim team-a/c: spec.devices"):
        claim_asks(claim["spec"], where="ResourceClaim team-a/c: spec")
    view = DraView()
    view.replace_slices([])
    view.apply_claim("ADDED", claim)
    pod = {"metadata": {"namespace": NS, "name": "p"}, "spec": {"resourceClaims": [{"name": "x", "resourceClaimName": "c"}]}}
    assert view.demand(pod) is None


@pytest.mark.parametrize("request_, words", MALFORMED)
def test_a_malformed_stored_claim_is_charged_a_whole_card_by_the_quota(request_, words):
    bad = _claim(request_, name="bad")
    new = _claim(_exactly(core="100", memory="1024"))
    refusals = check_claim(new, [bad], [{"metadata": {"name": "gpu"}, "spec": {"hard": {CORE_QUOTA: "1000"}}}], CARD_MIB)
    assert [(r.used, r.requested) for r in refusals] == [(1000, 100)]
    assert draclaim.qgpu_request_count(bad) == 1


def test_a_malformed_allocation_is_refused_by_the_node_and_counts_nothing_in_the_extender_for_its_pool_only():
    claim = _claim(_exactly(), results=[_result("node-a", core="4Gi"), _result("node-b", device="gpu-0")])
    with pytest.raises(draclaim.DraClaimError, match=r"results\[0\]\.consumedCapacity\.core='4Gi': must be a non-negative whole"):
        draclaim.claim_shares(claim, "node-a")
    assert [(u.node, u.device) for u in claim_usage(claim)] == [("node-b", "gpu-0")]


def test_what_the_webhook_writes_decodes_to_what_it_meant():
    claim = _claim({"name": "gpu", "exactly": {"deviceClassName": dra.SHARED_CLASS, "capacity": draclaim.capacity_requests(250, 3072)}})
    assert draclaim.claim_requests(claim)[0].alternatives[0] == draclaim.DeviceAsk("gpu", dra.SHARED_CLASS, 1, 250, 3072)


# --- the ResourceSlice, both directions ----------------------------------------------------------

def _slice(*devices: dict[str, Any], driver: str = dra.DRIVER, node: str = "node-a") -> dict[str, Any]:
    pool = {"name": dra.pool_name(node), "generation": 1, "resourceSliceCount": 1}
    return {"metadata": {"name": dra.slice_name(node)}, "spec": {"driver": driver, "nodeName": node, "pool": pool, "devices": list(devices)}}


def test_read_slice_gives_back_the_cards_slice_device_wrote_in_their_order():
    cards = [CardInfo(3, "GPU-3", "Tesla T4", 15109, 3), CardInfo(0, "GPU-0", "H100", 81559, 0)]
    read = dra.read_slice(_slice(*(dra.slice_device(c, "burst-share") for c in cards)))
    assert read == dra.SliceCards("node-a", (dra.SliceCard("gpu-3", 3, "GPU-3", "Tesla T4", 14336, "burst-share"),
                                              dra.SliceCard("gpu-0", 0, "GPU-0", "H100", 80896, "burst-share")))


def test_read_slice_skips_other_drivers_and_slices_without_a_node():
    device = dra.slice_device(CardInfo(0, "GPU-0", "T4", 15360, 0), "best-effort")
    assert dra.read_slice(_slice(device, driver="gpu.nvidia.com")) is None
    assert dra.read_slice(_slice(device, node="")) is None
    assert dra.read_slice({"spec": "x"}) is None


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d["attributes"]["index"].update(int=MAX_INDEX + 1), f"attributes.index.int={MAX_INDEX + 1}: must be an integer"),
    (lambda d: d["attributes"]["index"].update(int="0"), "attributes.index.int='0': must be an integer"),
    (lambda d: d["attributes"].pop("index"), "attributes.index.int=None"),
    (lambda d: d["capacity"]["memory"].update(value=str(2**64)), "capacity.memory.value='18446744073709551616'"),
    (lambda d: d["capacity"]["memory"].update(value="0"), "capacity.memory.value='0': must be 1.."),
    (lambda d: d["capacity"]["memory"].update(value="16Gi"), "capacity.memory.value='16Gi': must be a non-negative whole number"),
])
def test_a_device_that_is_not_a_card_is_dropped_with_its_reason_and_the_others_kept(mutate, words):
    bad, good = (dra.slice_device(CardInfo(i, f"GPU-{i}", "T4", 15360, i), "best-effort") for i in (0, 1))
    mutate(bad)
    read = dra.read_slice(_slice(bad, good, "not a device"))
    assert read is not None and [c.index for c in read.cards] == [1]
    assert words in read.dropped[0] and read.dropped[0].startswith("device 'gpu-0': ")
    assert read.dropped[1] == "device 'not a device': must be an object"
