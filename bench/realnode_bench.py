"""Pod create -> Running on the real node (issue 10, item 8): GPU pods admitted by qgpu's webhook,
placed by its extender through the real kube-scheduler and allocated by its device plugin through
the real kubelet, against the same pods without a GPU request (neither webhook nor extender sees
them: the matchConditions and the extender's managedResources skip them), in one run on one
cluster, alternating rounds so both arms see the same machine load.

Each pod's latency is the time from its create call returning to the watch event that shows it
Running (all its containers started). Pods are created in bursts of --burst, like a Job or a
Deployment scaling up; a round deletes its pods before the next starts.

Run (root; brings up its own local cluster, ~3 min the first time):
  .venv/bin/python bench/realnode_bench.py [--pods 100 --rounds 2 --burst 20]
Prints one JSON document; --markdown appends a section to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kubernetes import client, config, watch  # noqa: E402

from tests.realnode import kube  # noqa: E402
from tests.realnode.conftest import _bin, _run, site_yml  # noqa: E402
from tests.realnode.localcluster import LocalCluster  # noqa: E402
from tests.realnode.test_e2e_dialects import cluster_image  # noqa: E402

# Eight simulated 80 GiB cards: 100 pods of 1 % core and 1 GiB fit with room to spare (a card
# holds at most 20 pods), so the GPU arm measures the path, not a full node.
CARDS = [{"model": "A100", "memory_mib": 81920, "count": 8}]
GPU_LIMITS = {"tke.cloud.tencent.com/qgpu-core": "1", "tke.cloud.tencent.com/qgpu-memory": "1"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


class RunningWatch:
    """Records the moment each pod of a namespace is first seen Running."""

    def __init__(self, api: client.CoreV1Api, ns: str) -> None:
        self.api, self.ns = api, ns
        self.running: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(self.api.list_namespaced_pod, self.ns, timeout_seconds=5):
                    pod = event["object"]
                    if pod.status.phase == "Running" and pod.metadata.name not in self.running:
                        self.running[pod.metadata.name] = time.monotonic()
                    if self._stop.is_set():
                        break
            except Exception:  # a dropped watch is re-opened; a missed Running is caught by the list below
                time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def round_latencies(cluster: LocalCluster, api: client.CoreV1Api, ns: str, prefix: str, pods: int, burst: int,
                    limits: dict[str, str], timeout: float) -> list[float]:
    image = cluster_image(cluster)
    rw = RunningWatch(api, ns)
    created: dict[str, float] = {}
    try:
        for start in range(0, pods, burst):
            for i in range(start, min(pods, start + burst)):
                name = f"{prefix}-{i}"
                api.create_namespaced_pod(ns, kube.shell_pod(name, image, "exec sleep 3600", limits=limits))
                created[name] = time.monotonic()
        deadline = time.monotonic() + timeout
        while len(rw.running) < pods and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        rw.stop()
    missing = sorted(set(created) - set(rw.running))
    if missing:
        raise RuntimeError(f"{len(missing)} pod(s) not Running after {timeout:.0f}s, e.g. {missing[:3]}: "
                           f"{kube.events(api, ns, missing[0])}")
    api.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
    deadline = time.monotonic() + timeout
    while api.list_namespaced_pod(ns).items and time.monotonic() < deadline:
        time.sleep(0.5)
    return [rw.running[n] - created[n] for n in created]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per arm, alternating plain and GPU")
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--markdown", action="store_true", help="append a section to docs/benchmarks.md")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("realnode_bench: needs root (containerd, kubelet, mounts, cgroups)", file=sys.stderr)
        return 2
    _run(str(ROOT / "scripts" / "local-cluster-deps"))
    workdir = Path(tempfile.mkdtemp(prefix="qgpu-realnode-bench-"))
    cluster = LocalCluster(workdir, _bin("k8s-testbin"), _bin("containerd-bin"), persistent=False,
                           log=lambda m: print(f"local-cluster: {m}", file=sys.stderr, flush=True), simulated_cards=CARDS)
    result: dict[str, Any] = {}
    try:
        cluster.up()
        out = site_yml(cluster)
        if out.returncode != 0:
            print(out.stdout[-4000:], file=sys.stderr)
            return 1
        api = client.CoreV1Api(config.new_client_from_config(str(cluster.admin_kubeconfig)))
        ns = kube.namespace(api, "bench")
        arms: dict[str, list[float]] = {"plain": [], "gpu": []}
        for r in range(args.rounds):
            for arm, limits in (("plain", {}), ("gpu", GPU_LIMITS)):
                print(f"realnode_bench: round {r + 1}/{args.rounds}, {arm}: {args.pods} pods", file=sys.stderr, flush=True)
                arms[arm] += round_latencies(cluster, api, ns, f"{arm}-{r}", args.pods, args.burst, limits, args.timeout)
        summary = {arm: {"pods": len(v), "p50_s": round(percentile(v, 50), 3), "p99_s": round(percentile(v, 99), 3),
                         "mean_s": round(statistics.fmean(v), 3)} for arm, v in arms.items()}
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
            "command": "bench/realnode_bench.py " + " ".join(sys.argv[1:]),
            "pods_per_round": args.pods, "rounds": args.rounds, "burst": args.burst, "arms": summary,
            "ratio_p50": round(summary["gpu"]["p50_s"] / summary["plain"]["p50_s"], 2),
            "ratio_p99": round(summary["gpu"]["p99_s"] / summary["plain"]["p99_s"], 2),
        }
    finally:
        cluster.down()
    print(json.dumps(result, indent=2))
    if args.markdown:
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write(markdown(result))
    return 0


def markdown(r: dict[str, Any]) -> str:
    a = r["arms"]
    return (f"\n### Pod create → Running on the real node ({r['date']})\n\n"
            f"`.venv/bin/python {r['command']}` — {r['machine']}; one run, alternating arms, "
            f"{r['rounds']} rounds of {r['pods_per_round']} pods per arm, bursts of {r['burst']}.\n\n"
            "| pods | count | p50 | p99 | mean |\n|---|---|---|---|---|\n"
            f"| plain (no GPU request) | {a['plain']['pods']} | {a['plain']['p50_s']} s | {a['plain']['p99_s']} s | {a['plain']['mean_s']} s |\n"
            f"| GPU (webhook + extender + device plugin) | {a['gpu']['pods']} | {a['gpu']['p50_s']} s | {a['gpu']['p99_s']} s | {a['gpu']['mean_s']} s |\n"
            f"| ratio GPU / plain | | {r['ratio_p50']} | {r['ratio_p99']} | |\n")


if __name__ == "__main__":
    sys.exit(main())
