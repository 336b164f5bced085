"""``CommittedView.booked_on`` at many bound pods (issue 23 §2): what a committed bind asks the cache
under its lock, per node, from the per-node index of bookings (extender/bookings.py).

N fake nodes of 8 V100 cards, ``--pods`` pods booked on them round-robin as records are (through
``AllocationCache.reserve``, the bind's own booking), then ``booked_on`` of ``--samples`` random
nodes timed one by one. Reported: p50/p99/max of the wall time and p50/p99 of the thread's CPU
time in ms, and the pods per node.

Run: .venv/bin/python bench/extender_booked_on.py [--nodes 3750 --pods 30000 --samples 2000]
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

from qgpu_runtime.extender.cache import AllocationCache  # noqa: E402
from qgpu_runtime.model.requests import parse_pod  # noqa: E402
from qgpu_runtime.placement.policies import make_policy  # noqa: E402
from tests.extender.test_kube_cache import node, pod  # noqa: E402
from tests.recordkeys import VERIFIER  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3750)
    parser.add_argument("--pods", type=int, default=30000)
    parser.add_argument("--samples", type=int, default=2000)
    args = parser.parse_args()
    if min(args.nodes, args.pods, args.samples) < 1:
        parser.error("--nodes, --pods and --samples must be >= 1")
    names = [f"node-{i:05d}" for i in range(args.nodes)]
    cache = AllocationCache(make_policy("binpack"), "binpack", verifier=VERIFIER)
    cache.replace_nodes([node(n, n_cards=8) for n in names])
    cache.replace_pods([])
    now = time.time_ns()
    t0 = time.perf_counter()
    for i in range(args.pods):
        p = pod(f"b-{i}", core=10, memory=1)
        cache.apply_pod("ADDED", p)
        cache.reserve(p, parse_pod(p), names[i % args.nodes], now)
    booking_s = time.perf_counter() - t0
    rng = random.Random(1)
    times, cpu = [], []
    for _ in range(args.samples):
        n = names[rng.randrange(args.nodes)]
        t, c = time.perf_counter(), time.thread_time()
        cache.committed.booked_on(n)
        cpu.append(time.thread_time() - c)
        times.append(time.perf_counter() - t)
    q = statistics.quantiles(times, n=100, method="inclusive")
    qc = statistics.quantiles(cpu, n=100, method="inclusive")
    print(json.dumps({"nodes": args.nodes, "bound_pods": args.pods, "pods_per_node": round(args.pods / args.nodes, 1),
                      "booked_on_ms": {"p50": round(q[49] * 1000, 4), "p99": round(q[98] * 1000, 4),
                                       "max": round(max(times) * 1000, 4)},
                      # this thread's CPU only: on a shared machine the wall time also holds waits for a core
                      "booked_on_cpu_ms": {"p50": round(qc[49] * 1000, 4), "p99": round(qc[98] * 1000, 4)},
                      "booking_s": round(booking_s, 1)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
