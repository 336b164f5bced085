"""One hostile node against the extender, before and after the inventory bounds (issue 21 §4).

A node manager's own token may write its node's ``qgpu.io/gpus``. Three arms, each in a fresh
process so their memory does not mix: ``clean`` (N healthy nodes of 8 cards), ``hostile`` (the
same plus one node listing ``--cards`` valid-looking cards) and ``overflow`` (one node with one
card of ``memory_mib: 2**64``). Each arm runs on two source trees in the same run: ``before``
(``git archive`` of ``--before``, default the commit before this work) and ``after`` (this
checkout). Reported per arm and tree: the resident memory the cache adds (RSS after the node
relist, the first state build and one filter, minus RSS before), filter p50/p99 over ``--filters``
calls with all names, how many of those calls failed (an exception: an HTTP 500 on the wire) and
how many of the watch's pod events the cache failed to apply.

Run: .venv/bin/python bench/hostile_node.py [--nodes 1000 --cards 3500 --filters 50] [--markdown]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "6b3d1c4"  # main when issue 21 §4 started
ARMS = ("clean", "hostile", "overflow")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_arm(arm: str, nodes: int, cards: int, filters: int) -> dict:
    """One arm in this process (the tree is whatever ``qgpu_runtime`` sys.path finds)."""
    import qgpu_runtime
    from qgpu_runtime.extender.app import ExtenderApp
    from qgpu_runtime.extender.cache import AllocationCache
    from qgpu_runtime.extender.trust import TrustedPods
    from qgpu_runtime.model.requests import DEFAULT_LIMITS
    from qgpu_runtime.placement.policies import make_policy
    from tests.extender.test_kube_cache import node, pod

    def raw_node(name: str, inventory: list[dict]) -> dict:
        return {"metadata": {"name": name, "annotations": {"qgpu.io/gpus": json.dumps(inventory)}},
                "status": {"allocatable": {"cpu": "32", "memory": "128Gi"}}}

    listing = [node(f"node-{i:05d}", n_cards=8) for i in range(nodes)]
    if arm == "hostile":
        listing.append(raw_node("hostile", [{"index": i, "uuid": f"GPU-{i:036d}", "model": "H200", "memory_mib": 143771}
                                            for i in range(cards)]))
    elif arm == "overflow":
        listing.append(raw_node("hostile", [{"index": 0, "uuid": "GPU-0", "model": "H200", "memory_mib": 2**64}]))
    names = [str(n["metadata"]["name"]) for n in listing]
    base = _rss_mib()
    # the tree before issue 21 §1 has no record verifier; this one needs the tests' key
    trust = {}
    if "verifier" in inspect.signature(AllocationCache).parameters:
        from tests.recordkeys import VERIFIER
        trust = {"verifier": VERIFIER}
    cache = AllocationCache(make_policy("binpack"), "binpack", max_holds=filters + 10, **trust)
    cache.replace_nodes(listing)
    cache.replace_pods([])
    apiserver: dict[tuple[str, str], dict] = {}  # what a GET of the pod answers when the watch lags
    app = ExtenderApp(cache, None, DEFAULT_LIMITS,
                      pods=TrustedPods(cache, DEFAULT_LIMITS, lambda ns, name: apiserver.get((ns, name))))
    bodies, event_errors = [], 0
    for i in range(filters + 1):
        p = pod(f"p-{i}", core=25, memory=4)
        apiserver[("ns", f"p-{i}")] = p
        try:
            cache.apply_pod("ADDED", p)
        except Exception:  # noqa: BLE001 - before the bounds, the watch's own events failed too
            event_errors += 1
        bodies.append(json.dumps({"Pod": p, "NodeNames": names}).encode())
    errors, times, verdict = 0, [], ""
    for i, body in enumerate(bodies):
        t0 = time.perf_counter()
        try:
            status, doc = app.handle("filter", body)
        except Exception as exc:  # noqa: BLE001 - what the HTTP layer turns into a 500
            status, doc = 500, {"Error": type(exc).__name__}
        elapsed = time.perf_counter() - t0
        if i == 0:
            grown = _rss_mib() - base
            reason = (doc.get("FailedAndUnresolvableNodes") or {}).get("hostile") or (doc.get("FailedNodes") or {}).get("hostile")
            verdict = (f"HTTP 500 ({doc['Error']})" if status == 500 else f"Error: {doc['Error']}" if doc.get("Error")
                       else f"hostile node: {reason or 'passed'}" if arm != "clean" else "no hostile node")
            continue  # the first call builds the state: counted in memory, not in latency
        errors += status != 200
        times.append(elapsed)
    q = statistics.quantiles(times, n=100, method="inclusive")
    return {"cache_rss_mib": round(grown, 1), "filter_p50_ms": round(1000 * q[49], 2), "filter_p99_ms": round(1000 * q[98], 2),
            "failed_filters": errors, "failed_pod_events": event_errors, "first_filter": verdict[:160], "code": str(Path(qgpu_runtime.__file__).parents[1])}


def _tree(rev: str, into: Path) -> Path:
    data = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def _child(tree: Path, arm: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--arm", arm, "--nodes", str(args.nodes), "--cards", str(args.cards),
                          "--filters", str(args.filters)], env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _markdown(result: dict) -> None:
    lines = [f"\n### One hostile node (`bench/hostile_node.py`), {result['date']}\n",
             f"    {result['command']}\n",
             f"Machine: {result['machine']}. {result['nodes']} healthy nodes of 8 cards, binpack, filter with all names; "
             f"before = {result['before']}, after = this commit.\n",
             "| arm | tree | cache RSS MiB | filter p50 ms | filter p99 ms | failed filters | failed pod events | first filter |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        for tree in ("before", "after"):
            r = result["arms"][arm][tree]
            lines.append(f"| {arm} | {tree} | {r['cache_rss_mib']} | {r['filter_p50_ms']} | {r['filter_p99_ms']} | "
                         f"{r['failed_filters']}/{result['filters']} | {r['failed_pod_events']} | {r['first_filter']} |")
    with open(ROOT / "docs" / "benchmarks.md", "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--cards", type=int, default=3500, help="cards the hostile node lists")
    parser.add_argument("--filters", type=int, default=50)
    parser.add_argument("--before", default=BEFORE, help="the git revision to compare against")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--markdown", action="store_true", help="append the table to docs/benchmarks.md")
    args = parser.parse_args()
    if args.nodes < 1 or args.cards < 1 or args.filters < 2:
        parser.error("--nodes and --cards must be >= 1, --filters >= 2")
    if args.arm:
        sys.path.insert(0, os.getcwd())  # the tree the parent chose
        print(json.dumps(run_arm(args.arm, args.nodes, args.cards, args.filters)))
        return 0
    sys.path.insert(0, str(ROOT))
    from bench.extender_bench import finish

    result: dict = {"nodes": args.nodes, "cards": args.cards, "filters": args.filters, "before": args.before, "arms": {}}
    with tempfile.TemporaryDirectory(prefix="qgpu-before-") as tmp:
        before = _tree(args.before, Path(tmp))
        for arm in ARMS:
            result["arms"][arm] = {"before": _child(before, arm, args), "after": _child(ROOT, arm, args)}
    return finish(result, "hostile_node.py", markdown=_markdown if args.markdown else None)


if __name__ == "__main__":
    raise SystemExit(main())
