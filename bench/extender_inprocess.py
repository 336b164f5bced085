"""The extender's verbs in-process, without its HTTP server or a control plane: filter + prioritize
(issue 14 §2) and, with ``--bind``, each pod's bind and the watch events that follow it (issue 23).

N fake nodes of 8 V100 cards, then ``--pods`` pending pods each filtered and prioritized with all N
names, as kube-scheduler sends them with ``percentageOfNodesToScore: 100``. Without ``--bind`` none
is bound, so each keeps its filter's hold and bind authorization, as pods waiting for their bind
do. Reported: p50/p99 of filter, prioritize and the pair (the first 20 pods are warm-up), and every
collection of Python's cycle collector during the run (generation, duration) from ``gc.callbacks``.

``--bind``: after its prioritize each pod is bound to the node kube-scheduler would pick (the best
score) by the extender's real Binder — its card choice, its signed record and its Binding POST
through the thin client — against a local plain-HTTP server that answers 201 at once in threads of
its own; then the cache takes the watch's two updates of that pod: MODIFIED bound (nodeName and the
annotations the Binding carried) and MODIFIED Running (a kubelet status write). One binder, node
commitments off: the default layout ("auto" with no second binder makes no Lease call). Each
stage's CPU is the bench thread's ``time.thread_time`` (the server's threads excluded), its wall
time beside it: the per-stage table of the extender's own work per bound pod, without HTTPS.

Run: .venv/bin/python bench/extender_inprocess.py [--nodes 5000 --pods 300]
     .venv/bin/python bench/extender_inprocess.py --bind --nodes 100 --pods 1000
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kubernetes import client  # noqa: E402

from bench.answering_server import AnsweringServer  # noqa: E402
from qgpu_runtime.extender.app import ExtenderApp  # noqa: E402
from qgpu_runtime.extender.binder import Binder  # noqa: E402
from qgpu_runtime.extender.cache import AllocationCache  # noqa: E402
from qgpu_runtime.model.requests import DEFAULT_LIMITS  # noqa: E402
from qgpu_runtime.placement.policies import make_policy  # noqa: E402
from tests.extender.test_kube_cache import node, pod  # noqa: E402
from tests.recordkeys import SIGNER, VERIFIER  # noqa: E402

WARM_UP = 20


def decoded(answer: Any) -> Any:
    """A handler's answer as a JSON value (hot paths answer pre-encoded bytes)."""
    return json.loads(bytes(answer)) if isinstance(answer, (bytes, bytearray)) else answer


def pct(values: list[float], q: int) -> float:
    return round(1000 * statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float, float]:
    """fn(*args), its wall and its CPU time (this thread's) in seconds."""
    w0, c0 = time.perf_counter(), time.thread_time()
    out = fn(*args)
    return out, time.perf_counter() - w0, time.thread_time() - c0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=300)
    parser.add_argument("--bind", action="store_true", help="bind each pod and apply the watch's updates (per-stage CPU)")
    args = parser.parse_args()
    if args.nodes < 1 or args.pods < 1:
        parser.error("--nodes and --pods must be >= 1")
    # Without --bind every pod keeps its hold: the cache must allow them all, in one namespace too
    # (the per-namespace cap would otherwise refuse the filters past it, and time the refusals).
    cache = AllocationCache(make_policy("binpack"), "binpack", max_holds=args.pods + WARM_UP,
                            max_holds_per_namespace=args.pods + WARM_UP, verifier=VERIFIER)
    cache.replace_nodes([node(f"node-{i:05d}", n_cards=8) for i in range(args.nodes)])
    cache.replace_pods([])
    server = None
    binder = None
    if args.bind:
        server = AnsweringServer(b'{"kind":"Status","apiVersion":"v1","status":"Success","code":201}').start()
        conf = client.Configuration()
        conf.host = server.url
        binder = Binder(client.CoreV1Api(client.ApiClient(conf)), cache, DEFAULT_LIMITS, signer=SIGNER)
    app = ExtenderApp(cache, binder, DEFAULT_LIMITS)
    if args.bind:
        cache.synced.set()
    names = [f"node-{i:05d}" for i in range(args.nodes)]
    pods, bodies = [], []
    for i in range(args.pods + WARM_UP):
        p = pod(f"lat-{i}", core=25, memory=4)
        p["metadata"]["resourceVersion"] = str(3 * i + 1)  # as the apiserver's pods carry one; 3i+2 bound, 3i+3 Running
        cache.apply_pod("ADDED", p)
        pods.append(p)
        bodies.append(json.dumps({"Pod": p, "Nodes": None, "NodeNames": names}).encode())

    collections: list[tuple[int, float]] = []
    started: dict[str, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            collections.append((info["generation"], 1000 * (time.perf_counter() - started["t"])))

    stages = ("filter", "prioritize", "bind", "watch_bound", "watch_running")
    wall: dict[str, list[float]] = {s: [] for s in stages}
    cpu: dict[str, list[float]] = {s: [] for s in stages}

    def note(stage: str, w: float, c: float) -> None:
        wall[stage].append(w)
        cpu[stage].append(c)

    gc.callbacks.append(on_gc)
    try:
        for i, (p, body) in enumerate(zip(pods, bodies)):
            out, w, c = timed(app.handle, "filter", body)
            if not decoded(out[1]).get("NodeNames"):
                raise SystemExit(f"pod {p['metadata']['name']}: the filter passed no node: {decoded(out[1])}")
            note("filter", w, c)
            out, w, c = timed(app.handle, "prioritize", body)
            note("prioritize", w, c)
            if not args.bind:
                continue
            scores = decoded(out[1])
            best = max(scores, key=lambda s: s["Score"])["Host"]
            meta = p["metadata"]
            bind_body = json.dumps({"PodName": meta["name"], "PodNamespace": meta["namespace"],
                                    "PodUID": meta["uid"], "Node": best}).encode()
            out, w, c = timed(app.handle, "bind", bind_body)
            result = decoded(out[1])
            if result.get("Error"):
                raise SystemExit(f"pod {meta['name']}: bind refused: {result['Error']}")
            note("bind", w, c)
            annotations = dict((server.last.get("metadata") or {}).get("annotations") or {})
            bound = {**p, "metadata": {**meta, "annotations": annotations, "resourceVersion": str(3 * i + 2)},
                     "spec": {**p["spec"], "nodeName": best}}
            _, w, c = timed(cache.apply_pod, "MODIFIED", bound)
            note("watch_bound", w, c)
            running = {**bound, "metadata": {**bound["metadata"], "resourceVersion": str(3 * i + 3)},
                       "status": {"phase": "Running"}}
            _, w, c = timed(cache.apply_pod, "MODIFIED", running)
            note("watch_running", w, c)
    finally:
        gc.callbacks.remove(on_gc)
        if server is not None:
            server.shutdown()

    measured = {s: (wall[s][WARM_UP:], cpu[s][WARM_UP:]) for s in stages if wall[s]}
    pairs = [a + b for a, b in zip(measured["filter"][0], measured["prioritize"][0])]
    report: dict[str, Any] = {
        "nodes": args.nodes, "pods": args.pods,
        "filter_ms": {"p50": pct(measured["filter"][0], 50), "p99": pct(measured["filter"][0], 99)},
        "prioritize_ms": {"p50": pct(measured["prioritize"][0], 50), "p99": pct(measured["prioritize"][0], 99)},
        "filter_plus_prioritize_ms": {"p50": pct(pairs, 50), "p99": pct(pairs, 99)},
        "gc_collections_ms": [{"generation": g, "ms": round(ms, 2)} for g, ms in collections],
    }
    if args.bind:
        report["stages"] = {s: {"wall_p50_ms": pct(w, 50), "wall_p99_ms": pct(w, 99),
                                "cpu_mean_ms": round(1000 * statistics.fmean(c), 3), "cpu_p50_ms": pct(c, 50)}
                            for s, (w, c) in measured.items()}
        report["cpu_per_bound_pod_ms"] = round(sum(1000 * statistics.fmean(c) for _, c in measured.values()), 3)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
