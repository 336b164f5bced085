"""filter + prioritize in-process, without HTTP or a control plane, and the garbage collector's pauses
meanwhile (issue 14 §2).

N fake nodes of 8 V100 cards, then ``--pods`` pending pods each filtered and prioritized with all N
names, as kube-scheduler sends them with ``percentageOfNodesToScore: 100``. None is bound, so each
keeps its filter's hold and bind authorization, as pods waiting for their bind do. Reported:
p50/p99 of filter, prioritize and the pair (the first 20 pods are warm-up), and every collection
of Python's cycle collector during the run (generation, duration) from ``gc.callbacks``.

Run: .venv/bin/python bench/extender_inprocess.py [--nodes 5000 --pods 300]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qgpu_runtime.extender.app import ExtenderApp  # noqa: E402
from qgpu_runtime.extender.cache import AllocationCache  # noqa: E402
from qgpu_runtime.model.requests import DEFAULT_LIMITS  # noqa: E402
from qgpu_runtime.placement.policies import make_policy  # noqa: E402
from tests.extender.test_kube_cache import node, pod  # noqa: E402
from tests.recordkeys import VERIFIER

WARM_UP = 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=300)
    args = parser.parse_args()
    if args.nodes < 1 or args.pods < 1:
        parser.error("--nodes and --pods must be >= 1")
    cache = AllocationCache(make_policy("binpack"), "binpack", max_holds=args.pods + WARM_UP, verifier=VERIFIER)
    cache.replace_nodes([node(f"node-{i:05d}", n_cards=8) for i in range(args.nodes)])
    cache.replace_pods([])
    app = ExtenderApp(cache, None, DEFAULT_LIMITS)
    names = [f"node-{i:05d}" for i in range(args.nodes)]
    bodies = []
    for i in range(args.pods + WARM_UP):
        p = pod(f"lat-{i}", core=25, memory=4)
        cache.apply_pod("ADDED", p)
        bodies.append(json.dumps({"Pod": p, "Nodes": None, "NodeNames": names}).encode())

    collections: list[tuple[int, float]] = []
    started: dict[str, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            collections.append((info["generation"], 1000 * (time.perf_counter() - started["t"])))

    gc.callbacks.append(on_gc)
    filters, prioritizes = [], []
    try:
        for body in bodies:
            t0 = time.perf_counter()
            app.handle("filter", body)
            t1 = time.perf_counter()
            app.handle("prioritize", body)
            filters.append(t1 - t0)
            prioritizes.append(time.perf_counter() - t1)
    finally:
        gc.callbacks.remove(on_gc)

    def pct(values: list[float], q: int) -> float:
        return round(1000 * statistics.quantiles(values, n=100, method="inclusive")[q - 1], 2)

    f, p = filters[WARM_UP:], prioritizes[WARM_UP:]
    pairs = [a + b for a, b in zip(f, p)]
    print(json.dumps({
        "nodes": args.nodes, "pods": args.pods,
        "filter_ms": {"p50": pct(f, 50), "p99": pct(f, 99)},
        "prioritize_ms": {"p50": pct(p, 50), "p99": pct(p, 99)},
        "filter_plus_prioritize_ms": {"p50": pct(pairs, 50), "p99": pct(pairs, 99)},
        "gc_collections_ms": [{"generation": g, "ms": round(ms, 2)} for g, ms in collections],
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
