"""The DRA codec: slice devices carry qgpu's rules; the allocation decoder refuses what qgpu never publishes."""

from __future__ import annotations

import pytest

from qgpu_runtime.contract import dra, draclaim
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model.requests import CardLimits


def _claim(results, allocated=True):
    status = {"allocation": {"devices": {"results": results}}} if allocated else {}
    return {"metadata": {"namespace": "ns", "name": "c"}, "status": status}


def _result(**over):
    r = {"request": "gpu", "driver": dra.DRIVER, "pool": "node-a", "device": "gpu-1",
         "consumedCapacity": {"core": "300", "memory": "4096", "pods": "1"}, "shareID": "abc"}
    r.update(over)
    return r


def test_slice_device_encodes_the_rules_of_a_shared_card():
    card = CardInfo(index=3, uuid="GPU-x", model="Tesla T4", memory_mib=15360, minor=3)
    d = dra.slice_device(card, "fixed-share", CardLimits())
    assert d["name"] == "gpu-3" and d["allowMultipleAllocations"] is True
    assert d["attributes"]["model"] == {"string": "Tesla T4"}
    cap = d["capacity"]
    assert cap["core"]["value"] == "1000" and cap["core"]["requestPolicy"]["validRange"] == {"min": "10", "max": "1000", "step": "10"}
    # 15 GiB card: memory in whole GiB, 1 GiB minimum; a claim naming nothing takes the whole card
    assert cap["memory"]["value"] == "15360" and cap["memory"]["requestPolicy"]["validRange"]["step"] == "1024"
    assert cap["memory"]["requestPolicy"]["default"] == "15360"
    assert cap["pods"]["value"] == "3"  # floor(15 GiB / 4 GiB per shared pod)


def test_odd_memory_rounds_down_to_whole_gib():
    card = CardInfo(index=0, uuid="u", model="m", memory_mib=16160, minor=0)
    assert dra.slice_device(card, "best-effort")["capacity"]["memory"]["value"] == str(15 * 1024)


def test_claim_shares_decodes_this_drivers_results_only():
    other = {"request": "nic", "driver": "net.example.com", "pool": "p", "device": "d"}
    shares = draclaim.claim_shares(_claim([other, _result()]), "node-a")
    assert shares == [draclaim.ClaimShare("gpu", "node-a", "gpu-1", 1, 300, 4096, "abc")]


@pytest.mark.parametrize("result, words", [
    (_result(pool="node-b"), "pool 'node-b'"),
    (_result(device="card7"), "not a qgpu device"),
    (_result(device="gpu-01"), "not a qgpu device"),
    (_result(consumedCapacity=None), "DRAConsumableCapacity"),
    (_result(consumedCapacity={"core": "300"}), "must name"),
    (_result(consumedCapacity={"core": "300", "memory": "4Gi"}), "consumedCapacity.memory='4Gi': must be a non-negative whole number"),
    (_result(consumedCapacity={"core": "30%", "memory": "1"}), "consumedCapacity.core='30%': must be a non-negative whole number"),
    (_result(consumedCapacity={"core": "3k", "memory": "1"}), "must be 10..1000"),
    (_result(consumedCapacity={"core": "0", "memory": "1"}), "must be 10..1000"),
    (_result(consumedCapacity={"core": "1001", "memory": "1"}), "must be 10..1000"),
    (_result(consumedCapacity={"core": "10", "memory": "0"}), ">= 1 MiB"),
])
def test_claim_shares_refuses_with_the_field_and_rule(result, words):
    with pytest.raises(draclaim.DraClaimError, match="ResourceClaim ns/c") as e:
        draclaim.claim_shares(_claim([result]), "node-a")
    assert words in str(e.value)


def test_claim_shares_reads_the_apiservers_canonical_quantities():
    """kube-apiserver stores 1000 as "1k" and 128000 as "128k": a whole card comes back that way."""
    (share,) = draclaim.claim_shares(_claim([_result(consumedCapacity={"core": "1k", "memory": "128k"})]), "node-a")
    assert (share.core_milli, share.memory_mib) == (1000, 128000)


def test_unallocated_claim_is_refused():
    with pytest.raises(draclaim.DraClaimError, match="not allocated"):
        draclaim.claim_shares(_claim([], allocated=False), "node-a")


def test_device_names_round_trip():
    for i in (0, 1, 7, 15, 1023):
        assert dra.card_index(dra.device_name(i)) == i


def test_device_classes_select_this_driver():
    shared, whole = dra.device_classes()
    assert shared["metadata"]["name"] == dra.SHARED_CLASS and "allowMultipleAllocations" in shared["spec"]["selectors"][0]["cel"]["expression"]
    assert whole["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert "extendedResourceName" not in dra.device_classes(None)[1]["spec"]


def test_share_config_round_trips_and_refuses_what_qgpu_never_writes():
    assert draclaim.read_share_config(draclaim.share_config("offline", True)) == ("offline", True)
    with pytest.raises(ValueError, match="appClass"):
        draclaim.share_config("batch", False)
    with pytest.raises(draclaim.DraClaimError, match="ShareConfig"):
        draclaim.read_share_config({"apiVersion": "other/v1", "kind": "ShareConfig"})
    with pytest.raises(draclaim.DraClaimError, match="greedy a boolean"):
        draclaim.read_share_config({**draclaim.share_config("online", False), "greedy": "yes"})
    # a key ShareConfig does not have (a typo of memoryOnly would otherwise be silently ignored)
    with pytest.raises(draclaim.DraClaimError, match=r"ShareConfig has no key 'memoryonly'; it takes apiVersion, appClass, dialect"):
        draclaim.read_share_settings({**draclaim.share_config("normal", False), "memoryonly": True})


def test_share_config_carries_a_peers_dialect_and_memory_only_and_refuses_anything_else():
    from qgpu_runtime.contract.record import ContainerDialect

    written = draclaim.share_config("normal", False, ContainerDialect("kai", 50), memory_only=True)
    assert draclaim.read_share_settings(written) == draclaim.ShareSettings("normal", False, ContainerDialect("kai", 50), True)
    assert draclaim.read_share_settings(draclaim.share_config("normal", False)).dialect is None
    for bad, rule in [({"dialect": "nano"}, "dialect must be an object"), ({"dialect": "hami", "memory_pct": 0}, "1..100"),
                      ({"dialect": "t9k", "whole_node": "yes"}, "a boolean"), ({"dialect": "hami", "cores": 5}, "nothing else"),
                      ("hami", "must be an object")]:
        with pytest.raises(draclaim.DraClaimError, match=rf"dialect=.*not allowed: .*{rule}"):
            draclaim.read_share_settings({**written, "dialect": bad})
    with pytest.raises(draclaim.DraClaimError, match="memoryOnly='yes' are not allowed: must be a boolean"):
        draclaim.read_share_settings({**written, "memoryOnly": "yes"})


def _claim_with(config: list, where: str = "spec") -> dict:
    obj: dict = {"metadata": {"namespace": "ns", "name": "c"}, "spec": {"devices": {"requests": []}}, "status": {}}
    if where == "spec":
        obj["spec"]["devices"]["config"] = config
    else:
        obj["status"]["allocation"] = {"devices": {"results": [], "config": config}}
    return obj


def test_the_kubelet_plugin_reads_the_share_config_the_webhook_writes_per_request():
    written = [{"requests": ["gpu"], "opaque": {"driver": dra.DRIVER, "parameters": draclaim.share_config("offline", True)}}]
    settings = draclaim.claim_share_settings(_claim_with(written), ["gpu", "other"])
    assert settings == {"gpu": draclaim.ShareSettings("offline", True), "other": draclaim.NORMAL_SHARE}
    assert draclaim.claim_share_settings(_claim_with([]), ["gpu"]) == {"gpu": draclaim.NORMAL_SHARE}


def test_later_configs_override_earlier_ones_and_the_allocation_copy_is_read_first():
    entries = [{"source": "FromClass", "requests": [], "opaque": {"driver": dra.DRIVER, "parameters": draclaim.share_config("online", False)}},
               {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": dra.DRIVER, "parameters": draclaim.share_config("offline", True)}}]
    assert draclaim.claim_share_settings(_claim_with(entries, "status"), ["gpu", "b"]) == \
        {"gpu": draclaim.ShareSettings("offline", True), "b": draclaim.ShareSettings("online", False)}


def test_a_malformed_share_config_names_the_claim_and_the_field():
    bad = [{"opaque": {"driver": "x.example.com", "parameters": {}}},
           {"requests": [], "opaque": {"driver": dra.DRIVER, "parameters": {"apiVersion": draclaim.CONFIG_API_VERSION, "kind": draclaim.CONFIG_KIND,
                                                                          "appClass": "batch"}}}]
    with pytest.raises(draclaim.DraClaimError, match=r"^ResourceClaim ns/c: status.allocation.devices.config\[1\].opaque.parameters: "):
        draclaim.claim_share_settings(_claim_with(bad, "status"), ["gpu"])
    with pytest.raises(draclaim.DraClaimError, match=r"spec.devices.config 'x' is not allowed: must be a list"):
        draclaim.claim_share_settings(_claim_with("x"), ["gpu"])  # type: ignore[arg-type]


def test_selectors_name_the_drivers_attributes():
    assert dra.memory_selector(15360) == 'device.attributes["gpu.qgpu.io"].memoryMiB == 15360'
    assert dra.model_selector(["T4", "V100", "T4"]) == 'device.attributes["gpu.qgpu.io"].model in ["T4", "V100"]'


def _smallest_valid(requested: int, valid_range: dict[str, str]) -> int:
    """What the DRA allocator consumes under a validRange requestPolicy: the smallest min + k*step
    at or above the request (the slice's rule, read from the slice itself; above max the device
    cannot take the request at all)."""
    low, step = int(valid_range["min"]), int(valid_range["step"])
    return low if requested <= low else low + -(-(requested - low) // step) * step


@pytest.mark.parametrize("limits", [CardLimits(), CardLimits(min_shared_memory_mib=512)])
def test_the_rounding_the_extender_scores_with_is_the_slice_request_policy(limits):
    device = dra.slice_device(CardInfo(0, "GPU-0", "V100", 32768, 0), "binpack", limits)
    core_range = device["capacity"][dra.CORE]["requestPolicy"]["validRange"]
    memory_range = device["capacity"][dra.MEMORY]["requestPolicy"]["validRange"]
    for core in range(1, 1001):
        assert dra.consumed_core(core) == _smallest_valid(core, core_range), core
    for mib in range(1, int(memory_range["max"]) + 1, 97):
        assert dra.consumed_memory(mib, limits) == _smallest_valid(mib, memory_range), mib


@pytest.mark.parametrize("value,number", [("0", 0), ("250", 250), ("1k", 1000), ("32768", 32768), ("2M", 2 * 10**6),
                                          (40, 40), ("1.5k", 1500), ("1234567890", 1234567890), ("5T", 5 * 10**12),
                                          ("-1", None), ("1Ki", None), ("", None), ("500m", None), ("1" * 20, None),
                                          (True, None), (1.0, None), (None, None)])
def test_capacity_number_reads_every_form_the_apiserver_serves_of_a_whole_number(value, number):
    """The one rule of every DRA reader (it replaced capacity_integer, which read only up to nine
    digits and k, M, G): whole numbers in qgpu's units up to 2^63-1, decimal suffixes and exponents
    as the apiserver canonicalises them; fractions, signs, binary suffixes and other types refused."""
    if number is None:
        with pytest.raises(ValueError, match=r"^capacity=.*: must be a non-negative whole number in qgpu's units"):
            dra.capacity_number("capacity", value)
    else:
        assert dra.capacity_number("capacity", value) == number
