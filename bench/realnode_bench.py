"""Pod create -> Running on the real node (issue 10, item 8): GPU pods admitted by qgpu's webhook,
placed by its extender through the real kube-scheduler and allocated by its device plugin through
the real kubelet, against the same pods without a GPU request (neither webhook nor extender sees
them: the matchConditions and the extender's managedResources skip them), in one run on one
cluster, alternating rounds so both arms see the same machine load.

Each pod's latency is the time from its create call returning to the watch event that shows it
Running (all its containers started), split into stages by the first watch event that shows each
(issue 23 §3): scheduled (``spec.nodeName`` set: webhook, scheduler and, for GPU pods, the
extender), admitted (the kubelet took it: ``status.startTime``; GPU pods: the device plugin's
Allocate or the DRA driver's Prepare), sandbox (condition ``PodReadyToStartContainers``), started
(every container running) and Running (the phase). The objects' own timestamps have one-second
resolution, too coarse for these stages, so each is timed when the watch first shows it; every
stage is the time since the previous one. Pods are created in bursts of --burst, like a Job or a
Deployment scaling up; a round deletes its pods, then waits until containerd holds no container of
their namespace (sandboxes included) before the next arm starts. Arms alternate and their
order swaps every round (plain, gpu; gpu, plain; ...), so neither always runs on a warmer machine.

With --dra the cluster's pool is in DRA mode and the GPU arm's pods are converted to
ResourceClaims by the webhook (their namespace is labelled qgpu.io/gpu-mode=dra): the DRA path as
an arm of its own, against plain pods on the same cluster.

Run (root; brings up its own local cluster, ~3 min the first time):
  .venv/bin/python bench/realnode_bench.py [--pods 100 --rounds 2 --burst 20] [--dra]
Prints one JSON document; --markdown appends a section to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kubernetes import client, config, watch  # noqa: E402

from bench.extender_bench import metric_samples  # noqa: E402
from qgpu_runtime.contract.names import GPU_MODE  # noqa: E402
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


STAGES = ("scheduled", "admitted", "sandbox", "started", "running")


def stages_seen(pod: dict[str, Any]) -> set[str]:
    """The stages a pod (an API dict) shows it has reached."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    seen = set()
    if spec.get("nodeName"):
        seen.add("scheduled")
    if status.get("startTime"):
        seen.add("admitted")
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    if conditions.get("PodReadyToStartContainers") == "True":
        seen.add("sandbox")
    containers = status.get("containerStatuses") or []
    if containers and all((c.get("state") or {}).get("running") for c in containers):
        seen.add("started")
    if status.get("phase") == "Running":
        seen.add("running")
    return seen


def split(created: float, first_seen: dict[str, float]) -> dict[str, float]:
    """Each stage's duration since the one before it (the first since ``created``). A stage the
    watch never showed apart from a later one (both in one event) takes no time of its own, and a
    later stage seen first closes the earlier ones at its time."""
    out: dict[str, float] = {}
    previous = created
    for i, stage in enumerate(STAGES):
        later = [first_seen[s] for s in STAGES[i:] if s in first_seen]
        at = min(later) if later else previous
        out[stage] = max(0.0, at - previous)
        previous = max(previous, at)
    return out


# Histograms that time the admission stage from both sides: kubelet's (device plugin Allocate and
# DRA calls as kubelet waited for them) and the node manager's own (its Allocate answer).
ADMISSION_HISTOGRAMS = ("kubelet_device_plugin_alloc_duration_seconds", "dra_grpc_operations_duration_seconds",
                        "dra_operations_duration_seconds", "qgpu_allocate_duration_seconds")


def histogram_totals(samples: Iterable[Any]) -> dict[str, tuple[float, float]]:
    """(sum seconds, count) of each admission histogram among Prometheus samples (as
    extender_bench.metric_samples gives them), keyed by name and the labels that tell the calls
    apart (resource, method or operation)."""
    out: dict[str, tuple[float, float]] = {}
    for sample in samples:
        family, _, suffix = sample.name.rpartition("_")
        if family not in ADMISSION_HISTOGRAMS or suffix not in ("sum", "count"):
            continue
        labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                          if k in ("resource_name", "resource", "method_name", "operation_name", "is_error"))
        key = f"{family}{{{labels}}}"
        total, count = out.get(key, (0.0, 0.0))
        out[key] = (total + sample.value, count) if suffix == "sum" else (total, count + sample.value)
    return out


def admission_totals(cluster: LocalCluster) -> dict[str, tuple[float, float]]:
    """kubelet's histograms (its own port, as the cluster admin: kube-apiserver's node proxy refuses
    a loopback node address) and the node manager's (its metrics port on the host); a source that
    does not answer adds nothing."""
    out: dict[str, tuple[float, float]] = {}
    try:
        ctx = ssl.create_default_context(cafile=str(cluster.pki / "ca.crt"))
        ctx.load_cert_chain(str(cluster.pki / "admin.crt"), str(cluster.pki / "admin.key"))
        out.update(histogram_totals(metric_samples(f"https://127.0.0.1:{cluster.port('kubelet')}/metrics", ctx)))
    except Exception as exc:  # noqa: BLE001 - reported; the stages are measured anyway
        print(f"realnode_bench: kubelet metrics: {exc}", file=sys.stderr)
    try:
        out.update(histogram_totals(metric_samples(f"http://127.0.0.1:{cluster.port('manager-metrics')}/metrics")))
    except Exception as exc:  # noqa: BLE001
        print(f"realnode_bench: manager metrics: {exc}", file=sys.stderr)
    return out


def admission_delta(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Per histogram series: calls during the round, their mean and total milliseconds."""
    out = {}
    for key, (total, count) in after.items():
        t0, c0 = before.get(key, (0.0, 0.0))
        calls = count - c0
        if calls > 0:
            out[key] = {"calls": calls, "mean_ms": round(1000 * (total - t0) / calls, 2), "total_ms": round(1000 * (total - t0), 1)}
    return out


class StageWatch:
    """Records the moment each pod of a namespace is first seen in each stage."""

    def __init__(self, api: client.CoreV1Api, ns: str) -> None:
        self.api, self.ns = api, ns
        self.seen: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def running(self) -> int:
        return sum(1 for s in self.seen.values() if "running" in s)

    def _run(self) -> None:
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(self.api.list_namespaced_pod, self.ns, timeout_seconds=5, deserialize=False):
                    now = time.monotonic()
                    pod = event["object"]  # the API's JSON: no model objects to build on a busy node
                    mine = self.seen.setdefault(pod["metadata"]["name"], {})
                    for stage in stages_seen(pod):
                        mine.setdefault(stage, now)
                    if self._stop.is_set():
                        break
            except Exception:  # a dropped watch is re-opened
                time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def settle(cluster: LocalCluster, api: client.CoreV1Api, ns: str, timeout: float) -> float:
    """Wait until the namespace has no pod left and containerd holds no container of it (sandboxes
    included); seconds waited."""
    started = time.monotonic()
    deadline = started + timeout
    selector = f'labels."io.kubernetes.pod.namespace"=={ns}'
    while time.monotonic() < deadline:
        if not api.list_namespaced_pod(ns).items:
            left = cluster.ctr("containers", "list", "-q", selector, check=False)
            if left.returncode == 0 and not left.stdout.split():
                return time.monotonic() - started
        time.sleep(0.5)
    raise RuntimeError(f"namespace {ns}: containerd still holds its containers after {timeout:.0f} s")


def round_stages(cluster: LocalCluster, api: client.CoreV1Api, ns: str, prefix: str, pods: int, burst: int,
                 limits: dict[str, str], timeout: float) -> tuple[list[dict[str, float]], float, dict[str, dict[str, float]]]:
    """One arm's round: per pod, the total (create -> Running) and each stage; and the round's
    makespan (first create to last Running), which a per-pod figure hides when an earlier stage
    paces the pods (pods admitted one by one queue less for their sandboxes)."""
    image = cluster_image(cluster)
    admission_before = admission_totals(cluster)
    sw = StageWatch(api, ns)
    created: dict[str, float] = {}
    try:
        for start in range(0, pods, burst):
            for i in range(start, min(pods, start + burst)):
                name = f"{prefix}-{i}"
                api.create_namespaced_pod(ns, kube.shell_pod(name, image, "exec sleep 3600", limits=limits))
                created[name] = time.monotonic()
        deadline = time.monotonic() + timeout
        while sw.running() < pods and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        sw.stop()
    admission = admission_delta(admission_before, admission_totals(cluster))
    missing = sorted(n for n in created if "running" not in sw.seen.get(n, {}))
    if missing:
        raise RuntimeError(f"{len(missing)} pod(s) not Running after {timeout:.0f}s, e.g. {missing[:3]}: "
                           f"{kube.events(api, ns, missing[0])}")
    api.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
    settled = settle(cluster, api, ns, timeout)
    print(f"realnode_bench: {prefix}: settled {settled:.1f} s after the delete", file=sys.stderr, flush=True)
    out = []
    for name, at in created.items():
        row = split(at, sw.seen[name])
        row["total"] = sw.seen[name]["running"] - at
        out.append(row)
    makespan = max(sw.seen[n]["running"] for n in created) - min(created.values())
    return out, makespan, admission


def summarize(rows: list[dict[str, float]]) -> dict[str, Any]:
    keys = ("total", *STAGES)
    return {"pods": len(rows), **{k: {"p50_s": round(percentile([r[k] for r in rows], 50), 3),
                                       "p99_s": round(percentile([r[k] for r in rows], 99), 3)} for k in keys}}


def arm_order(round_index: int, arms: tuple[str, ...]) -> tuple[str, ...]:
    """Alternate arms within a round and swap their order every round."""
    return arms if round_index % 2 == 0 else tuple(reversed(arms))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs both arms, their order swapped every round")
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--dra", action="store_true", help="the pool in DRA mode: the GPU arm's pods get ResourceClaims")
    parser.add_argument("--markdown", action="store_true", help="append a section to docs/benchmarks.md")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("realnode_bench: needs root (containerd, kubelet, mounts, cgroups)", file=sys.stderr)
        return 2
    _run(str(ROOT / "scripts" / "local-cluster-deps"))
    workdir = Path(tempfile.mkdtemp(prefix="qgpu-realnode-bench-"))
    cluster = LocalCluster(workdir, _bin("k8s-testbin"), _bin("containerd-bin"), persistent=False,
                           log=lambda m: print(f"local-cluster: {m}", file=sys.stderr, flush=True), simulated_cards=CARDS,
                           dra=args.dra)
    gpu_arm = "dra" if args.dra else "gpu"
    result: dict[str, Any] = {}
    try:
        cluster.up()
        out = site_yml(cluster)
        if out.returncode != 0:
            print(out.stdout[-4000:], file=sys.stderr)
            return 1
        api = client.CoreV1Api(config.new_client_from_config(str(cluster.admin_kubeconfig)))
        namespaces = {"plain": kube.namespace(api, "bench-plain"), gpu_arm: kube.namespace(api, f"bench-{gpu_arm}")}
        if args.dra:
            api.patch_namespace(namespaces[gpu_arm], {"metadata": {"labels": {GPU_MODE: "dra"}}})
        limits = {"plain": {}, gpu_arm: GPU_LIMITS}
        rows: dict[str, list[dict[str, float]]] = {"plain": [], gpu_arm: []}
        makespans: dict[str, list[float]] = {"plain": [], gpu_arm: []}
        admissions: dict[str, list[dict[str, dict[str, float]]]] = {"plain": [], gpu_arm: []}
        for r in range(args.rounds):
            for arm in arm_order(r, ("plain", gpu_arm)):
                print(f"realnode_bench: round {r + 1}/{args.rounds}, {arm}: {args.pods} pods", file=sys.stderr, flush=True)
                got, makespan, admission = round_stages(cluster, api, namespaces[arm], f"{arm}-{r}", args.pods, args.burst,
                                                        limits[arm], args.timeout)
                rows[arm] += got
                admissions[arm].append(admission)
                makespans[arm].append(round(makespan, 2))
        summary = {arm: {**summarize(v), "makespan_s": makespans[arm], "admission_calls_per_round": admissions[arm]}
                   for arm, v in rows.items()}
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
            "command": "bench/realnode_bench.py " + " ".join(sys.argv[1:]),
            "pods_per_round": args.pods, "rounds": args.rounds, "burst": args.burst, "gpu_arm": gpu_arm, "arms": summary,
            "ratio_p50": round(summary[gpu_arm]["total"]["p50_s"] / summary["plain"]["total"]["p50_s"], 2),
            "ratio_p99": round(summary[gpu_arm]["total"]["p99_s"] / summary["plain"]["total"]["p99_s"], 2),
            "ratio_makespan": round(sum(makespans[gpu_arm]) / sum(makespans["plain"]), 2),
        }
    finally:
        cluster.down()
    print(json.dumps(result, indent=2))
    if args.markdown:
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write(markdown(result))
    return 0


def markdown(r: dict[str, Any]) -> str:
    gpu = r["gpu_arm"]
    label = {"plain": "plain (no GPU request)", "gpu": "GPU (webhook + extender + device plugin)",
             "dra": "GPU through DRA (webhook conversion + kube-scheduler + DRA driver)"}
    lines = [f"\n### Pod create → Running on the real node, by stage ({r['date']})\n\n"
             f"`.venv/bin/python {r['command']}` — {r['machine']}; one run, {r['rounds']} rounds of "
             f"{r['pods_per_round']} pods per arm, bursts of {r['burst']}, arms alternated and swapped per round.\n\n"
             "| arm | pods | makespan per round | total p50 / p99 | " + " | ".join(f"{s} p50 / p99" for s in STAGES) + " |\n"
             "|---|---|---|---|" + "---|" * len(STAGES) + "\n"]
    for arm in ("plain", gpu):
        a = r["arms"][arm]
        cells = " | ".join(f"{a[k]['p50_s']} / {a[k]['p99_s']} s" for k in ("total", *STAGES))
        spans = ", ".join(f"{m} s" for m in a["makespan_s"])
        lines.append(f"| {label[arm]} | {a['pods']} | {spans} | {cells} |\n")
    lines.append(f"| ratio {gpu} / plain | | {r['ratio_makespan']} | {r['ratio_p50']} / {r['ratio_p99']} |"
                 + " |" * len(STAGES) + "\n")
    return "".join(lines)


if __name__ == "__main__":
    sys.exit(main())
