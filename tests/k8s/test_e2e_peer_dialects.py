"""Issue 22 §1 and §3 through the real kube-apiserver, `qgpu webhook serve` and the real
kube-scheduler calling the extender: a chart's CPU-only variant (zero GPUs) is admitted and
scheduled with no record; HAMi's documented pods and KAI-Scheduler's annotated pods are admitted,
completed by the webhook and placed with the share their dialect promises; so are nano-gpu's
and elastic GPU's.

The corpus is written from the peers' documented fields (HAMi v2.10.0: nvidia.com/gpu with
gpumem, gpumem-percentage, gpucores and the use-gputype annotation; KAI-Scheduler v0.17:
gpu-fraction, gpu-memory, gpu-fraction-num-devices, gpu-fraction-container-name with
schedulerName kai-scheduler)."""

from __future__ import annotations

import json
import time
from typing import Iterator

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from qgpu_runtime.contract.dra import WHOLE_CLASS, device_classes
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.node.nodeinfo import share_size_capacity
from tests.k8s.kubeobjects import MANAGED_RESOURCES, bound, cards, gpu_node, gpu_pod, read_pod, record
from tests.k8s.test_e2e_webhook import webhook as hooked  # noqa: F401  (that module's webhook, as a fixture here)

# The tests take ``hooked`` (the namespace the webhook serves) as a fixture argument: F811 below.

SCHEDULERS = ("default-scheduler", "qgpu-scheduler", "kai-scheduler")


@pytest.fixture(scope="module")
def schedulers(cluster, tmp_path_factory) -> Iterator[None]:
    """kube-scheduler with a profile for each name these pods use (the webhook sets qgpu-scheduler;
    KAI's pods keep kai-scheduler, which the kube_scheduler_extender role serves), all calling the extender."""
    config = {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
              "clientConnection": {"kubeconfig": str(cluster.cp.scheduler_kubeconfig), "qps": 1000, "burst": 2000},
              "leaderElection": {"leaderElect": False},
              "profiles": [{"schedulerName": name} for name in SCHEDULERS],
              "extenders": [cluster.extender.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s")]}
    path = tmp_path_factory.mktemp("peer-sched") / "scheduler-config.yaml"
    path.write_text(yaml.safe_dump(config))
    cluster.cp.start_scheduler_from_file(path)
    try:
        yield
    finally:
        cluster.cp.start_scheduler(cluster.scheduler_extenders())


@pytest.fixture()
def whole_class(cluster) -> Iterator[client.ResourceV1Api]:
    """qgpu's whole-card DeviceClass, which maps nvidia.com/gpu to DRA (KEP-5004), as a DRA pool's
    roles leave it; restored afterwards to what it was (absent or present)."""
    resource = client.ResourceV1Api(cluster.api.api_client)
    existed = any(c.metadata.name == WHOLE_CLASS for c in resource.list_device_class().items)
    if not existed:
        resource.create_device_class(next(d for d in device_classes() if d["metadata"]["name"] == WHOLE_CLASS))
    yield resource
    if not existed:
        resource.delete_device_class(WHOLE_CLASS)


@pytest.fixture()
def no_whole_class(cluster) -> Iterator[None]:
    """A cluster of device-plugin pools only: no DeviceClass maps nvidia.com/gpu (another module of
    this session may have left qgpu's whole-card class behind; it is put back afterwards)."""
    resource = client.ResourceV1Api(cluster.api.api_client)
    removed = [d for d in device_classes() if d["metadata"]["name"] == WHOLE_CLASS
               and any(c.metadata.name == WHOLE_CLASS for c in resource.list_device_class().items)]
    if removed:
        resource.delete_device_class(WHOLE_CLASS)
    if removed:
        time.sleep(2)  # kube-scheduler's informer must have seen the deletion before the pods arrive
    yield
    for doc in removed:
        resource.create_device_class(doc)


def refused(cluster, ns: str, pod: dict) -> str:
    """The apiserver's refusal of ``pod`` (retried until the webhook configuration is active)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            cluster.api.create_namespaced_pod(ns, pod)
        except ApiException as exc:
            assert exc.status == 422, exc.body
            return json.loads(exc.body)["message"]
        cluster.api.delete_namespaced_pod(pod["metadata"]["name"], ns, grace_period_seconds=0)
        assert time.monotonic() < deadline, "webhook never became active"
        time.sleep(0.5)


def gpu_plugin_node(cluster, name: str, inventory: list, label: dict) -> None:
    """A fake node whose kubelet advertises nvidia.com/gpu as qgpu's device plugin does (one device
    per GiB of each card), with HAMi's share sizes in its capacity as qgpu's manager publishes them
    (node/nodeinfo.py): kube-scheduler then fits it by capacity even where a DeviceClass maps
    nvidia.com/gpu to DRA (KEP-5004; another module of this session leaves one behind)."""
    count = str(sum(c.memory_mib // 1024 for c in inventory))
    sizes = share_size_capacity([CardInfo(c.index, c.uuid, c.model, c.memory_mib, c.index) for c in inventory])
    gpu_node(cluster.api, name, inventory, label, extended={"nvidia.com/gpu": count, **sizes})


def shares(pod: dict) -> list[tuple[str, str | None, int, int, int]]:
    rec = record(pod)
    assert rec is not None, pod["metadata"]
    return [(c.name, c.dialect.dialect if c.dialect else None, s.index, s.core_milli, s.memory_mib)
            for c in rec.containers for s in c.shares]


def test_a_charts_cpu_only_variant_with_zero_gpus_is_admitted_and_scheduled_without_a_record(cluster, hooked, schedulers, label):  # noqa: F811
    refused(cluster, hooked, gpu_pod("sentinel", {"nvidia.com/gpu": "-1"}))  # the webhook is active from here on
    gpu_node(cluster.api, f"{hooked}-cpu", cards(1, node=f"{hooked}-cpu"), label)
    zeros = {"nvidia": {"nvidia.com/gpu": "0"}, "vcuda": {"tencent.com/vcuda-core": "0"},
             "t9k": {"tensorstack.dev/nvidia-gpu": "0"}, "qgpu": {"tke.cloud.tencent.com/qgpu-core": "0"},
             "hami": {"nvidia.com/gpu": "0", "nvidia.com/gpumem": "3000"}}
    for name, limits in zeros.items():
        cluster.api.create_namespaced_pod(hooked, gpu_pod(f"zero-{name}", limits, selector=label))
    for name in zeros:
        pod = bound(cluster.api, hooked, f"zero-{name}")
        assert pod["spec"]["nodeName"] == f"{hooked}-cpu"
        assert pod["spec"]["schedulerName"] == "default-scheduler"  # a CPU pod is not handed to qgpu's scheduler
        assert record(pod) is None, name


def test_hamis_documented_pods_get_their_vgpus(cluster, hooked, schedulers, label, no_whole_class):  # noqa: F811
    refused(cluster, hooked, gpu_pod("sentinel-h", {"nvidia.com/gpu": "-1"}))
    a100, t4 = f"{hooked}-a100", f"{hooked}-t4"
    gpu_plugin_node(cluster, a100, cards(4, model="NVIDIA A100-SXM4-40GB", memory_mib=40960, node=a100), label)
    gpu_plugin_node(cluster, t4, cards(1, model="Tesla T4", memory_mib=15360, node=t4), label)
    corpus = {
        "vgpu": ({"nvidia.com/gpu": 2, "nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 30}, {}),
        "percent": ({"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 50}, {"nvidia.com/nouse-gputype": "t4"}),
        "memonly": ({"nvidia.com/gpumem": 1024}, {"nvidia.com/use-gputype": "T4"}),
        "whole": ({"nvidia.com/gpu": 1}, {"nvidia.com/nouse-gputype": "T4"}),
    }
    for name, (limits, notes) in corpus.items():
        cluster.api.create_namespaced_pod(hooked, gpu_pod(name, limits, selector=label, annotations=notes))
    vgpu = shares(bound(cluster.api, hooked, "vgpu"))
    assert [(d, core, mem) for _, d, _, core, mem in vgpu] == [("hami", 300, 3000)] * 2
    assert len({index for _, _, index, _, _ in vgpu}) == 2  # each vGPU on its own card
    assert [(d, core, mem) for _, d, _, core, mem in shares(bound(cluster.api, hooked, "percent"))] == [("hami", 0, 20480)]
    memonly = bound(cluster.api, hooked, "memonly")
    assert memonly["spec"]["nodeName"] == t4 and [(core, mem) for *_, core, mem in shares(memonly)] == [(0, 1024)]
    # HAMi's defaultGPUNum written as HAMi's webhook writes it: the kubelet asks the device plugin for that card
    assert memonly["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    whole = bound(cluster.api, hooked, "whole")
    assert whole["spec"]["nodeName"] == a100 and [(d, core) for _, d, _, core, _ in shares(whole)] == [("nvidia", 1000)]
    message = refused(cluster, hooked, gpu_pod("both", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000, "nvidia.com/gpumem-percentage": 50}))
    assert "give one of nvidia.com/gpumem (MiB) or nvidia.com/gpumem-percentage (%), not both" in message


def test_nano_gpu_and_elastic_gpu_documented_pods_get_their_share(cluster, hooked, schedulers, label):  # noqa: F811
    """nano-gpu's README pods (gpu-percent; gpu-core with gpu-memory) and elastic GPU's names, as
    their users write them: admitted, placed through the extender with the share the names promise
    and the record's dialect; a shared core without memory refused by name."""
    refused(cluster, hooked, gpu_pod("sentinel-n", {"nvidia.com/gpu": "-1"}))
    node = f"{hooked}-nano"
    gpu_node(cluster.api, node, cards(2, memory_mib=32768, node=node), label)
    corpus = {"percent": {"nano-gpu/gpu-percent": 20}, "nanocore": {"nano-gpu.io/gpu-core": 20, "nano-gpu.io/gpu-memory": 1},
              "egpu": {"elasticgpu.io/gpu-core": 50, "elasticgpu.io/gpu-memory": 4}, "memonly": {"elasticgpu.io/gpu-memory": 2},
              "whole": {"elasticgpu.io/gpu-core": 100}}
    for name, limits in corpus.items():
        cluster.api.create_namespaced_pod(hooked, gpu_pod(f"n-{name}", limits, selector=label))
    got = {name: [(d, core, mem) for _, d, _, core, mem in shares(bound(cluster.api, hooked, f"n-{name}"))] for name in corpus}
    assert got == {"percent": [("elasticgpu", 200, 6554)], "nanocore": [("elasticgpu", 200, 1024)],
                   "egpu": [("elasticgpu", 500, 4096)], "memonly": [("elasticgpu", 0, 2048)],
                   "whole": [("elasticgpu", 1000, 32768)]}
    message = refused(cluster, hooked, gpu_pod("n-nomem", {"elasticgpu.io/gpu-core": 20}))
    assert "elasticgpu.io/gpu-memory=missing: a shared elasticgpu.io/gpu-core (below 100) needs elasticgpu.io/gpu-memory" in message


def test_kai_schedulers_annotated_pods_get_their_fraction_on_the_named_container(cluster, hooked, schedulers, label):  # noqa: F811
    refused(cluster, hooked, gpu_pod("sentinel-k", {"nvidia.com/gpu": "-1"}))
    node = f"{hooked}-kai"
    gpu_plugin_node(cluster, node, cards(2, memory_mib=32768, node=node), label)
    cluster.api.create_namespaced_pod(hooked, gpu_pod(
        "fraction", {}, selector=label, containers=2, scheduler_name="kai-scheduler",
        annotations={"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2", "gpu-fraction-container-name": "c1"}))
    cluster.api.create_namespaced_pod(hooked, gpu_pod("memory", {}, selector=label, scheduler_name="kai-scheduler",
                                                       annotations={"gpu-memory": "2000"}))
    created = read_pod(cluster.api, hooked, "fraction")
    assert created["spec"]["containers"][1]["resources"]["limits"] == {"nvidia.com/gpu": "2"}  # the webhook's count
    assert created["spec"]["containers"][0]["resources"].get("limits") in (None, {})
    fraction = shares(bound(cluster.api, hooked, "fraction"))
    assert [(c, d, core, mem) for c, d, _, core, mem in fraction] == [("c1", "kai", 0, 16384)] * 2
    assert len({index for _, _, index, _, _ in fraction}) == 2
    assert [(c, d, mem) for c, d, _, _, mem in shares(bound(cluster.api, hooked, "memory"))] == [("c0", "kai", 2000)]
    message = refused(cluster, hooked, gpu_pod("whole", {}, scheduler_name="kai-scheduler", annotations={"gpu-fraction": "1.5"}))
    assert "annotation gpu-fraction=1.5: out of range" in message


def test_hamis_vgpu_pod_beside_a_dra_pool_whose_class_maps_nvidia_gpu(cluster, hooked, schedulers, label, whole_class):  # noqa: F811
    """Where a DeviceClass maps nvidia.com/gpu to DRA (KEP-5004), kube-scheduler's DynamicResources
    plugin looks for a class of every extended resource a node lacks: HAMi's gpumem stayed Pending
    ("cannot fit resource") until qgpu's device-plugin nodes published HAMi's share sizes as capacity."""
    refused(cluster, hooked, gpu_pod("sentinel-d", {"nvidia.com/gpu": "-1"}))
    node = f"{hooked}-mixed"
    gpu_plugin_node(cluster, node, cards(2, model="NVIDIA A100-SXM4-40GB", memory_mib=40960, node=node), label)
    cluster.api.create_namespaced_pod(hooked, gpu_pod("vgpu-mixed", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000},
                                                      selector=label))
    assert bound(cluster.api, hooked, "vgpu-mixed", timeout=30)["spec"]["nodeName"] == node
