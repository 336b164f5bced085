"""Trace variants built from the bundled trace, the way the FGD study builds its own.

The study's ``gpuspec`` variants give a share of the GPU pods a GPU-model requirement (about a
third of the GPU pods of its production cluster name the model they need). The bundled default
trace names none, so :func:`with_gpu_spec` derives such a variant: a seeded draw picks
``fraction`` of the GPU pods, and each picked pod is given one model, drawn in proportion to the
GPUs of that model on nodes that could ever hold the pod (enough cards, CPU and memory). Drawing
by capacity keeps every model's constrained demand in line with its size, so no model is starved
or flooded by construction; drawing among the nodes that fit keeps every constrained pod
placeable on an empty cluster, as every pod of the original trace is.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Sequence

from qgpu_runtime.placement.state import NodeSpec
from qgpu_runtime.sim.trace import TracePod


class VariantError(ValueError):
    """A variant that cannot be built as asked (the message names the option and the rule)."""


def with_gpu_spec(pods: Sequence[TracePod], nodes: Sequence[NodeSpec], fraction: float, seed: int, draw: str = "uniform") -> list[TracePod]:
    """``pods`` with ``fraction`` of the GPU pods (those without a model requirement) constrained
    to one GPU model. Deterministic for a given seed; pods that already name models keep them."""
    if not 0.0 <= fraction <= 1.0:
        raise VariantError(f"--gpu-spec-fraction: {fraction} must be between 0 and 1")
    rng = random.Random(seed)
    candidates = [i for i, p in enumerate(pods) if p.num_gpu and p.models is None]
    picked = set(rng.sample(candidates, round(fraction * len(candidates))))
    # (model, cards, cpu, memory) per node, and the GPUs of each model, for the draws below.
    kinds = [(n.cards[0].model, len(n.cards), n.cpu_milli, n.memory_mib) for n in nodes if n.cards]
    out: list[TracePod] = []
    for i, pod in enumerate(pods):
        if i not in picked:
            out.append(pod)
            continue
        weight: dict[str, int] = {}
        for model, cards, cpu, mem in kinds:
            if cards >= pod.num_gpu and cpu >= pod.cpu_milli and mem >= pod.memory_mib:
                weight[model] = weight.get(model, 0) + cards
        if not weight:  # no node can ever hold it: leave it unconstrained, it fails either way
            out.append(pod)
            continue
        models = sorted(weight)
        choice = rng.choices(models, weights=[weight[m] for m in models])[0] if draw == "capacity" else rng.choice(models)
        out.append(replace(pod, models=frozenset({choice})))
    return out
