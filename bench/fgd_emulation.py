"""An emulation of the FGD study's scheduler on qgpu's replay, with or without knowing the workload
in advance (issue 27: is frag's distance to the study's published medians the policy's, or the
emulation's and the mixes'?).

The emulation is FGD's measure on qgpu's placement engine: shapes weighed by pod count, every shape
(coverage 1.0), no stranding, tie or model-pressure terms —
``FragPolicy(WorkloadShapes(coverage=1.0, max_shapes=512, weigh="pods"), tie_weight=0,
cpu_balance=0, model_pressure=False)``. Online (the default), the shapes are learned from the pods
seen so far, as qgpu's frag learns them. With ``--foreknowledge`` they are counted once from every
pod of the replayed list (the drawn mix included) before the replay and then frozen: the study's
simulator builds its typical pods from all workload pods before it schedules any.

Run (one JSON line per seed; docs/benchmarks.md has the figures):

    .venv/bin/python bench/fgd_emulation.py [--foreknowledge] [--multi-card-fraction F --variant-seed D] --seeds 42,43
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.trace_input import add_trace_arguments, load_trace  # noqa: E402
from qgpu_runtime.model.requests import PodRequest  # noqa: E402
from qgpu_runtime.placement.policies import FragPolicy, WorkloadShapes  # noqa: E402
from qgpu_runtime.sim.replay import ReplayOptions, replay_arrivals  # noqa: E402
from qgpu_runtime.sim.trace import TracePod  # noqa: E402


class FrozenShapes(WorkloadShapes):
    """Workload shapes that stop counting once ``frozen`` is set."""

    frozen: bool = False

    def observe(self, req: PodRequest) -> None:
        if not self.frozen:
            super().observe(req)


def fgd_shapes(pods: Sequence[TracePod] | None, gpu_memory_mib: int) -> WorkloadShapes:
    """FGD's measure's shapes: learned online (``pods`` None), or counted from ``pods`` and frozen."""
    if pods is None:
        return WorkloadShapes(coverage=1.0, max_shapes=512, weigh="pods")
    shapes = FrozenShapes(coverage=1.0, max_shapes=512, weigh="pods")
    for p in pods:
        shapes.observe(p.request(gpu_memory_mib))
    shapes.frozen = True
    return shapes


def fgd_policy(shapes: WorkloadShapes) -> FragPolicy:
    return FragPolicy(shapes, tie_weight=0, cpu_balance=0, model_pressure=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_arguments(parser, sharing=False)
    parser.add_argument("--seeds", default="42", help="comma-separated replay seeds")
    parser.add_argument("--foreknowledge", action="store_true", help="count every pod's shape before the replay")
    args = parser.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: must be comma-separated integers")
    nodes, pods = load_trace(parser, args)
    options = ReplayOptions()
    for seed in seeds:
        started = time.perf_counter()
        result = replay_arrivals(nodes, pods, "fgd", seed, options,
                                 policy_factory=lambda: fgd_policy(fgd_shapes(pods if args.foreknowledge else None,
                                                                              options.gpu_memory_mib)))
        print(json.dumps({"foreknowledge": args.foreknowledge, "multi_card_fraction": args.multi_card_fraction,
                          "variant_seed": args.variant_seed, "seed": seed,
                          "unallocated_pct": {str(a): round(result.unallocated_at(a), 2) for a in (100, 110, 130)},
                          "failed_pods": result.failed_pods, "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
