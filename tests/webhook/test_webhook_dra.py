"""/mutate-dra: every dialect becomes a DRA claim asking what the extender would have placed; the
parser's refusals keep their words; nvidia.com/gpu and device-plugin pods stay as they are."""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings

from qgpu_runtime.contract import dra, draclaim, names
from qgpu_runtime.model.requests import MAX_MODEL_NAME_CHARS, MAX_MODEL_NAMES, RequestError, parse_pod
from qgpu_runtime.webhook import cli
from qgpu_runtime.webhook.admission import XGN_TOLERATION, WebhookConfig, mutate
from qgpu_runtime.webhook.dra import ClaimTemplate, DraConfig, DraRefusal, TemplateError, convert, mutate_dra
from tests.jsonmutation import mutations

QGPU_CORE = "tke.cloud.tencent.com/qgpu-core"
QGPU_MEMORY = "tke.cloud.tencent.com/qgpu-memory"
QGPU_GREEDY = "tke.cloud.tencent.com/qgpu-core-greedy"
APP_CLASS = "tke.cloud.tencent.com/app-class"


def container(name: str = "c", limits: dict | None = None, requests: dict | None = None) -> dict:
    resources: dict = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    return {"name": name, "image": "busybox", "resources": resources}


def pod(*containers: dict, annotations: dict | None = None, **spec: object) -> dict:
    meta: dict = {"name": "p", "namespace": "ns"}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": {"containers": list(containers) or [container()], **spec}}


def apply_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 ``add`` and ``remove``, the operations the webhook emits, as the apiserver applies them."""
    out = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target: Any = out
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if op["op"] == "remove":
            del target[int(last) if isinstance(target, list) else last]
        elif isinstance(target, list):
            assert op["op"] == "add", op
            target.insert(len(target) if last == "-" else int(last), op["value"])
        else:
            assert op["op"] == "add" and last not in target, op
            target[last] = op["value"]
    return out


def applied(p: dict, config: DraConfig | None = None) -> tuple[dict, dict[str, dict]]:
    """The pod after the patch, and the claim specs of its templates by name."""
    conversion = convert(p, config or DraConfig())
    return apply_patch(p, conversion.patch), {t.name: t.claim_spec for t in conversion.templates}


def only_request(spec: dict) -> dict:
    (request,) = spec["devices"]["requests"]
    return request


# --- every dialect ------------------------------------------------------------------------------

def test_qgpu_share_becomes_a_shared_claim_in_qgpu_units():
    out, templates = applied(pod(container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4", "cpu": "1"})))
    assert list(templates) == ["qgpu-c300-m4096-x1"]
    assert only_request(templates["qgpu-c300-m4096-x1"]) == {"name": "gpu", "exactly": {
        "deviceClassName": dra.SHARED_CLASS, "allocationMode": "ExactCount", "count": 1,
        "capacity": {"requests": {"core": "300", "memory": "4096"}}}}
    assert out["spec"]["resourceClaims"] == [{"name": "qgpu-0", "resourceClaimTemplateName": "qgpu-c300-m4096-x1"}]
    assert out["spec"]["containers"][0]["resources"] == {"limits": {"cpu": "1"}, "claims": [{"name": "qgpu-0"}]}


def test_vcuda_share_asks_the_same_claim_with_memory_in_whole_gib():
    out, templates = applied(pod(container(limits={"tencent.com/vcuda-core": "30", "tencent.com/vcuda-memory": "15"},
                                           requests={"tencent.com/vcuda-core": "30", "tencent.com/vcuda-memory": "15"})))
    # 15 × 256 MiB = 3840 MiB, rounded up to the slices' 1 GiB step
    assert list(templates) == ["qgpu-c300-m4096-x1"]
    assert out["spec"]["containers"][0]["resources"] == {"limits": {}, "requests": {}, "claims": [{"name": "qgpu-0"}]}


def test_t9k_whole_cards_become_whole_card_claims_on_distinct_cards():
    out, templates = applied(pod(container(limits={"tensorstack.dev/nvidia-gpu": "2"})))
    spec = templates["qgpu-whole-x2"]
    assert only_request(spec) == {"name": "gpu", "exactly": {"deviceClassName": dra.WHOLE_CLASS, "allocationMode": "ExactCount", "count": 2}}
    assert spec["devices"]["constraints"] == [{"requests": ["gpu"], "distinctAttribute": "gpu.qgpu.io/uuid"}]
    assert XGN_TOLERATION in out["spec"]["tolerations"]


@pytest.mark.parametrize("limits", [{QGPU_CORE: "200", QGPU_MEMORY: "8"}, {"tencent.com/vcuda-core": "200"}])
def test_qgpu_and_vcuda_multiples_of_100_are_whole_cards(limits):
    _, templates = applied(pod(container(limits=limits)))
    assert list(templates) == ["qgpu-whole-x2"]


def test_one_whole_card_needs_no_constraint():
    _, templates = applied(pod(container(limits={"tensorstack.dev/nvidia-gpu": "1"})))
    assert "constraints" not in templates["qgpu-whole-x1"]["devices"]


def test_t9k_whole_node_takes_every_card_of_an_xgn_node_and_tells_the_node_its_mode():
    out, templates = applied(pod(container(limits={"tensorstack.dev/nvidia-gpu-node": "1"}), nodeSelector={"zone": "a"}))
    spec = templates["qgpu-node-t9k"]
    assert only_request(spec) == {"name": "gpu", "exactly": {"deviceClassName": dra.WHOLE_CLASS, "allocationMode": "All"}}
    # Only on xgn nodes, as the extender places it on device-plugin pools (issue 22 §2).
    assert out["spec"]["nodeSelector"] == {"zone": "a", "sched.tensorstack.dev/node-alloc-mode": "xgn"}
    settings = draclaim.read_share_settings(spec["devices"]["config"][0]["opaque"]["parameters"])
    assert (settings.dialect.dialect, settings.dialect.whole_node, settings.memory_only) == ("t9k", True, False)


def test_t9k_whole_cards_and_percent_need_no_xgn_selector():
    for limits in ({"tensorstack.dev/nvidia-gpu": "1"}, {"tensorstack.dev/nvidia-gpu-percent": "25"}):
        out, _ = applied(pod(container(limits=limits)), DraConfig(card_memory_mib=(32768,)))
        assert "nodeSelector" not in out["spec"]
    _, templates = applied(pod(container(limits={"tensorstack.dev/nvidia-gpu": "1"})), DraConfig(card_memory_mib=(32768,)))
    assert all("config" not in spec["devices"] for spec in templates.values())  # a whole card: nothing to configure


def test_a_t9k_percent_share_asks_no_core_and_is_booked_memory_only():
    """T9k's percent asks memory only: its claim must ask the smallest core step (DRA has no zero
    request), and tells the node to book core 0, as on device-plugin pools, so fixed-share does not
    cap it at that step (1 %)."""
    _, templates = applied(pod(container(limits={"tensorstack.dev/nvidia-gpu-percent": "25"})), DraConfig(card_memory_mib=(32768,)))
    ((name, spec),) = templates.items()
    assert name.startswith("qgpu-pct25-s") and name.endswith("-mo")  # a new name: the old template said otherwise
    settings = draclaim.read_share_settings(spec["devices"]["config"][0]["opaque"]["parameters"])
    assert (settings.app_class, settings.dialect, settings.memory_only) == ("normal", None, True)
    online = {**pod(container(limits={"tke.cloud.tencent.com/qgpu-memory": "4"}))}
    online["metadata"] = {**online["metadata"], "annotations": {"tke.cloud.tencent.com/app-class": "online"}}
    _, templates = applied(online, DraConfig(card_memory_mib=(32768,)))
    ((name, spec),) = templates.items()
    settings = draclaim.read_share_settings(spec["devices"]["config"][0]["opaque"]["parameters"])
    assert (settings.app_class, settings.memory_only) == ("online", False)  # the node books an online share's core 0 already


def test_hamis_vgpu_claim_carries_its_dialect_for_the_nodes_variables():
    _, templates = applied(pod(container(limits={"nvidia.com/gpu": "2", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"})))
    spec = templates["qgpu-c300-m3072-x2-hami"]
    settings = draclaim.read_share_settings(spec["devices"]["config"][0]["opaque"]["parameters"])
    assert (settings.app_class, settings.dialect.dialect, settings.memory_only) == ("normal", "hami", False)


@pytest.mark.parametrize(("limits", "annotations", "spec"), [
    ({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50"}, {}, {}),
    ({}, {"gpu-fraction": "0.5"}, {"schedulerName": "kai-scheduler"}),
], ids=["hami-percent", "kai-fraction"])
def test_a_peers_memory_only_share_is_booked_memory_only_and_keeps_its_percent(limits, annotations, spec):
    _, templates = applied(pod(container(limits=limits), annotations=annotations, **spec), DraConfig(card_memory_mib=(32768,)))
    ((name, claim),) = templates.items()
    assert name.startswith("qgpu-pct50-s")
    assert only_request(claim)["firstAvailable"][0]["capacity"] == {"requests": {"core": "10", "memory": "16384"}}
    settings = draclaim.read_share_settings(claim["devices"]["config"][0]["opaque"]["parameters"])
    assert (settings.dialect.memory_pct, settings.memory_only) == (50, True)


def test_nano_gpu_percent_is_that_share_of_a_cards_compute_and_memory_on_dra_pools():
    _, templates = applied(pod(container(limits={"nano-gpu/gpu-percent": "25"})), DraConfig(card_memory_mib=(32768,)))
    ((name, claim),) = templates.items()
    assert name.startswith("qgpu-pct25-s") and name.endswith("-c250")  # compute asked: no memory-only config
    assert only_request(claim)["firstAvailable"][0]["capacity"] == {"requests": {"core": "250", "memory": "8192"}}
    assert "config" not in claim["devices"]
    with pytest.raises(DraRefusal, match="nano-gpu/gpu-percent: 25 % of a card's memory needs the card sizes"):
        convert(pod(container(limits={"nano-gpu/gpu-percent": "25"})))


@pytest.mark.parametrize(("limits", "name", "memory_only"), [
    ({"elasticgpu.io/gpu-core": "20", "elasticgpu.io/gpu-memory": "2"}, "qgpu-c200-m2048-x1", False),
    ({"nano-gpu.io/gpu-core": "20", "nano-gpu.io/gpu-memory": "1"}, "qgpu-c200-m1024-x1", False),
    ({"elasticgpu.io/gpu-memory": "2"}, "qgpu-c10-m2048-x1-mo", True),
    ({"elasticgpu.io/gpu-core": "100"}, "qgpu-whole-x1", False),
])
def test_elastic_gpu_core_and_memory_become_claims_as_qgpus_do(limits, name, memory_only):
    out, templates = applied(pod(container(limits=limits)))
    assert list(templates) == [name]
    assert not any(k.startswith(("elasticgpu.io/", "nano-gpu.io/")) for k in
                   (out["spec"]["containers"][0].get("resources") or {}).get("limits") or {})
    config = templates[name]["devices"].get("config")
    assert (config is not None) is memory_only


def test_t9k_percent_asks_the_first_card_size_that_fits_with_that_share_of_its_memory():
    config = DraConfig(card_memory_mib=(32768, 15360))
    _, templates = applied(pod(container(limits={"tensorstack.dev/nvidia-gpu-percent": "25"})), config)
    (name,) = templates
    assert name.startswith("qgpu-pct25-s")
    subs = only_request(templates[name])["firstAvailable"]
    assert [s["name"] for s in subs] == ["mib15360", "mib32768"]
    assert subs[0]["selectors"] == [{"cel": {"expression": 'device.attributes["gpu.qgpu.io"].memoryMiB == 15360'}}]
    assert subs[0]["capacity"] == {"requests": {"core": "10", "memory": "4096"}}  # 3840 MiB → whole GiB
    assert subs[1]["capacity"] == {"requests": {"core": "10", "memory": "8192"}}


def test_t9k_percent_of_a_whole_card_stays_within_its_whole_gib():
    _, templates = applied(pod(container(limits={"tensorstack.dev/nvidia-gpu-percent": "100"})), DraConfig(card_memory_mib=(16160,)))
    (spec,) = templates.values()
    assert only_request(spec)["firstAvailable"][0]["capacity"]["requests"]["memory"] == "15360"


def test_t9k_percent_without_card_sizes_is_refused_naming_the_slices_and_the_flag():
    with pytest.raises(DraRefusal, match="--dra-card-memory-mib"):
        convert(pod(container(limits={"tensorstack.dev/nvidia-gpu-percent": "25"})))


def test_nvidia_gpu_stays_for_the_whole_card_class_to_map_and_is_completed():
    out, templates = applied(pod(container(limits={"nvidia.com/gpu": "1"})))
    assert templates == {}
    assert "resourceClaims" not in out["spec"]
    assert out["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}}


def test_nvidia_gpu_goes_to_dra_pools_only_where_its_claim_is_made_and_charged():
    """Issue F2: on a device-plugin node, which advertises nvidia.com/gpu, kube-scheduler makes no
    claim for it, and the pod quota leaves nvidia.com/gpu of a DRA namespace to that claim: the
    cards were charged nowhere. The pod is pinned to the DRA pools instead."""
    out, _ = applied(pod(container(limits={"nvidia.com/gpu": "8"})))
    assert out["spec"]["nodeSelector"] == {"qgpu.io/pool-mode": "dra"}
    out, _ = applied(pod(container(limits={"nvidia.com/gpu": "1"}), container("s", limits={QGPU_CORE: "30", QGPU_MEMORY: "4"}),
                         nodeSelector={"zone": "a", "qgpu.io/pool-mode": "dra"}))
    assert out["spec"]["nodeSelector"] == {"zone": "a", "qgpu.io/pool-mode": "dra"}
    out, _ = applied(pod(container(limits={"nvidia.com/gpu": "1"}), nodeSelector={"zone": "a"}))
    assert out["spec"]["nodeSelector"] == {"zone": "a", "qgpu.io/pool-mode": "dra"}
    for limits in ({"nvidia.com/gpu": "0"}, {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"}, {QGPU_CORE: "30", QGPU_MEMORY: "4"}):
        out, _ = applied(pod(container(limits=limits)))  # no GPU, or a claim of qgpu's own classes: nothing to pin
        assert "qgpu.io/pool-mode" not in (out["spec"].get("nodeSelector") or {}), limits
    assert "dra" in names.POOL_MODES


def test_nvidia_gpu_selecting_a_device_plugin_pool_is_refused_naming_the_opt_out():
    asked = pod(container(limits={"nvidia.com/gpu": "1"}), nodeSelector={"qgpu.io/pool-mode": "device-plugin"})
    with pytest.raises(DraRefusal) as refused:
        convert(asked)
    assert str(refused.value) == (
        "container 'c': nvidia.com/gpu with spec.nodeSelector qgpu.io/pool-mode=device-plugin: in a namespace labelled "
        "qgpu.io/gpu-mode=dra, nvidia.com/gpu is served by DRA pools (qgpu.io/pool-mode=dra); annotate the pod "
        "qgpu.io/gpu-mode: device-plugin to keep it for a device plugin")
    denied = mutate_dra(review(asked), WebhookConfig("qgpu-scheduler"), DraConfig(), forbid_templates)["response"]
    assert (denied["allowed"], denied["status"]["code"], denied["status"]["message"]) == (False, 422, f"qgpu: {refused.value}")
    kept = copy.deepcopy(asked)
    kept["metadata"]["annotations"] = {"qgpu.io/gpu-mode": "device-plugin"}
    assert mutate_dra(review(kept), WebhookConfig("qgpu-scheduler"), DraConfig(), forbid_templates)["response"]["allowed"] is True


def test_gpu_free_pod_is_unchanged():
    conversion = convert(pod(container(limits={"cpu": "1"})))
    assert conversion.templates == () and conversion.patch == []


# --- several containers and shapes --------------------------------------------------------------

def test_each_container_gets_its_claim_and_equal_shapes_share_one_template():
    same = {QGPU_CORE: "30", QGPU_MEMORY: "4"}
    out, templates = applied(pod(container("a", limits=dict(same)), container("b", limits={"cpu": "1"}), container("c", limits=dict(same)),
                                 container("d", limits={QGPU_CORE: "50", QGPU_MEMORY: "2"})))
    assert sorted(templates) == ["qgpu-c300-m4096-x1", "qgpu-c500-m2048-x1"]
    assert out["spec"]["resourceClaims"] == [{"name": "qgpu-0", "resourceClaimTemplateName": "qgpu-c300-m4096-x1"},
                                             {"name": "qgpu-2", "resourceClaimTemplateName": "qgpu-c300-m4096-x1"},
                                             {"name": "qgpu-3", "resourceClaimTemplateName": "qgpu-c500-m2048-x1"}]
    assert "claims" not in out["spec"]["containers"][1]["resources"]


def test_existing_claims_are_kept():
    c = container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4"})
    c["resources"]["claims"] = [{"name": "nic"}]
    out, _ = applied(pod(c, resourceClaims=[{"name": "nic", "resourceClaimName": "my-nic"}]))
    assert [r["name"] for r in out["spec"]["resourceClaims"]] == ["nic", "qgpu-0"]
    assert out["spec"]["containers"][0]["resources"]["claims"] == [{"name": "nic"}, {"name": "qgpu-0"}]


def test_a_claim_name_already_taken_is_refused():
    with pytest.raises(DraRefusal, match="qgpu-0"):
        convert(pod(container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4"}), resourceClaims=[{"name": "qgpu-0", "resourceClaimName": "x"}]))


# --- constraints: models, online/offline --------------------------------------------------------

def test_gpu_models_become_a_cel_selector_on_the_model_attribute():
    _, templates = applied(pod(container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4"}), annotations={"qgpu.io/gpu-model": "V100|Tesla T4"}))
    (name,) = templates
    assert name.startswith("qgpu-c300-m4096-x1-g")
    assert only_request(templates[name])["exactly"]["selectors"] == [
        {"cel": {"expression": 'device.attributes["gpu.qgpu.io"].model in ["Tesla T4", "V100"]'}}]


def test_model_names_are_escaped_as_cel_strings():
    assert dra.model_selector(['a"b\\c']) == 'device.attributes["gpu.qgpu.io"].model in ["a\\"b\\\\c"]'


def test_model_lists_at_their_bound_give_selectors_within_the_apiservers_cel_limit():
    """Each name of qgpu.io/gpu-model, use-gputype and nouse-gputype goes into a CEL expression, which
    the apiserver refuses past 10 KiB (resource.k8s.io CELSelectorExpressionMaxLength): at the
    parser's bound (16 names of 96 characters in each), every expression fits."""
    longest = [f"NVIDIA {i:02d}" + "X" * 87 for i in range(MAX_MODEL_NAMES)]
    assert {len(n) for n in longest} == {MAX_MODEL_NAME_CHARS}
    notes = {"qgpu.io/gpu-model": "|".join(longest), "nvidia.com/use-gputype": ",".join(longest),
             "nvidia.com/nouse-gputype": ",".join(n.replace("NVIDIA", "TESLA") for n in longest)}
    _, templates = applied(pod(container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4"}), annotations=notes))
    selectors = only_request(next(iter(templates.values())))["exactly"]["selectors"]
    assert len(selectors) == 2 and all(len(s["cel"]["expression"].encode()) <= 10 * 1024 for s in selectors)


def test_different_models_give_different_templates():
    one = convert(pod(container(limits={"tensorstack.dev/nvidia-gpu": "1"}), annotations={"qgpu.io/gpu-model": "V100"}))
    two = convert(pod(container(limits={"tensorstack.dev/nvidia-gpu": "1"}), annotations={"qgpu.io/gpu-model": "T4"}))
    assert one.templates[0].name != two.templates[0].name


def test_models_select_within_every_card_size_of_a_percent_request():
    _, templates = applied(pod(container(limits={"tensorstack.dev/nvidia-gpu-percent": "50"}), annotations={"qgpu.io/gpu-model": "T4"}),
                           DraConfig(card_memory_mib=(15360,)))
    (spec,) = templates.values()
    (sub,) = only_request(spec)["firstAvailable"]
    assert len(sub["selectors"]) == 2 and "exactly" not in only_request(spec)


def test_online_pod_carries_its_class_in_the_opaque_config_and_goes_to_mixed_nodes():
    out, templates = applied(pod(container(limits={QGPU_MEMORY: "4"}), annotations={APP_CLASS: "online"}))
    spec = templates["qgpu-c10-m4096-x1-online"]
    assert only_request(spec)["exactly"]["capacity"] == {"requests": {"core": "10", "memory": "4096"}}
    assert spec["devices"]["config"] == [{"requests": ["gpu"], "opaque": {"driver": "gpu.qgpu.io", "parameters": {
        "apiVersion": "gpu.qgpu.io/v1alpha1", "kind": "ShareConfig", "appClass": "online", "greedy": False}}}]
    assert out["spec"]["nodeSelector"] == {"mixed-qgpu-enable": "enable"}


def test_offline_pod_is_greedy_with_its_core_as_the_share():
    out, templates = applied(pod(container(limits={QGPU_GREEDY: "40", QGPU_MEMORY: "2"}), annotations={APP_CLASS: "offline"},
                                 nodeSelector={"zone": "a"}))
    spec = templates["qgpu-c400-m2048-x1-offline"]
    assert spec["devices"]["config"][0]["opaque"]["parameters"]["greedy"] is True
    assert draclaim.read_share_config(spec["devices"]["config"][0]["opaque"]["parameters"]) == ("offline", True)
    assert out["spec"]["nodeSelector"] == {"zone": "a", "mixed-qgpu-enable": "enable"}
    assert out["spec"]["containers"][0]["resources"]["limits"] == {}


def test_normal_pods_carry_no_config():
    _, templates = applied(pod(container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4"})))
    assert "config" not in templates["qgpu-c300-m4096-x1"]["devices"]


def test_template_names_are_dns_subdomains():
    for limits, notes in [({QGPU_CORE: "30", QGPU_MEMORY: "4"}, {"qgpu.io/gpu-model": "Tesla V100-SXM2-32GB"}),
                                ({QGPU_MEMORY: "4"}, {APP_CLASS: "online"}), ({"tensorstack.dev/nvidia-gpu-node": "1"}, None)]:
        for t in convert(pod(container(limits=limits), annotations=notes)).templates:
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", t.name) and len(t.name) <= 63, t.name


# --- refusals: the parser's words ---------------------------------------------------------------

@pytest.mark.parametrize("limits, annotations", [
    ({QGPU_CORE: "150", QGPU_MEMORY: "4"}, None),
    ({"tencent.com/vcuda-memory": "4"}, None),
    ({"tensorstack.dev/nvidia-gpu": "1", "tensorstack.dev/nvidia-gpu-percent": "50"}, None),
    ({QGPU_CORE: "30", QGPU_MEMORY: "4"}, {APP_CLASS: "online"}),
    ({"tke.cloud.tencent.com/qgpu-cores": "30"}, None),
    ({"nvidia.com/gpu": "500m"}, None),
    ({QGPU_CORE: "30", QGPU_MEMORY: "4"}, {"qgpu.io/gpu-model": "|".join(map(str, range(1000)))}),
    ({"nvidia.com/gpu": "1"}, {"nvidia.com/nouse-gputype": "T4," + "X" * 97}),
])
def test_invalid_requests_are_refused_with_the_parsers_message(limits, annotations):
    p = pod(container(limits=limits), annotations=annotations)
    with pytest.raises(RequestError) as device_plugin_mode:
        parse_pod(p)
    answer = mutate_dra(review(p), WebhookConfig(), DraConfig(), forbid_templates)
    assert answer["response"]["allowed"] is False and answer["response"]["status"]["code"] == 422
    assert answer["response"]["status"]["message"] == f"qgpu: {device_plugin_mode.value}"


# --- the AdmissionReview --------------------------------------------------------------------------

def review(p: dict, operation: str = "CREATE", dry_run: bool | None = None) -> bytes:
    request = {"uid": "r-1", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": operation, "namespace": "ns", "object": p}
    if dry_run is not None:
        request["dryRun"] = dry_run
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def forbid_templates(namespace: str, templates) -> None:
    raise AssertionError("no template may be written here")


def patch_of(answer: dict) -> list:
    response = answer["response"]
    return json.loads(base64.b64decode(response["patch"])) if "patch" in response else []


class Recorder:
    def __init__(self, error: str | None = None):
        self.calls: list[tuple[str, tuple[ClaimTemplate, ...]]] = []
        self.error = error

    def __call__(self, namespace, templates) -> None:
        self.calls.append((namespace, tuple(templates)))
        if self.error:
            raise TemplateError(self.error)


def test_create_ensures_the_templates_before_admitting_with_the_patch():
    ensure = Recorder()
    p = pod(container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4"}))
    answer = mutate_dra(review(p), WebhookConfig(scheduler_name="qgpu-scheduler"), DraConfig(), ensure)
    assert answer["response"]["allowed"] is True
    assert [(ns, [t.name for t in ts]) for ns, ts in ensure.calls] == [("ns", ["qgpu-c300-m4096-x1"])]
    ops = patch_of(answer)
    assert ops == convert(p).patch
    assert not any(op["path"] == "/spec/schedulerName" for op in ops)  # DRA pods are kube-scheduler's own


def test_dry_run_writes_no_template_but_answers_the_same_patch():
    p = pod(container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4"}))
    answer = mutate_dra(review(p, dry_run=True), WebhookConfig(), DraConfig(), forbid_templates)
    assert answer["response"]["allowed"] is True and patch_of(answer) == convert(p).patch


def test_an_apiserver_refusal_denies_the_pod_with_its_reason():
    ensure = Recorder("ResourceClaimTemplate ns/qgpu-c300-m4096-x1: the apiserver refused to create it: 403 Forbidden: no")
    answer = mutate_dra(review(pod(container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4"}))), WebhookConfig(), DraConfig(), ensure)
    assert answer["response"]["allowed"] is False
    assert answer["response"]["status"]["code"] == 500
    assert "403 Forbidden" in answer["response"]["status"]["message"]


def test_device_plugin_pods_and_updates_get_the_classic_mutation():
    config = WebhookConfig(scheduler_name="qgpu-scheduler")
    kept = pod(container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4"}), annotations={"qgpu.io/gpu-mode": "device-plugin"})
    assert mutate_dra(review(kept), config, DraConfig(), forbid_templates) == mutate(review(kept), config)
    update = pod(container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4"}))
    assert mutate_dra(review(update, operation="UPDATE"), config, DraConfig(), forbid_templates) == mutate(review(update, operation="UPDATE"), config)


def test_a_pod_without_gpus_writes_nothing():
    answer = mutate_dra(review(pod(container(limits={"cpu": "1"}))), WebhookConfig(), DraConfig(), forbid_templates)
    assert answer["response"] == {"uid": "r-1", "allowed": True}


def test_card_sizes_are_checked():
    with pytest.raises(ValueError, match="integer >= 1024"):
        DraConfig(card_memory_mib=(512,))
    with pytest.raises(ValueError, match="at most 8"):
        DraConfig(card_memory_mib=tuple(range(2048, 2048 + 9)))


def test_a_stored_template_matches_what_qgpu_writes_despite_defaults_and_canonical_quantities():
    from qgpu_runtime.webhook.templates import _contains

    wanted = convert(pod(container(limits={QGPU_GREEDY: "100", QGPU_MEMORY: "8"}), annotations={APP_CLASS: "offline"})).templates[0].claim_spec
    stored = copy.deepcopy(wanted)
    stored["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["core"] = "1k"
    stored["devices"]["requests"][0]["exactly"]["tolerations"] = []  # a field the apiserver may default
    assert _contains(stored, wanted)
    stored["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] = "4096"
    assert not _contains(stored, wanted)


# --- malformed bodies: a 400 naming the field, never an exception ----------------------------------

FUZZ_POD = {
    "metadata": {"name": "p", "namespace": "ns", "annotations": {"qgpu.io/gpu-model": "T4"}},
    "spec": {"containers": [{"name": "c", "resources": {"limits": {QGPU_CORE: "40", QGPU_MEMORY: "4"}, "claims": [{"name": "nic"}]}},
                            {"name": "w", "resources": {"limits": {"tensorstack.dev/nvidia-gpu": "2"}}},
                            {"name": "n", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
             "resourceClaims": [{"name": "nic", "resourceClaimName": "n"}], "nodeSelector": {"zone": "a"},
             "tolerations": [{"key": "k", "operator": "Exists"}]},
}
DRA_ROUTES = cli.routes(WebhookConfig("qgpu-scheduler"), (DraConfig(card_memory_mib=(15360,)), Recorder()))


def dra_answer(doc: object) -> tuple[int, object]:
    status, body = DRA_ROUTES.post["/mutate-dra"]("", json.dumps(doc).encode())
    if status != 200:
        assert status == 400 and body["error"], body
    return status, body


@pytest.mark.parametrize("spec, field", [
    ({"resourceClaims": 5}, "AdmissionReview.request.object.spec.resourceClaims=5"),
    ({"nodeSelector": {"a": 1}}, "AdmissionReview.request.object.spec.nodeSelector="),
    ({"containers": [{"name": "c", "resources": {"limits": {QGPU_CORE: "30", QGPU_MEMORY: "4"}, "claims": "x"}}]},
     "AdmissionReview.request.object.spec.containers[0].resources.claims=x"),
])
def test_wrong_typed_claim_fields_are_400_naming_the_field(spec, field):
    p = {"metadata": {"name": "p"}, "spec": {"containers": [container(limits={QGPU_CORE: "30", QGPU_MEMORY: "4"})], **spec}}
    status, body = dra_answer(json.loads(review(p)))
    assert status == 400 and body["error"].startswith(field), body


def test_the_fuzz_pod_converts():
    status, body = dra_answer(json.loads(review(FUZZ_POD)))
    assert status == 200 and body["response"]["allowed"] is True, body


@settings(max_examples=400, deadline=None)
@given(doc=mutations(json.loads(review(FUZZ_POD))))
def test_structure_mutated_reviews_are_converted_or_refused(doc):
    dra_answer(doc)


def test_the_dra_route_exists_only_with_dra():
    assert "/mutate-dra" not in cli.routes(WebhookConfig()).post
    assert "/validate-claim" not in cli.routes(WebhookConfig()).post
    assert DRA_ROUTES.body_limits["/mutate-dra"] == 3 * 1024 * 1024 + 64 * 1024


@pytest.mark.parametrize("argv, message", [
    (["--dra-card-memory-mib", "15360"], "--dra-card-memory-mib: only with --dra"),
    (["--quota-ledger-namespace", "qgpu"], "--quota-ledger-namespace and --claim-reservation-seconds: only with --dra or --pod-quota"),
    (["--pod-quota", "--kubeconfig", "/nonexistent/kubeconfig"], "--pod-quota: --kubeconfig /nonexistent/kubeconfig: "),
    (["--dra", "--claim-reservation-seconds", "0"], "--claim-reservation-seconds 0: must be within 1..3600"),
    (["--dra", "--dra-card-memory-mib", "100"], "--dra-card-memory-mib: card memory sizes .* integer >= 1024"),
    (["--dra", "--kubeconfig", "/nonexistent/kubeconfig"], "--dra: --kubeconfig /nonexistent/kubeconfig: "),
    (["--pod-quota", "--largest-card-memory-mib", "1000"], r"--largest-card-memory-mib 1000: must be within 1024\.\.1048576"),
    (["--largest-card-memory-mib", "0"], r"^qgpu webhook serve: --largest-card-memory-mib 0: must be within 1024\.\.1048576 "
                                         r"\(MiB, a card of 1 GiB to 1 TiB\)$"),
])
def test_bad_dra_flags_are_refused_before_serving(argv, message):
    from qgpu_runtime.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["webhook", "serve", "--tls-cert-file", "a", "--tls-private-key-file", "b", "--client-ca-file", "ca.crt", *argv])


@pytest.mark.parametrize("argv, largest", [([], 80 * 1024), (["--largest-card-memory-mib", "143771"], 143771),
                                           (["--largest-card-memory-mib", "16384"], 80 * 1024)])
def test_the_largest_card_flag_reaches_the_parsers_limits_with_or_without_the_quota(monkeypatch, argv, largest):
    """--largest-card-memory-mib raises what /validate and /mutate admit, not only the quota's
    charge: an H200's 100 GiB pod is parsed as the extender and the node will parse it."""
    from qgpu_runtime.cli import main

    seen: list[WebhookConfig] = []

    def routes(config, *rest, **kw):
        seen.append(config)
        raise SystemExit("routes built")

    monkeypatch.setattr(cli, "routes", routes)
    with pytest.raises(SystemExit, match="routes built"):
        main(["webhook", "serve", "--tls-cert-file", "a", "--tls-private-key-file", "b", "--client-ca-file", "ca.crt", *argv])
    (config,) = seen
    assert config.limits.max_card_memory_mib == largest


def test_with_dra_the_largest_card_reaches_the_conversion_and_the_quota(monkeypatch, tmp_path):
    from qgpu_runtime.cli import main

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n")
    seen: list[tuple[Any, ...]] = []

    def routes(*built, **kw):
        seen.append(built)
        raise SystemExit("routes built")

    monkeypatch.setattr(cli, "routes", routes)
    with pytest.raises(SystemExit, match="routes built"):
        main(["webhook", "serve", "--tls-cert-file", "a", "--tls-private-key-file", "b", "--client-ca-file", "ca.crt",
              "--dra", "--pod-quota", "--kubeconfig", str(kubeconfig), "--largest-card-memory-mib", "143771"])
    ((config, (dra_config, _), claim_quota, *_),) = seen
    assert config.limits == dra_config.limits == claim_quota.limits
    assert claim_quota.limits.max_card_memory_mib == 143771
    assert claim_quota.default_memory_mib == 143771  # the quota's charge of a whole card, as before
