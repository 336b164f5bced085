"""Where the unallocated GPU sits when the arrived demand reaches 100 % of capacity, and which pods
failed before (issue 27: what is left for a placement policy to win on a workload mix).

At arrived 100 % the unallocated GPU equals the GPU of the pods that failed; this replays one run as
`qgpu simulate` does and, at the first pod that takes the arrived demand to 100 % or past it,
splits the free GPU by where it is:

- ``whole_cards``: cards nobody uses;
- ``remainder``: partly used cards with exactly the free compute the most common sharing size
  leaves on a card (1000 minus that size, thousandths), which only smaller pods can fill;
- ``partial_1_99``, ``partial_100_499``, ``partial_500_999``: other partly used cards, by free;
- overlapping those, ``cpu_short``: free GPU on nodes with less free CPU than the smallest GPU pod
  seen asked for (no GPU pod can start there), and ``memory_short``: the same by host memory, on
  nodes not already counted as short of CPU; ``beyond_cpu`` and ``beyond_memory``: free GPU beyond
  what the node's free CPU (host memory) feeds at the CPU (memory) per GPU of the pods arrived so
  far, CPU-only pods included (frag's stranding term weighs ``beyond_cpu``).

Failed pods are grouped by shape (cards, thousandths per card, whole CPU cores asked), with their
count, their GPU in % of capacity and the arrived % at which the first of them failed. Figures are
in % of the cluster's GPU capacity.

Run (a table, or one JSON object with ``--json``; docs/benchmarks.md has the figures):

    .venv/bin/python bench/packing_breakdown.py [--multi-card-fraction F | --sharing-fraction F] \\
        [--variant-seed D] [--seed S] [--policy frag,bestfit]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.trace_input import add_trace_arguments, load_trace  # noqa: E402
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD  # noqa: E402
from qgpu_runtime.placement.policies import POLICIES  # noqa: E402
from qgpu_runtime.placement.state import ClusterState  # noqa: E402
from qgpu_runtime.sim.replay import ReplayOptions, replay_arrivals  # noqa: E402
from qgpu_runtime.sim.trace import TracePod  # noqa: E402

AT_PCT = 100.0
# The replay stops just past the moment measured: the arrival order's prefix is the same whatever
# its extent (the extension draws from one seeded generator), so this is the full run's moment.
EXTENT_PCT = 101
PARTIAL_BUCKETS = ((1, 100), (100, 500), (500, CORE_MILLI_PER_CARD))


def free_gpu_breakdown(state: ClusterState, remainder: int | None, floors: tuple[int, int],
                       per_gpu: tuple[float, float]) -> dict[str, int]:
    """The free GPU of ``state`` (thousandths of a card) by where it is (see the module's text).
    ``remainder``: the free compute counted apart on partly used cards (None: none is); ``floors``:
    the least CPU (milli) and host memory (MiB) a GPU pod asked for; ``per_gpu``: the CPU and memory
    the workload asks per thousandth of a card (0: not weighed)."""
    free = np.where(state.exclusive | ~state.card_valid, 0, state.core_free)
    whole = state.card_free_whole()
    partial = np.where(whole, 0, free)
    out = {"whole_cards": int(free[whole].sum())}
    exact = partial == remainder if remainder is not None else np.zeros(partial.shape, dtype=bool)
    out["remainder"] = int(partial[exact].sum())
    other = np.where(exact, 0, partial)
    for lo, hi in PARTIAL_BUCKETS:
        out[f"partial_{lo}_{hi - 1}"] = int(other[(other >= lo) & (other < hi)].sum())
    per_node = free.sum(axis=1)
    cpu_short = state.cpu_free < floors[0]
    out["cpu_short"] = int(per_node[cpu_short].sum())
    out["memory_short"] = int(per_node[(state.mem_free < floors[1]) & ~cpu_short].sum())
    for name, have, ratio in (("beyond_cpu", state.cpu_free, per_gpu[0]), ("beyond_memory", state.mem_free, per_gpu[1])):
        fed = np.maximum(have, 0) / ratio if ratio else np.full(len(per_node), np.inf)
        out[name] = int(np.maximum(0.0, per_node - fed).sum())
    out["total"] = int(free.sum())
    return out


@dataclass
class Breakdown:
    """A replay observer: failed pods by shape until the arrived demand reaches ``at_pct``, and the
    free GPU's breakdown at the first pod that takes it there."""

    at_pct: float = AT_PCT
    failed: Counter = field(default_factory=Counter)
    failed_gpu: Counter = field(default_factory=Counter)
    first_failed_at: dict[tuple[int, int, int], float] = field(default_factory=dict)
    sharing_sizes: Counter = field(default_factory=Counter)
    cpu_floor: int | None = None
    memory_floor: int | None = None
    asked: np.ndarray = field(default_factory=lambda: np.zeros(3))  # CPU, memory, GPU of every arrived pod
    snapshot: dict[str, Any] | None = None

    def __call__(self, pod: TracePod, granted: int | None, arrived_pct: float, state: ClusterState) -> None:
        if self.snapshot is not None:
            return
        self.asked += (pod.cpu_milli, pod.memory_mib, pod.gpu_request_milli)
        if pod.num_gpu:
            self.cpu_floor = pod.cpu_milli if self.cpu_floor is None else min(self.cpu_floor, pod.cpu_milli)
            self.memory_floor = pod.memory_mib if self.memory_floor is None else min(self.memory_floor, pod.memory_mib)
            if pod.gpu_milli < CORE_MILLI_PER_CARD:
                self.sharing_sizes[pod.gpu_milli] += 1
        if granted is None:
            shape = (pod.num_gpu, pod.gpu_milli, pod.cpu_milli // 1000)
            self.failed[shape] += 1
            self.failed_gpu[shape] += pod.gpu_request_milli
            self.first_failed_at.setdefault(shape, arrived_pct)
        if arrived_pct >= self.at_pct:
            common = self.sharing_sizes.most_common(1)[0][0] if self.sharing_sizes else None
            remainder = CORE_MILLI_PER_CARD - common if common is not None else None
            cpu, memory, gpu = self.asked
            per_gpu = (cpu / gpu, memory / gpu) if gpu else (0.0, 0.0)
            parts = free_gpu_breakdown(state, remainder, (self.cpu_floor or 0, self.memory_floor or 0), per_gpu)
            self.snapshot = {"arrived_pct": arrived_pct, "common_sharing_size": common, "remainder": remainder,
                             "cpu_floor_milli": self.cpu_floor, "memory_floor_mib": self.memory_floor,
                             "cpu_milli_per_gpu_milli": round(per_gpu[0], 3), "memory_mib_per_gpu_milli": round(per_gpu[1], 3),
                             "free_milli": parts}

    def report(self, capacity_milli: int) -> dict[str, Any]:
        """The breakdown and the failed shapes, in % of ``capacity_milli``."""
        if self.snapshot is None:
            raise ValueError(f"the replay never reached arrived {self.at_pct} % of capacity")

        def pct(milli: int) -> float:
            return round(100.0 * milli / capacity_milli, 3)

        failed = [{"cards": s[0], "milli_per_card": s[1], "cpu_cores": s[2], "pods": n, "gpu_pct": pct(self.failed_gpu[s]),
                   "first_at_arrived_pct": round(self.first_failed_at[s], 1)}
                  for s, n in sorted(self.failed.items(), key=lambda kv: (-self.failed_gpu[kv[0]], kv[0]))]
        snap = dict(self.snapshot)
        snap["free_pct"] = {k: pct(v) for k, v in snap.pop("free_milli").items()}
        snap["arrived_pct"] = round(snap["arrived_pct"], 3)
        return {**snap, "failed_gpu_pct": pct(sum(self.failed_gpu.values())), "failed": failed}


def _table(run: dict[str, Any]) -> str:
    free = run["free_pct"]
    lines = [f"{run['policy']}, seed {run['seed']}: free GPU at arrived {run['arrived_pct']} % "
             f"(% of capacity; the most common sharing size {run['common_sharing_size']} leaves {run['remainder']})"]
    lines += [f"  {k:<16} {v:7.3f}" for k, v in free.items()]
    lines.append(f"  failed before: {run['failed_gpu_pct']:.3f} % of capacity")
    lines += [f"  {f['cards']} x {f['milli_per_card']}, {f['cpu_cores']} cores: {f['pods']} pods, {f['gpu_pct']:.3f} %, "
              f"first at arrived {f['first_at_arrived_pct']} %" for f in run["failed"][:12]]
    if len(run["failed"]) > 12:
        rest = run["failed"][12:]
        lines.append(f"  {len(rest)} more shapes: {sum(f['pods'] for f in rest)} pods, {sum(f['gpu_pct'] for f in rest):.3f} %")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_arguments(parser)
    parser.add_argument("--seed", type=int, default=42, help="the replay's seed")
    parser.add_argument("--policy", default="frag", help=f"comma-separated, of {', '.join(sorted(POLICIES))}")
    parser.add_argument("--json", action="store_true", help="one JSON object per policy instead of a table")
    args = parser.parse_args()
    policies = [p for p in args.policy.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        parser.error(f"--policy {args.policy!r}: choose from {', '.join(sorted(POLICIES))}")
    nodes, pods = load_trace(parser, args)
    for policy in policies:
        started = time.perf_counter()
        observer = Breakdown()
        result = replay_arrivals(nodes, pods, policy, args.seed, ReplayOptions(extend_to_pct=EXTENT_PCT), observer=observer)
        run = {"policy": policy, "seed": args.seed, "multi_card_fraction": args.multi_card_fraction,
               "sharing_fraction": args.sharing_fraction, "variant_seed": args.variant_seed,
               "unallocated_pct_at_100": round(result.unallocated_at(100), 2), **observer.report(result.capacity_milli),
               "seconds": round(time.perf_counter() - started, 1)}
        print(json.dumps(run) if args.json else _table(run), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
