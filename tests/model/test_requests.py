"""Every rule of the request model, pinned with its exact message."""

from __future__ import annotations

import pytest

from qgpu_runtime.contract.inventory import MAX_ID_CHARS
from qgpu_runtime.model import AppClass, CardLimits, Dialect, RequestError, parse_pod
from qgpu_runtime.model.quantity import GRAMMAR
from qgpu_runtime.model.requests import DEFAULT_LIMITS, MAX_MODEL_NAME_CHARS, MAX_MODEL_NAMES, pod_compute

CORE = "tke.cloud.tencent.com/qgpu-core"
MEM = "tke.cloud.tencent.com/qgpu-memory"
GREEDY = "tke.cloud.tencent.com/qgpu-core-greedy"
CLASS = "tke.cloud.tencent.com/app-class"


def pod(limits=None, requests=None, annotations=None, name="main", extra_containers=()):
    resources = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    return {
        "metadata": {"name": "p", "namespace": "ns", "annotations": annotations or {}},
        "spec": {"containers": [{"name": name, "resources": resources}, *extra_containers]},
    }


def errors(p, limits=DEFAULT_LIMITS):
    with pytest.raises(RequestError) as info:
        parse_pod(p, limits)
    return [str(x) for x in info.value.problems]


# -- qGPU ---------------------------------------------------------------------------------------

def test_qgpu_share_below_100_is_one_shared_card():
    (c,) = parse_pod(pod({CORE: "30", MEM: "5"})).containers
    assert (c.dialect, c.cards, c.core_milli, c.memory_mib, c.exclusive) == (Dialect.QGPU, 1, 300, 5120, False)


def test_qgpu_multiple_of_100_is_whole_exclusive_cards():
    (c,) = parse_pod(pod({CORE: "200"})).containers
    assert (c.cards, c.core_milli, c.exclusive) == (2, 1000, True)


def test_qgpu_core_above_100_not_multiple_is_rejected():
    assert errors(pod({CORE: "150", MEM: "5"})) == [
        "container 'main': tke.cloud.tencent.com/qgpu-core=150: 100 or more must be a multiple of 100 (whole cards)"
    ]


def test_qgpu_memory_fraction_is_rejected():
    assert errors(pod({CORE: "30", MEM: "1.5"})) == [
        "container 'main': tke.cloud.tencent.com/qgpu-memory=1.5: fractions are not allowed; qgpu-memory is whole GiB, an integer >= 1"
    ]


@pytest.mark.parametrize("value,rule", [
    ("0", "must be positive"),
    ("-3", "must be positive"),
    ("abc", f"not a quantity: {GRAMMAR}"),
])
def test_qgpu_core_zero_negative_and_non_numeric_are_rejected(value, rule):
    assert errors(pod({CORE: value, MEM: "2"})) == [
        f"container 'main': tke.cloud.tencent.com/qgpu-core={value}: {rule}; qgpu-core is percent of one card: 1-99, or a multiple of 100"
    ]


def test_qgpu_requests_must_equal_limits():
    assert errors(pod({CORE: "30", MEM: "5"}, {CORE: "20", MEM: "5"})) == [
        "container 'main': tke.cloud.tencent.com/qgpu-core=requests 20 / limits 30: requests must equal limits for GPU resources"
    ]


def test_qgpu_limits_alone_are_fine_and_requests_alone_too():
    assert parse_pod(pod({CORE: "30", MEM: "5"})).containers[0].core_milli == 300
    assert parse_pod(pod(None, {CORE: "30", MEM: "5"})).containers[0].core_milli == 300


def test_unknown_qgpu_resource_is_rejected():
    assert errors(pod({CORE: "30", MEM: "5", "tke.cloud.tencent.com/qgpu-cores": "1"})) == [
        "container 'main': tke.cloud.tencent.com/qgpu-cores=1: unknown qGPU resource; known: "
        "tke.cloud.tencent.com/qgpu-core, tke.cloud.tencent.com/qgpu-core-greedy, tke.cloud.tencent.com/qgpu-memory"
    ]


def test_shared_qgpu_core_needs_memory():
    assert errors(pod({CORE: "30"})) == [
        "container 'main': tke.cloud.tencent.com/qgpu-memory=missing: a shared qgpu-core (below 100) needs tke.cloud.tencent.com/qgpu-memory"
    ]


def test_memory_larger_than_any_card_is_rejected():
    assert errors(pod({CORE: "30", MEM: "100"})) == [
        "container 'main': tke.cloud.tencent.com/qgpu-memory=100: no card could ever hold it: the largest card has 80 GiB"
    ]


H200_MIB = 143771  # an H200's memory as nvidia-smi reports it


@pytest.mark.parametrize("limits", [{CORE: "30", MEM: "100"}, {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "120000"}])
def test_a_request_above_80_gib_per_card_is_admitted_once_the_largest_card_is_raised(limits):
    """H200 nodes: 100 GiB (qGPU) or 120000 MiB (HAMi) per card fits no card of the default's 80 GiB,
    and fits once the operator names the largest card (--largest-card-memory-mib 143771)."""
    from qgpu_runtime.contract.largestcard import card_limits

    assert "no card could ever hold it" in errors(pod(limits))[0]
    (c,) = parse_pod(pod(limits), card_limits(H200_MIB)).containers
    assert c.memory_mib in (100 * 1024, 120000) and c.cards == 1
    assert "the largest card has 143771 MiB" in errors(pod({CORE: "30", MEM: "141"}), card_limits(H200_MIB))[0]


def test_more_cards_than_any_node_is_rejected():
    assert errors(pod({CORE: "1600"})) == [
        "container 'main': tke.cloud.tencent.com/qgpu-core=1600: no node could ever hold it: at most 8 cards per node"
    ]


def test_online_pod_requests_memory_only():
    req = parse_pod(pod({MEM: "4"}, annotations={CLASS: "online"}))
    assert req.klass is AppClass.ONLINE
    assert (req.containers[0].core_milli, req.containers[0].memory_mib) == (0, 4096)


def test_online_pod_asking_for_core_is_rejected():
    assert errors(pod({CORE: "30", MEM: "4"}, annotations={CLASS: "online"})) == [
        "container 'main': tke.cloud.tencent.com/qgpu-core=30: online pods request memory only (tke.cloud.tencent.com/qgpu-memory)"
    ]


def test_offline_pod_uses_core_greedy_on_one_card():
    req = parse_pod(pod({GREEDY: "80", MEM: "4"}, annotations={CLASS: "offline"}))
    assert req.klass is AppClass.OFFLINE
    assert (req.containers[0].cards, req.containers[0].core_milli) == (1, 800)


def test_offline_pod_spanning_cards_is_rejected():
    assert errors(pod({GREEDY: "200", MEM: "4"}, annotations={CLASS: "offline"})) == [
        "container 'main': tke.cloud.tencent.com/qgpu-core-greedy=200: offline pods may not span cards: at most 100 (one card)"
    ]


def test_offline_pod_with_plain_core_is_rejected():
    assert errors(pod({CORE: "50", MEM: "4"}, annotations={CLASS: "offline"})) == [
        "container 'main': tke.cloud.tencent.com/qgpu-core=50: offline pods request tke.cloud.tencent.com/qgpu-core-greedy, not qgpu-core"
    ]


def test_core_greedy_without_offline_class_is_rejected():
    assert errors(pod({GREEDY: "50", MEM: "4"})) == [
        "container 'main': tke.cloud.tencent.com/qgpu-core-greedy=50: only offline pods (annotation tke.cloud.tencent.com/app-class: offline) may request it"
    ]


def test_bad_app_class_is_rejected():
    assert errors(pod({CORE: "30", MEM: "4"}, annotations={CLASS: "batch"})) == [
        "pod: annotation tke.cloud.tencent.com/app-class=batch: must be online or offline (omit it for normal pods)"
    ]


def test_min_memory_per_shared_pod_is_configurable():
    limits = CardLimits(min_shared_memory_mib=2048)
    assert errors(pod({CORE: "30", MEM: "1"}), limits) == [
        "container 'main': tke.cloud.tencent.com/qgpu-memory=1: a shared card needs at least 2048 MiB per container"
    ]


def test_pod_count_limit_follows_card_memory():
    limits = CardLimits()
    assert limits.shared_pods_per_card(32 * 1024) == 8
    assert limits.shared_pods_per_card(16 * 1024) == 4
    assert CardLimits(gib_per_shared_pod=2).shared_pods_per_card(16 * 1024) == 8


def test_card_limits_reject_nonsense():
    with pytest.raises(ValueError, match=r"CardLimits.gib_per_shared_pod: 0 is not allowed: must be an integer >= 1"):
        CardLimits(gib_per_shared_pod=0)


# -- TKEStack -----------------------------------------------------------------------------------

def test_vcuda_share_and_memory_units():
    (c,) = parse_pod(pod({"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "8"})).containers
    assert (c.dialect, c.cards, c.core_milli, c.memory_mib) == (Dialect.VCUDA, 1, 500, 2048)


def test_vcuda_whole_cards():
    (c,) = parse_pod(pod({"tencent.com/vcuda-core": "300"})).containers
    assert (c.cards, c.exclusive) == (3, True)


def test_vcuda_not_multiple_of_100_is_rejected():
    assert errors(pod({"tencent.com/vcuda-core": "120", "tencent.com/vcuda-memory": "8"})) == [
        "container 'main': tencent.com/vcuda-core=120: 100 or more must be a multiple of 100 (whole cards)"
    ]


def test_vcuda_share_needs_memory():
    assert errors(pod({"tencent.com/vcuda-core": "20"})) == [
        "container 'main': tencent.com/vcuda-memory=missing: a shared vcuda-core (below 100) needs tencent.com/vcuda-memory"
    ]


# -- T9k ----------------------------------------------------------------------------------------

def test_t9k_whole_cards_need_xgn_nodes():
    req = parse_pod(pod({"tensorstack.dev/nvidia-gpu": "2"}))
    assert req.alloc_mode == "xgn"
    assert (req.containers[0].cards, req.containers[0].exclusive) == (2, True)


def test_t9k_whole_node_needs_an_xgn_node():
    req = parse_pod(pod({"tensorstack.dev/nvidia-gpu-node": "1"}))
    assert req.alloc_mode == "xgn"
    assert req.containers[0].whole_node


def test_t9k_percent_is_memory_share_on_sgn_nodes():
    req = parse_pod(pod({"tensorstack.dev/nvidia-gpu-percent": "25"}))
    assert req.alloc_mode == "sgn"
    assert (req.containers[0].memory_pct, req.containers[0].core_milli) == (25, 0)


def test_t9k_percent_above_100_is_rejected():
    assert errors(pod({"tensorstack.dev/nvidia-gpu-percent": "120"})) == [
        "container 'main': tensorstack.dev/nvidia-gpu-percent=120: percent of one card's memory: at most 100"
    ]


def test_t9k_whole_node_must_be_one():
    assert errors(pod({"tensorstack.dev/nvidia-gpu-node": "2"})) == [
        "container 'main': tensorstack.dev/nvidia-gpu-node=2: nvidia-gpu-node must be 1 (the whole node)"
    ]


def test_t9k_whole_node_at_most_one_container():
    second = {"name": "side", "resources": {"limits": {"tensorstack.dev/nvidia-gpu-node": "1"}}}
    assert errors(pod({"tensorstack.dev/nvidia-gpu-node": "1"}, extra_containers=[second])) == [
        "container 'side': tensorstack.dev/nvidia-gpu-node=1: at most one container per pod may ask for the whole node (also asked by 'main')"
    ]


# -- NVIDIA and mixing --------------------------------------------------------------------------

def test_nvidia_gpu_whole_cards():
    (c,) = parse_pod(pod({"nvidia.com/gpu": 2})).containers
    assert (c.dialect, c.cards, c.exclusive) == (Dialect.NVIDIA, 2, True)


def test_nvidia_gpu_fraction_is_rejected():
    assert errors(pod({"nvidia.com/gpu": "500m"})) == [
        "container 'main': nvidia.com/gpu=500m: fractions are not allowed; nvidia.com/gpu counts whole cards"
    ]


def test_mixed_dialects_in_one_container_are_rejected():
    assert errors(pod({CORE: "30", MEM: "2", "nvidia.com/gpu": "1"})) == [
        "container 'main': nvidia.com/gpu,tke.cloud.tencent.com/qgpu-core,tke.cloud.tencent.com/qgpu-memory=mixed: "
        "one container may use one dialect only, found nvidia, qgpu"
    ]


def test_all_problems_of_a_pod_are_reported_together():
    second = {"name": "b", "resources": {"limits": {"nvidia.com/gpu": "-1"}}}
    assert len(errors(pod({CORE: "150", MEM: "2"}, extra_containers=[second]))) == 2


def test_pod_without_gpu_requests_parses_to_nothing():
    req = parse_pod(pod({"cpu": "2", "memory": "1Gi"}))
    assert not req.wants_gpu
    assert (req.cpu_milli, req.memory_mib) == (2000, 1024)


@pytest.mark.parametrize("p", [
    pod({"cpu": "2", "memory": "1Gi"}),
    pod({CORE: "30", MEM: "5"}, requests={"cpu": "500m", "memory": "3Gi"}),
    pod({"nvidia.com/gpu": "1", "cpu": "1"}, extra_containers=[{"name": "side", "resources": {"requests": {"cpu": "250m"}}}]),
    pod({CORE: "30", MEM: "5", "memory": "bogus"}),
    {"metadata": {"name": "p"}, "spec": {}},
], ids=["plain", "requests-over-limits", "two-containers", "bad-memory", "no-containers"])
def test_pod_compute_counts_cpu_and_memory_as_parse_pod_does(p):
    request = parse_pod(p)
    assert pod_compute(p) == (request.cpu_milli, request.memory_mib)


def _with_spec(**spec):
    return {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "main", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}], **spec}}


def _ctr(name, cpu, memory, **extra):
    return {"name": name, "resources": {"requests": {"cpu": cpu, "memory": memory}}, **extra}


@pytest.mark.parametrize(("spec", "want"), [
    ({}, (1000, 1024)),
    # pod-level resources stand for the containers' (Kubernetes 1.32+)
    ({"resources": {"requests": {"cpu": "32", "memory": "128Gi"}}}, (32000, 131072)),
    # only limits at pod level: the apiserver copies them into requests
    ({"resources": {"limits": {"cpu": "4"}}}, (4000, 1024)),
    # a regular init container larger than the containers runs alone before them
    ({"initContainers": [_ctr("init", "16", "2Gi")]}, (16000, 2048)),
    # a sidecar runs beside the containers: added to them
    ({"initContainers": [_ctr("proxy", "500m", "256Mi", restartPolicy="Always")]}, (1500, 1280)),
    # an init container after a sidecar runs beside that sidecar
    ({"initContainers": [_ctr("proxy", "2", "256Mi", restartPolicy="Always"), _ctr("init", "3", "512Mi")]}, (5000, 1280)),
    ({"overhead": {"cpu": "250m", "memory": "120Mi"}}, (1250, 1144)),
], ids=["containers", "pod-level", "pod-level-limits", "init-larger", "sidecar", "init-after-sidecar", "overhead"])
def test_pod_compute_counts_what_kube_scheduler_counts(spec, want):
    """Before, only the containers were summed: 32 CPUs asked at pod level or in an init container
    counted as none in the extender's node fit."""
    p = _with_spec(**spec)
    assert pod_compute(p) == want
    assert (parse_pod(p).cpu_milli, parse_pod(p).memory_mib) == want


def test_pod_compute_counts_a_pod_whose_gpu_request_does_not_parse():
    """The extender's cache counts the CPU and memory of a pod that books cards without parsing its
    GPU request again (nor under its own card limits)."""
    p = pod({CORE: "150", MEM: "2", "cpu": "3", "memory": "2Gi"})
    errors(p)
    assert pod_compute(p) == (3000, 2048)


def test_gpu_model_annotation_constrains_models():
    req = parse_pod(pod({"nvidia.com/gpu": "1"}, annotations={"qgpu.io/gpu-model": "V100|T4"}))
    assert req.models == frozenset({"V100", "T4"})


# -- GPU model names: bounded, since every component keeps what the parser returns ---------------

MODEL_LISTS = [("qgpu.io/gpu-model", "|"), ("nvidia.com/use-gputype", ","), ("nvidia.com/nouse-gputype", ",")]


def test_a_gpu_model_annotation_of_a_thousand_names_is_refused_naming_the_annotation_the_value_cut_and_the_rule():
    """Before, any number of names parsed: 255 KiB of them (``0|1|2|…``) became a frozenset of
    tens of thousands of strings that the extender kept per pod version (extender/memo.py)."""
    names = "|".join(str(i) for i in range(1000))
    assert errors(pod({"nvidia.com/gpu": "1"}, annotations={"qgpu.io/gpu-model": names})) == [
        "pod: annotation qgpu.io/gpu-model=0|1|2|3|4|5|6|7|8|9|10|11|12|13|14|15|16... (3889 characters): "
        "lists 1000 GPU model names, at most 16 are allowed (a cluster has few models; leave the annotation out "
        "to take any card)"]


@pytest.mark.parametrize("key,separator", MODEL_LISTS)
def test_every_model_list_takes_16_names_of_96_characters_and_refuses_one_more_or_one_longer(key, separator):
    assert (MAX_MODEL_NAMES, MAX_MODEL_NAME_CHARS) == (16, 96)
    longest = [f"{i:02d}" + "X" * 94 for i in range(16)]
    request = parse_pod(pod({"nvidia.com/gpu": "1"}, annotations={key: f" {separator} ".join(longest) + separator}))
    patterns = request.model_patterns
    assert len(request.models or patterns.use or patterns.nouse) == 16
    (problem,) = errors(pod({"nvidia.com/gpu": "1"}, annotations={key: separator.join([*longest, "T4"])}))
    assert problem.startswith(f"pod: annotation {key}=00XXXXXXXX") and problem.endswith(
        "lists 17 GPU model names, at most 16 are allowed (a cluster has few models; leave the annotation out to take any card)")
    too_long = "NVIDIA " + "A" * 90  # 97 characters
    (problem,) = errors(pod({"nvidia.com/gpu": "1"}, annotations={key: separator.join(["T4", too_long])}))
    assert problem == (f"pod: annotation {key}=T4{separator}NVIDIA AAAAAAAAAAAAAAAAAAAAAAAAAAAAAA... (100 characters): "
                       "the GPU model name starting 'NVIDIA AAAAAAAAAAAAAAAAAAAAAAAAA' has 97 characters, "
                       "at most 96 are allowed (no card's name is longer)")


def test_blank_entries_count_for_nothing_and_a_gpu_less_pod_is_held_to_the_same_bound():
    """Blanks between separators are no names (as HAMi reads its lists); the bound is on the
    annotation, whatever the pod asks, since the extender parses GPU-less pods too."""
    assert parse_pod(pod({"cpu": "1"}, annotations={"qgpu.io/gpu-model": "V100||" + "|" * 500 + "T4"})).models == {"V100", "T4"}
    hami = {"nvidia.com/use-gputype": ",".join(f"M{i}" for i in range(17)), "nvidia.com/nouse-gputype": "T4"}
    assert [p.split("=")[0] for p in errors(pod({"cpu": "1"}, annotations=hami))] == ["pod: annotation nvidia.com/use-gputype"]


def test_the_name_bound_is_the_longest_model_a_node_inventory_may_publish():
    """A name longer than any card's can match none, exactly or as a substring."""
    assert MAX_MODEL_NAME_CHARS == MAX_ID_CHARS
