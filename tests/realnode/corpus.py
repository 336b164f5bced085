"""The peers' documented example workloads, as data: one pod per example, written from the fields
each peer documents (the seeds' qGPU, gpu-manager and T9k examples; HAMi v2.10.0's; KAI-Scheduler
v0.17's; NVIDIA's device plugin's; a chart's CPU-only variant with zero GPUs;
reference/peer-dialects.md), and the share its container must see.

The same pods run unchanged on the real node of `scripts/local-cluster` in device-plugin mode
(tests/realnode/test_e2e_dialects.py) and in DRA mode (tests/realnode/test_e2e_dra.py). The local
cluster's node has two V100-32G cards (32768 MiB each). nano-gpu's examples are its READMEs' (the
seed's qGPU mixed deployment names nano-gpu / elastic GPU): ``nano-gpu/gpu-percent``, then
``nano-gpu.io/gpu-core`` with ``gpu-memory``, and elastic GPU's ``elasticgpu.io/`` names.

What differs between the two doors, and why, is written per entry: a DRA share's memory is whole
GiB (the ResourceSlice's request policy), so HAMi's 3000 MiB is 3072 MiB there; a T9k percent
claim asks and is booked with the smallest core step, 10 (docs/dra.md), where HAMi's and KAI's
memory-only shares are booked with core 0 as on the device-plugin path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from tests.realnode import kube

ALLOC_MODE = "sched.tensorstack.dev/node-alloc-mode"
CARD_MIB = 32768  # the local cluster's V100-32G
PEER_PREFIXES = ("CUDA_DEVICE_", "GPU_PORTION")  # HAMi's and KAI's own variables
PRINT = ("env | grep -E '^(NVIDIA_VISIBLE_DEVICES|QGPU_|T9K_GPU_|CUDA_DEVICE_|GPU_PORTION)' | sort; "
         "echo '--- end'; exec sleep 3600")


@dataclass(frozen=True)
class Share:
    """What the GPU container must see: ``cards`` distinct cards, each of ``core_milli`` and
    ``memory_mib`` (``dra_memory_mib`` / ``dra_core_milli`` where the DRA door differs), and the
    peer's own variables (``peer_env``: exactly these of HAMi's and KAI's; ``t9k_env``: at least
    these T9K_GPU_*); ``dra_peer_env`` where a value differs on DRA."""

    cards: int
    core_milli: int
    memory_mib: int
    dra_memory_mib: int | None = None
    dra_core_milli: int | None = None
    peer_env: Mapping[str, str] = field(default_factory=dict)
    dra_peer_env: Mapping[str, str] | None = None
    t9k_env: Mapping[str, str] = field(default_factory=dict)

    def core(self, dra: bool) -> int:
        return self.dra_core_milli if dra and self.dra_core_milli is not None else self.core_milli

    def memory(self, dra: bool) -> int:
        return self.dra_memory_mib if dra and self.dra_memory_mib is not None else self.memory_mib

    def peer(self, dra: bool) -> Mapping[str, str]:
        return self.dra_peer_env if dra and self.dra_peer_env is not None else self.peer_env


@dataclass(frozen=True)
class Example:
    """One peer's documented pod: its GPU container is named ``main`` (the one read); ``sidecar``
    adds a first container asking nothing (KAI's container-name example); ``alloc_mode`` is the
    T9k label the node carries while it runs (T9k's whole-card and whole-node modes need xgn);
    ``share`` None: a pod that asks no GPU."""

    id: str
    peer: str
    limits: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    scheduler_name: str | None = None
    sidecar: bool = False
    alloc_mode: str | None = None
    share: Share | None = None

    def pod(self, image: str) -> dict[str, Any]:
        """The pod as the peer's user writes it (nothing qgpu-specific added)."""
        pod = kube.shell_pod(self.id, image, PRINT, limits=self.limits, annotations=self.annotations)
        if self.labels:
            pod["metadata"]["labels"] = dict(self.labels)
        if self.scheduler_name:
            pod["spec"]["schedulerName"] = self.scheduler_name
        if self.sidecar:
            pod["spec"]["containers"].insert(0, {"name": "sidecar", "image": image, "imagePullPolicy": "Never",
                                                 "command": ["sh", "-c", "exec sleep 3600"]})
        return pod


T9K_WRITES = {"scheduler_name": "t9k-scheduler", "labels": {"scheduler.tensorstack.dev/group-name": "demo"}}

CORPUS: tuple[Example, ...] = (
    # A chart's CPU-only variant: every dialect's zero asks no GPU.
    Example("zero-chart", "chart", limits={"nvidia.com/gpu": "0", "tencent.com/vcuda-core": "0",
                                           "tensorstack.dev/nvidia-gpu": "0", "tke.cloud.tencent.com/qgpu-core": "0"}),
    # Seeds: qGPU and gpu-manager (vcuda-memory counts 256 MiB units).
    Example("qgpu", "qgpu", limits={"tke.cloud.tencent.com/qgpu-core": "30", "tke.cloud.tencent.com/qgpu-memory": "2"},
            share=Share(1, 300, 2048)),
    Example("vcuda", "gpu-manager", limits={"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "8"},
            share=Share(1, 500, 2048)),
    # NVIDIA's device plugin: a bare nvidia.com/gpu is a whole card.
    Example("nvidia", "nvidia", limits={"nvidia.com/gpu": "1"}, share=Share(1, 1000, CARD_MIB)),
    # T9k, as its GPU guide writes every pod: t9k-scheduler and a group.
    Example("t9k-percent", "t9k", limits={"tensorstack.dev/nvidia-gpu-percent": "25"}, **T9K_WRITES,  # type: ignore[arg-type]
            share=Share(1, 0, 8192, t9k_env={"T9K_GPU_MODE": "sgn", "T9K_GPU_PERCENT": "25", "T9K_GPU_MEMORY": "8192"})),
    Example("t9k-gpu", "t9k", limits={"tensorstack.dev/nvidia-gpu": "1"}, alloc_mode="xgn", **T9K_WRITES,  # type: ignore[arg-type]
            share=Share(1, 1000, CARD_MIB, t9k_env={"T9K_GPU_MODE": "xgn", "T9K_GPU_COUNT": "1"})),
    Example("t9k-node", "t9k", limits={"tensorstack.dev/nvidia-gpu-node": "1"}, alloc_mode="xgn", **T9K_WRITES,  # type: ignore[arg-type]
            share=Share(2, 1000, CARD_MIB, t9k_env={"T9K_GPU_MODE": "node", "T9K_GPU_COUNT": "2"})),
    # HAMi (README, examples/nvidia/): vGPUs of gpumem MiB and gpucores %, each on its own card.
    Example("hami-vgpu", "hami", limits={"nvidia.com/gpu": "2", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"},
            share=Share(2, 300, 3000, dra_memory_mib=3072,
                        peer_env={"CUDA_DEVICE_MEMORY_LIMIT_0": "3000m", "CUDA_DEVICE_MEMORY_LIMIT_1": "3000m",
                                  "CUDA_DEVICE_SM_LIMIT": "30"},
                        dra_peer_env={"CUDA_DEVICE_MEMORY_LIMIT_0": "3072m", "CUDA_DEVICE_MEMORY_LIMIT_1": "3072m",
                                      "CUDA_DEVICE_SM_LIMIT": "30"})),
    Example("hami-percent", "hami", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50"},
            annotations={"nvidia.com/nouse-gputype": "T4"},
            share=Share(1, 0, 16384, peer_env={"CUDA_DEVICE_MEMORY_LIMIT_0": "16384m", "CUDA_DEVICE_SM_LIMIT": "0"})),
    Example("hami-gputype", "hami", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096"},
            annotations={"nvidia.com/use-gputype": "V100"},
            share=Share(1, 0, 4096, peer_env={"CUDA_DEVICE_MEMORY_LIMIT_0": "4096m", "CUDA_DEVICE_SM_LIMIT": "0"})),
    # nano-gpu (elastic-gpu-scheduler README, both eras) and elastic GPU: percent of a card (compute
    # and memory: 20 % of 32768 MiB is 6554 MiB, 7 GiB on DRA), then core % with memory GiB.
    Example("nano-percent", "nano-gpu", limits={"nano-gpu/gpu-percent": "20"},
            share=Share(1, 200, 6554, dra_memory_mib=7168)),
    Example("nano-core-memory", "nano-gpu", limits={"nano-gpu.io/gpu-core": "20", "nano-gpu.io/gpu-memory": "1"},
            share=Share(1, 200, 1024)),
    Example("elasticgpu-memory", "elastic-gpu", limits={"elasticgpu.io/gpu-memory": "2"}, share=Share(1, 0, 2048)),
    # KAI-Scheduler (docs/gpu-sharing): annotations on a kai-scheduler pod; GPU_PORTION the fraction.
    Example("kai-fraction", "kai", annotations={"gpu-fraction": "0.5"}, scheduler_name="kai-scheduler",
            share=Share(1, 0, 16384, peer_env={"GPU_PORTION": "0.5"})),
    Example("kai-memory", "kai", annotations={"gpu-memory": "2000"}, scheduler_name="kai-scheduler",
            share=Share(1, 0, 2000, dra_memory_mib=2048)),
    Example("kai-multi", "kai", annotations={"gpu-fraction": "0.25", "gpu-fraction-num-devices": "2",
                                             "gpu-fraction-container-name": "main"},
            scheduler_name="kai-scheduler", sidecar=True,
            share=Share(2, 0, 8192, peer_env={"GPU_PORTION": "0.25"})),
)


def read_env(log: str) -> dict[str, str]:
    """The container's printed variables (PRINT), up to its end marker."""
    return dict(line.split("=", 1) for line in log.split("--- end", 1)[0].strip().splitlines())


def check(example: Example, env: Mapping[str, str], dra: bool) -> None:
    """The container saw the share its dialect promises (AssertionError naming the example)."""
    where = f"{example.peer} example {example.id!r} ({'DRA' if dra else 'device-plugin'} mode)"
    share = example.share
    if share is None:
        assert not env, f"{where}: a pod asking no GPU got GPU variables {dict(env)}"
        return
    uuids = env.get("NVIDIA_VISIBLE_DEVICES", "").split(",")
    assert len(set(uuids)) == share.cards and all(u.startswith("GPU-") for u in uuids), f"{where}: {dict(env)}"
    got = (env.get("QGPU_CORE_MILLI"), env.get("QGPU_MEMORY_MIB"))
    want = (",".join([str(share.core(dra))] * share.cards), ",".join([str(share.memory(dra))] * share.cards))
    assert got == want, f"{where}: (QGPU_CORE_MILLI, QGPU_MEMORY_MIB) {got} != {want}"
    peer = {k: v for k, v in env.items() if k.startswith(PEER_PREFIXES)}
    assert peer == dict(share.peer(dra)), f"{where}: HAMi/KAI variables {peer} != {dict(share.peer(dra))}"
    t9k = {k: env.get(k) for k in share.t9k_env}
    assert t9k == dict(share.t9k_env), f"{where}: T9K_GPU_* {t9k} != {dict(share.t9k_env)}"
