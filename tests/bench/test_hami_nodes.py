"""The benchmark's HAMi side: node registration annotations and request translation.

HAMi's scheduler is not needed here. Its decoding rules are restated below from its sources
(v2.10.0), independently of bench/peers/hami_nodes.py, and the encoder's output is run through them:

- ``UnMarshalNodeDevices`` is ``json.Unmarshal`` into ``[]*DeviceInfo``; Go refuses a value whose
  JSON type does not fit the field (``count``/``devmem``/``devcore`` int32, ``index`` uint, ``numa``
  int, ``type``/``mode``/``id`` string, ``health`` bool) and leaves absent fields at zero values;
- ``CheckHealth`` splits the handshake at ``_`` and parses the rest with ``time.DateTime``;
- ``GenerateResourceRequests`` and ``Fit`` turn ``nvidia.com/gpu``, ``gpumem``,
  ``gpumem-percentage`` and ``gpucores`` into cards, MiB per card and percent of cores per card.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Mapping

import pytest

from bench.peers.hami_nodes import (
    ALLOCATED_ANNOTATION,
    HANDSHAKE_ANNOTATION,
    REGISTER_ANNOTATION,
    HamiCard,
    HamiTranslationError,
    allocated_cards,
    container_resources,
    hami_cards,
    handshake_annotation,
    node_allocatable,
    node_annotations,
    register_annotation,
    translate_pod,
)
from qgpu_runtime.model.requests import ContainerRequest, Dialect, parse_pod
from qgpu_runtime.placement.state import CardSpec

INT32 = (-(2**31), 2**31 - 1)
# DeviceInfo's JSON fields (pkg/device/devices.go) and the Go type each decodes into.
GO_FIELDS = {"id": "string", "index": "uint", "count": "int32", "devmem": "int32", "devcore": "int32",
             "type": "string", "numa": "int", "mode": "string", "health": "bool"}
GO_ZERO = {"string": "", "uint": 0, "int32": 0, "int": 0, "bool": False}


def go_unmarshal_node_devices(raw: str) -> list[dict[str, Any]]:
    """json.Unmarshal(raw, &[]*DeviceInfo) as Go does it for the fields the scheduler uses."""
    doc = json.loads(raw)
    if not isinstance(doc, list):
        raise ValueError("json: cannot unmarshal into Go value of type []*device.DeviceInfo")
    out = []
    for item in doc:
        assert isinstance(item, dict), item
        decoded = {name: GO_ZERO[kind] for name, kind in GO_FIELDS.items()}
        for key, value in item.items():
            kind = GO_FIELDS.get(key)
            if kind is None:
                continue  # Go ignores unknown keys
            if kind == "string" and not isinstance(value, str):
                raise ValueError(f"json: cannot unmarshal {value!r} into Go struct field DeviceInfo.{key} of type string")
            if kind == "bool" and not isinstance(value, bool):
                raise ValueError(f"json: cannot unmarshal {value!r} into Go struct field DeviceInfo.{key} of type bool")
            if kind in ("int32", "int", "uint"):
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"json: cannot unmarshal {value!r} into Go struct field DeviceInfo.{key} of type {kind}")
                low = 0 if kind == "uint" else INT32[0]
                if value < low or (kind == "int32" and value > INT32[1]):
                    raise ValueError(f"json: cannot unmarshal number {value} into Go struct field DeviceInfo.{key} of type {kind}")
            decoded[key] = value
        out.append(decoded)
    return out


def go_generate_resource_requests(limits: Mapping[str, str]) -> dict[str, int]:
    """NvidiaGPUDevices.GenerateResourceRequests (default config: defaultMemory 0, defaultCores 0)."""
    nums = int(limits["nvidia.com/gpu"])
    memreq = int(limits.get("nvidia.com/gpumem", "0"))
    mempct = 101
    if "nvidia.com/gpumem-percentage" in limits:
        value = min(int(limits["nvidia.com/gpumem-percentage"]), 100)
        mempct = value if value > 0 else 101
    if mempct == 101 and memreq == 0:
        mempct = 100
    cores = int(limits.get("nvidia.com/gpucores", "0"))
    return {"nums": nums, "memreq": memreq, "mempct": mempct, "cores": cores}


def go_fit_memory(request: Mapping[str, int], card_memory_mib: int) -> int:
    """The MiB Fit reserves on a card for this request."""
    if request["memreq"] > 0:
        return request["memreq"]
    return card_memory_mib * request["mempct"] // 100


V100 = [CardSpec(i, f"GPU-n1-{i:02d}", "V100", 32768) for i in range(8)]
T4 = [CardSpec(0, "GPU-t4-00", "Tesla T4", 16384)]


def test_register_annotation_decodes_to_the_cards_with_their_capacity():
    devices = go_unmarshal_node_devices(register_annotation(hami_cards(V100)))
    assert [d["id"] for d in devices] == [c.uuid for c in V100]
    assert [d["index"] for d in devices] == list(range(8))
    assert {(d["devmem"], d["devcore"], d["mode"], d["health"], d["numa"]) for d in devices} == {(32768, 100, "hami-core", True, 0)}


def test_register_annotation_is_byte_for_byte_what_go_marshals():
    # Go's encoder: struct field order, no spaces, omitempty drops index 0 / numa 0 / health false.
    cards = [HamiCard("GPU-a", 0, 8, 32768, 100, "NVIDIA-V100"),
             HamiCard("GPU-b", 1, 8, 32768, 100, "NVIDIA-V100", numa=1, healthy=False)]
    assert register_annotation(cards) == (
        '[{"id":"GPU-a","count":8,"devmem":32768,"devcore":100,"type":"NVIDIA-V100","mode":"hami-core","health":true},'
        '{"id":"GPU-b","index":1,"count":8,"devmem":32768,"devcore":100,"type":"NVIDIA-V100","numa":1,"mode":"hami-core"}]')


def test_split_count_matches_qgpus_own_pods_per_card():
    # 4 GiB per shared pod: a 32 GiB card takes 8 containers, a 16 GiB card 4, in both schedulers.
    assert [d["count"] for d in go_unmarshal_node_devices(register_annotation(hami_cards(V100)))] == [8] * 8
    assert go_unmarshal_node_devices(register_annotation(hami_cards(T4)))[0]["count"] == 4
    assert node_allocatable(V100) == {"nvidia.com/gpu": "64"}


def test_card_type_carries_the_nvidia_prefix_the_device_plugin_adds():
    assert [d["type"] for d in go_unmarshal_node_devices(register_annotation(hami_cards(V100 + T4)))][-2:] == \
        ["NVIDIA-V100", "NVIDIA-Tesla T4"]
    named = [CardSpec(0, "GPU-h", "NVIDIA H100 80GB HBM3", 81559)]
    assert go_unmarshal_node_devices(register_annotation(hami_cards(named)))[0]["type"] == "NVIDIA H100 80GB HBM3"


def test_a_card_without_capacity_is_refused_naming_the_card():
    with pytest.raises(HamiTranslationError, match=r"card GPU-z: split_count=0.*>= 1"):
        register_annotation([HamiCard("GPU-z", 0, 0, 32768, 100, "NVIDIA-V100")])


def test_handshake_is_requesting_with_a_go_datetime_stamp():
    now = datetime.datetime(2026, 11, 24, 9, 5, 7)
    value = handshake_annotation(now)
    assert "Requesting" in value  # CheckHealth's first test
    _, stamp = value.split("_", 1)  # strings.Cut(handshake, "_")
    assert datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S") == now  # time.DateTime = "2006-01-02 15:04:05"
    assert set(node_annotations(V100, now)) == {REGISTER_ANNOTATION, HANDSHAKE_ANNOTATION}


@pytest.mark.parametrize(("qgpu_limits", "cards", "memory_mib", "cores"), [
    ({"tke.cloud.tencent.com/qgpu-core": "25", "tke.cloud.tencent.com/qgpu-memory": "4"}, 1, 4096, 25),
    ({"tke.cloud.tencent.com/qgpu-core": "50", "tke.cloud.tencent.com/qgpu-memory": "10"}, 1, 10240, 50),
    ({"tke.cloud.tencent.com/qgpu-core": "100"}, 1, 32768, 100),
    ({"tke.cloud.tencent.com/qgpu-core": "200"}, 2, 32768, 100),
    ({"nvidia.com/gpu": "4"}, 4, 32768, 100),
])
def test_translated_request_asks_hami_for_the_same_share(qgpu_limits, cards, memory_mib, cores):
    pod = {"metadata": {"name": "p", "namespace": "ns"},
           "spec": {"containers": [{"name": "main", "image": "x", "resources": {"limits": qgpu_limits}}]}}
    hami_pod = translate_pod(pod, parse_pod(pod))
    limits = hami_pod["spec"]["containers"][0]["resources"]["limits"]
    assert not any(k.startswith("tke.cloud.tencent.com/") for k in limits)
    request = go_generate_resource_requests(limits)
    assert (request["nums"], go_fit_memory(request, 32768), request["cores"]) == (cards, memory_mib, cores)


def test_translation_keeps_other_resources_and_containers():
    pod = {"metadata": {"name": "p", "namespace": "ns"},
           "spec": {"containers": [
               {"name": "gpu", "image": "x", "resources": {"limits": {"cpu": "2", "tke.cloud.tencent.com/qgpu-core": "30",
                                                                      "tke.cloud.tencent.com/qgpu-memory": "4"},
                                                           "requests": {"cpu": "1"}}},
               {"name": "side", "image": "y", "resources": {"limits": {"cpu": "1"}}}]}}
    out = translate_pod(pod, parse_pod(pod))
    assert out["spec"]["containers"][0]["resources"] == {
        "limits": {"cpu": "2", "nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30"},
        "requests": {"cpu": "1"}}
    assert out["spec"]["containers"][1] == pod["spec"]["containers"][1]
    assert pod["spec"]["containers"][0]["resources"]["limits"]["tke.cloud.tencent.com/qgpu-core"] == "30"  # input untouched


def test_memory_percent_requests_use_hamis_percentage_resource():
    limits = container_resources(ContainerRequest("m", Dialect.T9K, cards=1, core_milli=200, memory_pct=25))
    request = go_generate_resource_requests(limits)
    assert (go_fit_memory(request, 32768), request["cores"]) == (8192, 20)


def test_online_memory_only_requests_reserve_no_cores():
    limits = container_resources(ContainerRequest("o", Dialect.QGPU, cards=1, core_milli=0, memory_mib=2048))
    assert limits == {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "2048"}
    assert go_generate_resource_requests(limits)["cores"] == 0


@pytest.mark.parametrize(("request_", "message"), [
    (ContainerRequest("w", Dialect.T9K, cards=8, core_milli=1000, exclusive=True, whole_node=True), r"'w': whole_node=True"),
    (ContainerRequest("s", Dialect.QGPU, cards=1, core_milli=250), r"'s': memory_mib=0"),
    (ContainerRequest("c", Dialect.QGPU, cards=1, core_milli=255, memory_mib=1024), r"'c': core_milli=255"),
])
def test_requests_without_a_hami_equivalent_are_refused_with_the_field(request_, message):
    with pytest.raises(HamiTranslationError, match=message):
        container_resources(request_)


def test_allocated_cards_reads_hamis_pod_device_encoding():
    # EncodePodSingleDevice: "uuid,type,mem,cores:" per card, ";" after each container.
    annotations = {ALLOCATED_ANNOTATION: "GPU-a,NVIDIA,4096,25:;GPU-b,NVIDIA,32768,100:GPU-c,NVIDIA,32768,100:;"}
    assert allocated_cards(annotations) == [("GPU-a", 4096, 25), ("GPU-b", 32768, 100), ("GPU-c", 32768, 100)]
    assert allocated_cards({}) == []
    with pytest.raises(HamiTranslationError, match="fewer than 4 fields"):
        allocated_cards({ALLOCATED_ANNOTATION: "GPU-a,NVIDIA:;"})
