"""Issue 22 §1 and §3: zero means no GPU from that dialect; HAMi's and KAI-Scheduler's dialects,
each rule, default and error pinned (HAMi v2.10.0's pkg/device/nvidia and its default config)."""

from __future__ import annotations

import pytest

from qgpu_runtime.model import Dialect, RequestError, parse_pod
from qgpu_runtime.model.requests import ModelPatterns

GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
PCT = "nvidia.com/gpumem-percentage"
CORES = "nvidia.com/gpucores"


def pod(limits=None, annotations=None, scheduler=None, containers=None, init=None):
    spec = {"containers": containers or [{"name": "main", "resources": {"limits": limits or {}}}]}
    if scheduler:
        spec["schedulerName"] = scheduler
    if init:
        spec["initContainers"] = init
    return {"metadata": {"name": "p", "namespace": "ns", "annotations": annotations or {}}, "spec": spec}


def errors(p):
    with pytest.raises(RequestError) as info:
        parse_pod(p)
    return [str(x) for x in info.value.problems]


def shape(c):
    return (c.dialect, c.cards, c.core_milli, c.memory_mib, c.memory_pct, c.exclusive)


# -- zero means no GPU ---------------------------------------------------------------------------

@pytest.mark.parametrize("limits", [
    {GPU: "0"}, {GPU: 0}, {"tencent.com/vcuda-core": 0}, {"tensorstack.dev/nvidia-gpu": "0"},
    {"tke.cloud.tencent.com/qgpu-core": "0"}, {"tke.cloud.tencent.com/qgpu-core": "0", "tke.cloud.tencent.com/qgpu-memory": "0"},
    {"tensorstack.dev/nvidia-gpu-percent": "0m"}, {GPU: "0", "tencent.com/vcuda-core": "0"},
    {GPU: "0", MEM: "3000"},  # HAMi: nvidia.com/gpu 0 asks no vGPU, whatever else is named
])
def test_zero_alone_asks_no_gpu(limits):
    request = parse_pod(pod(limits))
    assert not request.wants_gpu


def test_zero_in_an_init_container_is_no_gpu_either():
    init = [{"name": "init", "resources": {"limits": {GPU: "0"}}}]
    assert not parse_pod(pod({}, init=init)).wants_gpu
    init = [{"name": "init", "resources": {"limits": {GPU: "1"}}}]
    assert errors(pod({}, init=init)) == ["container 'init': nvidia.com/gpu=1: init containers may not request shared GPUs"]


def test_a_zero_dialect_beside_another_dialect_leaves_that_dialect_to_ask():
    (c,) = parse_pod(pod({GPU: "0", "tencent.com/vcuda-core": "100"})).containers
    assert shape(c) == (Dialect.VCUDA, 1, 1000, 0, None, True)


@pytest.mark.parametrize("limits,message", [
    ({"tke.cloud.tencent.com/qgpu-core": "0", "tke.cloud.tencent.com/qgpu-memory": "4"},
     "container 'main': tke.cloud.tencent.com/qgpu-core=0: must be positive; qgpu-core is percent of one card: 1-99, or a multiple of 100"),
    ({"tencent.com/vcuda-core": "0", "tencent.com/vcuda-memory": "8"},
     "container 'main': tencent.com/vcuda-core=0: must be positive; vcuda-core is percent of one card: 1-99, or a multiple of 100"),
    ({"tke.cloud.tencent.com/qgpu-core": "100", "tke.cloud.tencent.com/qgpu-memory": "0"},
     "container 'main': tke.cloud.tencent.com/qgpu-memory=0: must be positive; qgpu-memory is whole GiB, an integer >= 1"),
])
def test_a_zero_beside_a_non_zero_of_qgpu_and_vcuda_is_refused_as_before(limits, message):
    assert errors(pod(limits)) == [message]


# -- HAMi ----------------------------------------------------------------------------------------

def test_a_bare_nvidia_gpu_stays_whole_cards():
    (c,) = parse_pod(pod({GPU: "2"})).containers
    assert shape(c) == (Dialect.NVIDIA, 2, 1000, 0, None, True)


@pytest.mark.parametrize("limits,expected", [
    ({GPU: "2", MEM: "3000", CORES: "30"}, (Dialect.HAMI, 2, 300, 3000, None, False)),
    ({GPU: "1", MEM: "3000"}, (Dialect.HAMI, 1, 0, 3000, None, False)),  # defaultCores 0
    ({MEM: "3000"}, (Dialect.HAMI, 1, 0, 3000, None, False)),  # defaultGPUNum 1
    ({GPU: "1", PCT: "50", CORES: "25"}, (Dialect.HAMI, 1, 250, 0, 50, False)),
    ({CORES: "40"}, (Dialect.HAMI, 1, 1000, 0, None, True)),  # defaultMemory 0: the whole memory
    ({GPU: "1", PCT: "100"}, (Dialect.HAMI, 1, 1000, 0, None, True)),
    ({GPU: "1", MEM: "4000", CORES: "100"}, (Dialect.HAMI, 1, 1000, 0, None, True)),  # all compute: whole card
    ({GPU: "1", MEM: "0", PCT: "30"}, (Dialect.HAMI, 1, 0, 0, 30, False)),  # 0 reads as not given
    ({GPU: "3", MEM: "2048", CORES: "0"}, (Dialect.HAMI, 3, 0, 2048, None, False)),
])
def test_hami_vgpus_with_hamis_defaults(limits, expected):
    (c,) = parse_pod(pod(limits)).containers
    assert shape(c) == expected


@pytest.mark.parametrize("limits,message", [
    ({GPU: "1", MEM: "3000", PCT: "50"},
     "container 'main': nvidia.com/gpumem,nvidia.com/gpumem-percentage=3000,50: give one of nvidia.com/gpumem (MiB) "
     "or nvidia.com/gpumem-percentage (%), not both"),
    ({GPU: "1", PCT: "120"},
     "container 'main': nvidia.com/gpumem-percentage=120: at most 100; nvidia.com/gpumem-percentage is percent of one card's memory, 0-100"),
    ({GPU: "1", CORES: "101", MEM: "100"},
     "container 'main': nvidia.com/gpucores=101: at most 100; nvidia.com/gpucores is percent of one card's compute, 0-100"),
    ({GPU: "1", MEM: "-5"},
     "container 'main': nvidia.com/gpumem=-5: must not be negative; nvidia.com/gpumem is MiB of one card's memory, an integer (0: not given)"),
    ({GPU: "1", MEM: "1.5"},
     "container 'main': nvidia.com/gpumem=1.5: fractions are not allowed; nvidia.com/gpumem is MiB of one card's memory, an integer (0: not given)"),
    ({GPU: "1", MEM: "900000"}, "container 'main': nvidia.com/gpumem=900000: no card could ever hold it: the largest card has 81920 MiB"),
    ({GPU: "9", MEM: "1000"}, "container 'main': nvidia.com/gpu=9: no node could ever hold it: at most 8 cards per node"),
    ({MEM: "1000", "tencent.com/vcuda-core": "10"},
     "container 'main': nvidia.com/gpumem,tencent.com/vcuda-core=mixed: one container may use one dialect only, found hami, vcuda"),
])
def test_hami_bad_values_and_combinations_are_refused_by_name(limits, message):
    assert errors(pod(limits)) == [message]


def test_hami_gputype_annotations_are_model_patterns_as_hami_compares_them():
    request = parse_pod(pod({GPU: "1", MEM: "1000"}, {"nvidia.com/use-gputype": "a100, V100", "nvidia.com/nouse-gputype": "v100-pcie"}))
    patterns = request.model_patterns
    assert patterns == ModelPatterns(("A100", "V100"), ("V100-PCIE",))
    assert patterns.accepts("NVIDIA A100-SXM4-80GB") and patterns.accepts("Tesla V100-SXM2-32GB")
    assert not patterns.accepts("Tesla V100-PCIE-16GB") and not patterns.accepts("Tesla T4")
    assert errors(pod({GPU: "1"}, {"nvidia.com/use-gputype": " , "})) == [
        "pod: annotation nvidia.com/use-gputype= , : must list GPU model names separated by ',', e.g. A100,V100"]


# -- KAI-Scheduler / Run:ai ----------------------------------------------------------------------

KAI = "kai-scheduler"


@pytest.mark.parametrize("annotations,expected", [
    ({"gpu-fraction": "0.5"}, ("main", 1, 0, 0, 50)),
    ({"gpu-fraction": "0.25", "gpu-fraction-num-devices": "2"}, ("main", 2, 0, 0, 25)),
    ({"gpu-fraction": "0.333"}, ("main", 1, 0, 0, 34)),  # rounded up to whole percent
    ({"gpu-memory": "2000"}, ("main", 1, 0, 2000, None)),
    ({"gpu-memory": "2000", "gpu-fraction-container-name": "side"}, ("side", 1, 0, 2000, None)),
])
def test_kai_annotations_give_the_named_container_its_share(annotations, expected):
    containers = [{"name": "main"}, {"name": "side"}]
    (c,) = parse_pod(pod(annotations=annotations, scheduler=KAI, containers=containers)).containers
    assert (c.name, c.cards, c.core_milli, c.memory_mib, c.memory_pct) == expected
    assert c.dialect is Dialect.KAI and not c.exclusive


def test_kai_annotations_are_read_only_on_pods_of_kais_scheduler():
    assert not parse_pod(pod(annotations={"gpu-fraction": "0.5"})).wants_gpu


def test_the_webhooks_nvidia_gpu_count_on_the_kai_container_passes():
    containers = [{"name": "main", "resources": {"limits": {GPU: "2"}, "requests": {GPU: "2"}}}]
    (c,) = parse_pod(pod(annotations={"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}, scheduler=KAI,
                         containers=containers)).containers
    assert (c.dialect, c.cards, c.memory_pct) == (Dialect.KAI, 2, 50)


@pytest.mark.parametrize("annotations,limits,message", [
    ({"gpu-fraction": "1"}, {}, "container 'main': annotation gpu-fraction=1: out of range; gpu-fraction is the share of one card's "
     "memory, a decimal above 0 and below 1 (e.g. 0.5); ask nvidia.com/gpu for whole cards"),
    ({"gpu-fraction": "0"}, {}, "container 'main': annotation gpu-fraction=0: out of range; gpu-fraction is the share of one card's "
     "memory, a decimal above 0 and below 1 (e.g. 0.5); ask nvidia.com/gpu for whole cards"),
    ({"gpu-fraction": "half"}, {}, "container 'main': annotation gpu-fraction=half: not a quantity"),
    ({"gpu-fraction": "0.5", "gpu-memory": "100"}, {},
     "pod: annotations gpu-fraction,gpu-memory=0.5,100: give one of gpu-fraction (share of a card) or gpu-memory (MiB), not both"),
    ({"gpu-fraction-num-devices": "2"}, {}, "pod: annotation gpu-fraction-num-devices=2: needs annotation gpu-fraction or gpu-memory"),
    ({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "0"}, {},
     "container 'main': annotation gpu-fraction-num-devices=0: must be positive; gpu-fraction-num-devices counts cards, an integer >= 1"),
    ({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "9"}, {},
     "container 'main': annotation gpu-fraction-num-devices=9: no node could ever hold it: at most 8 cards per node"),
    ({"gpu-memory": "2.5"}, {}, "container 'main': annotation gpu-memory=2.5: fractions are not allowed; gpu-memory is MiB of one card, an integer"),
    ({"gpu-memory": "100000"}, {}, "container 'main': annotation gpu-memory=100000: no card could ever hold it: the largest card has 81920 MiB"),
    ({"gpu-memory": "100", "gpu-fraction-container-name": "nope"}, {},
     "pod: annotation gpu-fraction-container-name=nope: must name one of the pod's containers: 'main'"),
    ({"gpu-fraction": "0.5"}, {GPU: "2"},
     "container 'main': nvidia.com/gpu=2: the container's GPU share comes from annotation gpu-fraction or gpu-memory (KAI-Scheduler); "
     "it may ask no GPU resource itself (nvidia.com/gpu only as 1, the card count)"),
    ({"gpu-fraction": "0.5"}, {MEM: "100"},
     "container 'main': nvidia.com/gpumem=100: the container's GPU share comes from annotation gpu-fraction or gpu-memory (KAI-Scheduler); "
     "it may ask no GPU resource itself (nvidia.com/gpu only as 1, the card count)"),
])
def test_kai_bad_annotations_are_refused_by_name(annotations, limits, message):
    (got,) = errors(pod(limits, annotations=annotations, scheduler=KAI))
    assert got.startswith(message)


# -- nano-gpu and elastic GPU (elastic-ai/elastic-gpu-scheduler, elastic-gpu-agent) ------------------

NANO_PCT = "nano-gpu/gpu-percent"
NANO_CORE = "nano-gpu.io/gpu-core"
NANO_MEM = "nano-gpu.io/gpu-memory"
EGPU_CORE = "elasticgpu.io/gpu-core"
EGPU_MEM = "elasticgpu.io/gpu-memory"
E = Dialect.ELASTIC


@pytest.mark.parametrize("limits,expected", [
    ({NANO_PCT: "20"}, (E, 1, 200, 0, 20, False)),  # nano-gpu's README example: 20 % of one card
    ({NANO_PCT: "100"}, (E, 1, 1000, 0, None, True)),
    ({NANO_CORE: "20", NANO_MEM: "1"}, (E, 1, 200, 1024, None, False)),  # nano-gpu.io's README example
    ({EGPU_CORE: "50", EGPU_MEM: "4"}, (E, 1, 500, 4096, None, False)),
    ({EGPU_CORE: "200"}, (E, 2, 1000, 0, None, True)),  # 100 per card: whole cards
    ({EGPU_MEM: "2"}, (E, 1, 0, 2048, None, False)),  # memory alone: no compute reserved
    ({EGPU_CORE: "0", EGPU_MEM: "2"}, (E, 1, 0, 2048, None, False)),  # a zero beside a non-zero: elastic GPU's rule
])
def test_nano_gpu_and_elastic_gpu_requests(limits, expected):
    (c,) = parse_pod(pod(limits)).containers
    assert shape(c) == expected


@pytest.mark.parametrize("limits", [{NANO_PCT: "0"}, {EGPU_CORE: "0", EGPU_MEM: "0"}, {NANO_MEM: 0}])
def test_nano_gpu_and_elastic_gpu_zero_asks_no_gpu(limits):
    assert parse_pod(pod(limits)).containers == ()


@pytest.mark.parametrize("limits,message", [
    ({NANO_PCT: "120"}, "container 'main': nano-gpu/gpu-percent=120: nano-gpu gives a container one card: at most 100"),
    ({NANO_PCT: "2.5"}, "container 'main': nano-gpu/gpu-percent=2.5: fractions are not allowed; nano-gpu/gpu-percent is "
                        "percent of one card, 1-100"),
    ({NANO_CORE: "20"}, "container 'main': nano-gpu.io/gpu-memory=missing: a shared nano-gpu.io/gpu-core (below 100) needs "
                        "nano-gpu.io/gpu-memory"),
    ({EGPU_CORE: "150", EGPU_MEM: "1"}, "container 'main': elasticgpu.io/gpu-core=150: 100 or more must be a multiple of 100 "
                                        "(whole cards)"),
    ({EGPU_MEM: "1000"}, "container 'main': elasticgpu.io/gpu-memory=1000: no card could ever hold it: the largest card has 80 GiB"),
    ({NANO_PCT: "20", EGPU_CORE: "20", EGPU_MEM: "1"},
     "container 'main': elasticgpu.io/gpu-core,elasticgpu.io/gpu-memory,nano-gpu/gpu-percent=mixed: a container asks in one "
     "of nano-gpu/gpu-percent, nano-gpu.io/gpu-core|gpu-memory or elasticgpu.io/gpu-core|gpu-memory"),
    ({NANO_PCT: "20", "tencent.com/vcuda-core": "10"},
     "container 'main': nano-gpu/gpu-percent,tencent.com/vcuda-core=mixed: one container may use one dialect only, found "
     "elasticgpu, vcuda"),
])
def test_nano_gpu_and_elastic_gpu_bad_values_are_refused_by_name(limits, message):
    assert errors(pod(limits)) == [message]
