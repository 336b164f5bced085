"""Trace variants built from the bundled trace, the way the FGD study builds its own.

The study's ``gpuspec`` variant gives the pods of its trace the GPU-model requirements that the
GPU pods of its production cluster carry: 33.8 % of them name the models they may run on, and
which models depends on the kind of pod (sharing pods ask for T4 or P100, whole-card pods for T4,
G2, the V100s and G3, most of them one model, some a list). The bundled default trace names no
models, so :func:`with_gpu_spec` derives that variant: per kind of GPU pod (sharing one card, one
whole card, several cards) it picks the same share of pods as the study's variant constrains and
gives each picked pod a requirement drawn from the same kind's requirements in that variant.

:data:`PRODUCTION_SPECS` holds those requirements with their counts: facts of the published trace
(counted from the study's ``openb_pod_list_gpuspec33.csv``, 7,064 GPU pods), not something fitted
here. ``fraction`` scales the share of constrained pods (the study also replays 10/20/25 %).
A drawn requirement that no node can ever meet for that pod (too few cards, CPU or memory on
every node of those models) is drawn again, so the variant constrains pods without making any
impossible; a pod no requirement suits stays unconstrained.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Sequence

from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD
from qgpu_runtime.placement.state import NodeSpec
from qgpu_runtime.sim.trace import TracePod

# Kind of GPU pod -> (GPU pods of that kind in the study's variant, {requirement: pods}).
PRODUCTION_SPECS: dict[str, tuple[int, dict[str, int]]] = {
    "sharing": (3078, {"T4": 593, "P100": 278, "G2|P100|T4|V100M16|V100M32": 13}),
    "whole": (3911, {
        "T4": 698, "G2": 321, "V100M16|V100M32": 137, "P100|V100M16|V100M32": 102, "G3": 80,
        "P100|T4|V100M16|V100M32": 33, "G2|P100|T4|V100M16|V100M32": 26, "A10|G2|T4|V100M16|V100M32": 24,
        "V100M32": 18, "A10|T4": 6, "P100|V100M16": 4, "V100M16": 3, "P100": 1, "T4|V100M16|V100M32": 1,
        "A10|G2|P100|T4|V100M16|V100M32": 3,
    }),
    "multi": (75, {"G2": 10, "G3": 6, "V100M16|V100M32": 7, "V100M32": 2, "T4|V100M16|V100M32": 2,
                   "P100|V100M16|V100M32": 1}),
}
# The share of GPU pods the study's variant constrains: 2,388 of 7,064.
PRODUCTION_FRACTION = 2388 / 7064
_REDRAWS = 20


class VariantError(ValueError):
    """A variant that cannot be built as asked (the message names the option and the rule)."""


def pod_kind(pod: TracePod) -> str | None:
    if not pod.num_gpu:
        return None
    if pod.num_gpu > 1:
        return "multi"
    return "sharing" if pod.gpu_milli < CORE_MILLI_PER_CARD else "whole"


def with_gpu_spec(pods: Sequence[TracePod], nodes: Sequence[NodeSpec], fraction: float = PRODUCTION_FRACTION,
                  seed: int = 0) -> list[TracePod]:
    """``pods`` with about ``fraction`` of the GPU pods given GPU-model requirements as the
    study's production cluster has them. Deterministic for a seed; pods that already name models
    keep them."""
    if not 0.0 <= fraction <= 1.0:
        raise VariantError(f"--gpu-spec-fraction: {fraction} must be between 0 and 1")
    scale = fraction / PRODUCTION_FRACTION
    rng = random.Random(seed)
    hosts = [(frozenset(c.model for c in n.cards), len(n.cards), n.cpu_milli, n.memory_mib) for n in nodes if n.cards]
    out: list[TracePod] = []
    for pod in pods:
        kind = pod_kind(pod)
        if kind is None or pod.models is not None:
            out.append(pod)
            continue
        total, specs = PRODUCTION_SPECS[kind]
        constrained = sum(specs.values())
        if rng.random() >= min(1.0, scale * constrained / total):
            out.append(pod)
            continue
        names = sorted(specs)
        weights = [specs[s] for s in names]
        chosen = None
        for _ in range(_REDRAWS):
            models = frozenset(rng.choices(names, weights=weights)[0].split("|"))
            if any(carried & models and cards >= pod.num_gpu and cpu >= pod.cpu_milli and mem >= pod.memory_mib
                   for carried, cards, cpu, mem in hosts):
                chosen = models
                break
        out.append(replace(pod, models=chosen) if chosen else pod)
    return out


# The workload-mix variants: the FGD study's other pod lists are "sampled from the default one,
# emphasizing certain types of workloads" (multi-GPU tasks, GPU-sharing tasks). The flag of each
# kind of emphasis, for messages.
MIX_FLAGS = {"multi": "--multi-card-fraction", "sharing": "--sharing-fraction"}


def demand_share(pods: Sequence[TracePod], kind: str) -> float:
    """The share of the pods' GPU demand (thousandths of a card) that pods of ``kind`` ask for."""
    total = sum(p.gpu_request_milli for p in pods)
    return sum(p.gpu_request_milli for p in pods if pod_kind(p) == kind) / total if total else 0.0


def _draw(group: list[TracePod], count: int, rng: random.Random, tag: str) -> list[TracePod]:
    """``count`` pods of ``group``: a sample without replacement when the group has that many,
    else every pod of it plus copies drawn uniformly with replacement (renamed, so names stay
    unique: ``<name>-<tag><k>``)."""
    if count <= len(group):
        return rng.sample(group, count)
    extra = rng.choices(group, k=count - len(group))
    return list(group) + [replace(p, name=f"{p.name}-{tag}{k}") for k, p in enumerate(extra)]


def with_demand_share(pods: Sequence[TracePod], kind: str, fraction: float, seed: int = 0) -> list[TracePod]:
    """A workload mix drawn from ``pods`` in which pods of ``kind`` (``multi``: several whole cards;
    ``sharing``: a share of one card) ask for about ``fraction`` of the GPU demand.

    The CPU-only pods stay as they are and the number of GPU pods stays the same; only which GPU
    pods make up that number changes. With n GPU pods, m_k the mean demand of a pod of ``kind`` and
    m_o that of the other GPU pods, k = f·n·m_o / (m_k·(1 − f) + f·m_o) pods of ``kind`` (rounded)
    and n − k others make the expected share f. Each side is a sample without replacement of the
    trace's pods of that side when it has enough of them, else all of them plus uniform draws with
    replacement. Deterministic for a seed; the order of the result does not matter (the replay
    sorts by name and shuffles)."""
    flag = MIX_FLAGS[kind]
    if not 0.0 <= fraction <= 1.0:
        raise VariantError(f"{flag}: {fraction} must be between 0 and 1 (a share of the GPU demand)")
    gpu = sorted((p for p in pods if p.num_gpu), key=lambda p: p.name)
    mine = [p for p in gpu if pod_kind(p) == kind]
    others = [p for p in gpu if pod_kind(p) != kind]
    if fraction > 0 and not mine:
        raise VariantError(f"{flag}: {fraction} asks for {kind} pods, but the trace has none to draw from")
    if fraction < 1 and not others:
        raise VariantError(f"{flag}: {fraction} asks for other GPU pods, but the trace has only {kind} pods")
    n = len(gpu)
    m_k = sum(p.gpu_request_milli for p in mine) / len(mine) if mine else 0.0
    m_o = sum(p.gpu_request_milli for p in others) / len(others) if others else 0.0
    k = n if fraction >= 1 else (0 if fraction <= 0 else round(fraction * n * m_o / (m_k * (1 - fraction) + fraction * m_o)))
    rng = random.Random(seed)
    drawn = _draw(mine, k, rng, "m") + _draw(others, n - k, rng, "o")
    return [p for p in pods if not p.num_gpu] + drawn
