"""How long the engine takes to choose a node and cards for one pod.

Builds a cluster of N nodes shaped like the bundled trace's fleet (node kinds drawn from the trace
node list; the trace is found as the tests find it, ``$QGPU_TRACE_DIR`` first), fills it to a
target utilisation with trace pods through the engine itself, then times `place` for a sample of further pods per policy.
Reports median and p99 in milliseconds. Usage:

    .venv/bin/python bench/placement_latency.py --nodes 5000 --fill 60 --samples 300
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qgpu_runtime.placement import ClusterState, NodeSpec, Unschedulable, make_policy, place  # noqa: E402
from qgpu_runtime.sim.trace import load_nodes, load_pods  # noqa: E402
from tests.tracedata import openb_trace_dir  # noqa: E402


def fleet(trace: Path, n: int, rng: random.Random) -> list[NodeSpec]:
    kinds = load_nodes(trace / "openb_node_list_gpu_node.csv")
    return [NodeSpec(f"node-{i:05d}", k.cpu_milli, k.memory_mib, k.cards, k.labels)
            for i, k in enumerate(rng.choice(kinds) for _ in range(n))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--fill", type=float, default=60.0, help="GPU utilisation (%%) to reach before timing")
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--policy", default="binpack,spread,bestfit,frag")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trace = openb_trace_dir()
    if trace is None:
        ap.error("the bundled trace was not found ($QGPU_TRACE_DIR, ../shared/data/gpu-trace-v2023 or "
                 "/work/shared/data/gpu-trace-v2023): set QGPU_TRACE_DIR")
    rng = random.Random(args.seed)
    pods = load_pods(trace / "openb_pod_list_default.csv")
    results = {}
    for name in args.policy.split(","):
        state = ClusterState(fleet(trace, args.nodes, random.Random(args.seed)), enforce_pod_limit=False)
        policy = make_policy(name)
        target = state.gpu_capacity_milli() * args.fill / 100
        i = 0
        while state.gpu_allocated_milli() < target:
            req = rng.choice(pods).request()
            policy.observe(req)
            try:
                state.commit(str(i), place(state, req, policy))
            except Unschedulable:
                pass
            i += 1
        times = []
        for _ in range(args.samples):
            req = rng.choice(pods).request()
            policy.observe(req)
            start = time.perf_counter()
            try:
                place(state, req, policy)
            except Unschedulable:
                pass
            times.append((time.perf_counter() - start) * 1000)
        times.sort()
        results[name] = {"median_ms": round(statistics.median(times), 3), "p99_ms": round(times[int(0.99 * (len(times) - 1))], 3)}
    if args.json:
        print(json.dumps({"nodes": args.nodes, "fill_pct": args.fill, "samples": args.samples, "policies": results}))
    else:
        print(f"{args.nodes} nodes, filled to {args.fill}% GPU, {args.samples} placements timed per policy")
        for name, r in results.items():
            print(f"  {name:<8} median {r['median_ms']:7.3f} ms   p99 {r['p99_ms']:7.3f} ms")


if __name__ == "__main__":
    main()
