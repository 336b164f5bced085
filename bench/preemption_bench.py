"""Preemption under the real kube-scheduler: qgpu's card-level victims against kube-scheduler's own
node-level choice, side by side in one run (issue 25, "Done means").

One control plane (kube-apiserver, etcd, kube-scheduler of tests/k8s/controlplane.py) and one
`qgpu extender serve` over HTTPS. Per arm and round, ``--nodes`` fresh fake nodes of two V100-32G
cards each advertise qGPU's node totals (qgpu-core, qgpu-memory, qgpu-core-greedy checked at node
level, as the roles wire them). Each node is filled with four offline pods of 50 % and 16 GiB
(qgpu-core-greedy, app-class offline), two per card, whose priorities are drawn from ten
PriorityClasses with ``--seed``; then ``--nodes`` pods of a higher priority asking 60 % and 20 GiB
of one card arrive at once. Each needs one card freed whole: evicting the two pods of one card.
kube-scheduler's own dry run frees 20 GiB of the node's memory total by evicting the node's lowest-
priority pod(s) in its order, which frees a usable card only when they share one.

The arms differ in one line of the scheduler configuration: (q) `preemptVerb: preempt`, qgpu's
extender chooses the victims (docs/extender.md, "Preemption"); (k) no preemptVerb, kube-scheduler
alone. Filter, prioritize and bind are qgpu's in both. The arms alternate their order per round.

No kubelet runs: the pods' grace period is 0 and a watcher deletes a victim still terminating with
grace 0 at once, as its kubelet would after stopping it. So the times are creation → bound (the
victims' deletion, kube-scheduler's next cycle on the nominated node, the bind), without container
start, which is the same in both arms; a pod not bound after ``--timeout`` seconds counts as
pending. Reported per arm: pods bound, time to bound p50/p90/max, evictions, evictions per bound
pod, and wasted evictions (a victim whose card no preemptor was placed on).

Run: .venv/bin/python bench/preemption_bench.py --nodes 10 --rounds 2 --seed 1 [--json out.json] [--markdown]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kubernetes import client, watch  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

from bench.extender_bench import admin_client, finish, new_plane, scrape  # noqa: E402
from tests.k8s.controlplane import ControlPlane, extender_server  # noqa: E402
from tests.k8s.kubeobjects import MANAGED_RESOURCES, cards, gpu_node, gpu_pod, list_pods, record  # noqa: E402

QGPU_CORE = "tke.cloud.tencent.com/qgpu-core"
QGPU_MEMORY = "tke.cloud.tencent.com/qgpu-memory"
QGPU_CORE_GREEDY = "tke.cloud.tencent.com/qgpu-core-greedy"
NODE_RESOURCES = (QGPU_CORE, QGPU_MEMORY, QGPU_CORE_GREEDY)
OFFLINE = {"tke.cloud.tencent.com/app-class": "offline"}
LOW_CLASSES = 10
HIGH = "bench-high"


def entry(extender: Any, preempt: bool) -> dict[str, Any]:
    e = extender.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s")
    for resource in e["managedResources"]:
        resource["ignoredByScheduler"] = resource["name"] not in NODE_RESOURCES
    if preempt:
        e["preemptVerb"] = "preempt"
    return e


def priority_classes(api_client: client.ApiClient) -> None:
    api = client.SchedulingV1Api(api_client)
    for name, value in [(f"bench-low-{i}", 1000 + i) for i in range(LOW_CLASSES)] + [(HIGH, 100000)]:
        api.create_priority_class({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                   "metadata": {"name": name}, "value": value})


def make_nodes(api: client.CoreV1Api, arm: str, count: int) -> dict[str, str]:
    label = {"bench-preempt": arm}
    for i in range(count):
        name = f"{arm}-{i:03d}"
        gpu_node(api, name, cards(2, node=name), {**label, "mixed-qgpu-enable": "enable"})
        resources = {"cpu": "64", "memory": "512Gi", "pods": "250", QGPU_CORE: "200", QGPU_MEMORY: "64",
                     QGPU_CORE_GREEDY: "200"}
        api.patch_node_status(name, {"status": {"capacity": resources, "allocatable": resources}})
    return label


def card_of(pod: dict[str, Any]) -> tuple[str, int] | None:
    rec = record(pod)
    return (rec.node, rec.containers[0].shares[0].index) if rec is not None else None


class Watcher:
    """Follows the namespace: first bind time per pod, deletions, and the final delete of a
    terminating pod (what its kubelet would do)."""

    def __init__(self, api: client.CoreV1Api, ns: str, seconds: float):
        self.api, self.ns, self.seconds = api, ns, seconds
        self._watch = watch.Watch()
        self.bound_at: dict[str, float] = {}
        self.deleted: dict[str, tuple[str, int] | None] = {}
        self.cards: dict[str, tuple[str, int] | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """One stream for the whole arm, so no event falls between two."""
        try:
            for ev in self._watch.stream(self.api.list_namespaced_pod, self.ns, timeout_seconds=int(self.seconds) + 60):
                if self._stop.is_set():
                    break
                obj = self.api.api_client.sanitize_for_serialization(ev["object"])
                name = obj["metadata"]["name"]
                if obj["spec"].get("nodeName") and name not in self.bound_at:
                    self.bound_at[name] = time.time()
                if card_of(obj) is not None:
                    self.cards[name] = card_of(obj)
                if ev["type"] == "DELETED":
                    self.deleted[name] = self.cards.get(name)
                elif obj["metadata"].get("deletionTimestamp"):
                    try:
                        self.api.delete_namespaced_pod(name, self.ns, grace_period_seconds=0)
                    except ApiException as exc:
                        if exc.status != 404:
                            raise
        except Exception:  # noqa: BLE001 - the stream closed under stop(); anything else is raised
            if not self._stop.is_set():
                raise
        finally:
            self._watch.stop()

    def stop(self) -> None:
        self._stop.set()
        self._watch.stop()
        self._thread.join(timeout=2)


def preempt_time(extender: Any) -> tuple[float, float]:
    """(seconds, calls) the extender spent answering preempt, from its request-duration histogram."""
    metrics = scrape(extender.url + "/metrics", extender.ssl_context())
    total = sum(v for (name, labels), v in metrics.items()
                if name == "qgpu_extender_request_duration_seconds_sum" and 'verb="preempt"' in labels)
    count = sum(v for (name, labels), v in metrics.items()
                if name == "qgpu_extender_request_duration_seconds_count" and 'verb="preempt"' in labels)
    return total, count


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 2)


def run_arm(cp: ControlPlane, api: client.CoreV1Api, extender: Any, arm: str, preempt: bool, nodes: int,
            seed: int, timeout: float) -> dict[str, Any]:
    ns = f"bench-{arm}"
    api.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    label = make_nodes(api, arm, nodes)
    cp.start_scheduler([entry(extender, preempt)])
    rng = random.Random(seed)
    fillers = []
    for i in range(4 * nodes):
        pod = gpu_pod(f"low-{i:03d}", {QGPU_CORE_GREEDY: 50, QGPU_MEMORY: 16}, selector=label, annotations=OFFLINE)
        pod["spec"]["priorityClassName"] = f"bench-low-{rng.randrange(LOW_CLASSES)}"
        api.create_namespaced_pod(ns, pod)
        fillers.append(pod["metadata"]["name"])
    deadline = time.time() + 120
    while sum(1 for p in list_pods(api, ns) if p["spec"].get("nodeName")) < len(fillers):
        if time.time() > deadline:
            raise RuntimeError(f"{arm}: the filler pods did not all bind in 120 s")
        time.sleep(0.5)
    watcher = Watcher(api, ns, timeout)
    spent_before, calls_before = preempt_time(extender)
    while len(watcher.cards) < len(fillers):  # the watch has listed the node's pods
        time.sleep(0.1)
    created: dict[str, float] = {}
    for i in range(nodes):
        pod = gpu_pod(f"high-{i:03d}", {QGPU_CORE: 60, QGPU_MEMORY: 20}, selector=label)
        pod["spec"]["priorityClassName"] = HIGH
        created[pod["metadata"]["name"]] = time.time()
        api.create_namespaced_pod(ns, pod)
    end = time.time() + timeout
    while time.time() < end and not all(n in watcher.bound_at for n in created):
        time.sleep(0.2)
    time.sleep(1)  # late deletions
    watcher.stop()
    cp.stop_scheduler()
    spent, calls = preempt_time(extender)
    times = [watcher.bound_at[n] - t for n, t in created.items() if n in watcher.bound_at]
    final = {p["metadata"]["name"]: p for p in list_pods(api, ns)}
    high_cards = {card_of(p) for n, p in final.items() if n.startswith("high-") and card_of(p)}
    evicted = {n: c for n, c in watcher.deleted.items() if n.startswith("low-")}
    wasted = sum(1 for c in evicted.values() if c not in high_cards)
    return {"preemptVerb": preempt, "high_pods": nodes, "bound": len(times),
            "to_bound_s": {"p50": pct(times, 0.5), "p90": pct(times, 0.9), "max": pct(times, 1.0)},
            "evictions": len(evicted), "evictions_per_bound": round(len(evicted) / len(times), 2) if times else None,
            "wasted_evictions": wasted, "extender_preempt_calls": int(calls - calls_before),
            "extender_preempt_ms_mean": round(1000 * (spent - spent_before) / (calls - calls_before), 1) if calls > calls_before else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds the preemptors get to bind, per arm")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", action="store_true", help="append the table to docs/benchmarks.md")
    args = parser.parse_args()
    cp, version = new_plane("qgpu-preemptbench-")
    result: dict[str, Any] = {"kubernetes": version, "nodes": args.nodes, "seed": args.seed,
                              "timeout_s": args.timeout, "rounds": []}
    extender = None
    try:
        cp.start()
        api_client = admin_client(cp)
        api = client.CoreV1Api(api_client)
        priority_classes(api_client)
        extender = extender_server(cp, priority="binpack", assume_timeout=120)
        extender.start()
        for r in range(args.rounds):
            arms = [("q", True), ("k", False)] if r % 2 == 0 else [("k", False), ("q", True)]
            out = {}
            for arm, preempt in arms:
                # the same seed in both arms of a round: the same priorities in the same creation order
                out[arm] = run_arm(cp, api, extender, f"{arm}{r}", preempt, args.nodes, args.seed + r, args.timeout)
                print(f"round {r} arm {arm}: {out[arm]}", file=sys.stderr, flush=True)
            result["rounds"].append(out)
    finally:
        if extender is not None:
            extender.stop()
        cp.stop()
    return finish(result, "preemption_bench.py", args.json, append_markdown if args.markdown else None)


def append_markdown(r: dict[str, Any]) -> None:
    lines = [f"\n### Preemption under the real kube-scheduler: qgpu's victims against kube-scheduler's (bench/preemption_bench.py, {r['date'][:10]})\n",
             f"`{r['command']}` — {r['machine']}; {r['kubernetes']}. {r['nodes']} nodes of 2 V100-32G per arm and round, "
             f"4 offline pods of 50 %/16 GiB each, then {r['nodes']} pods of 60 %/20 GiB and a higher priority at once; "
             f"times are creation → bound (no kubelet: container start is the same in both arms), "
             f"pending after {r['timeout_s']:g} s counts as not bound.\n",
             "| round | arm | bound | to bound p50 / p90 / max (s) | evictions | per bound pod | wasted | preempt calls (mean ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for i, rnd in enumerate(r["rounds"]):
        for arm in ("q", "k"):
            a = rnd[arm]
            t = a["to_bound_s"]
            label = "qgpu (`preemptVerb: preempt`)" if arm == "q" else "kube-scheduler alone"
            lines.append(f"| {i} | {label} | {a['bound']}/{a['high_pods']} | {t['p50']} / {t['p90']} / {t['max']} | "
                         f"{a['evictions']} | {a['evictions_per_bound']} | {a['wasted_evictions']} | "
                         f"{a['extender_preempt_calls']} ({a['extender_preempt_ms_mean'] or '-'}) |")
    path = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
