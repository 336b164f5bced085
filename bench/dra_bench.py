"""qgpu's scheduling paths side by side under one real control plane (issue 13 §5 and §9).

One run, one control plane, the same fake nodes (bench/extender_bench.py's: 8 V100 cards each,
also published as a ResourceSlice of driver gpu.qgpu.io with contract.dra.slice_device, and qgpu's
DeviceClasses from contract.dra.device_classes) and the same share per GPU pod (a quarter of a
card, 4 GiB). For each arm, ``--pods`` pods are created while no scheduler runs, then kube-scheduler
is started and the span from the first to the last binding is timed (extender_bench.throughput):

(a) pods without GPU requests, no extender: the baseline, measured first and last;
(b) the extender path: qgpu dialect pods (qgpu-core 25, qgpu-memory 4), extender filter +
    prioritize + bind over HTTPS (managedResources, ignoredByScheduler);
(c) DRA with consumable capacity: one ResourceClaim per pod (class shared.gpu.qgpu.io,
    capacity.requests core 250, memory 4096), created up front; kube-scheduler allocates
    (first fit) and binds, no extender;
(d) DRA plus qgpu's prioritize: as (c), with ``qgpu extender serve --dra-prioritize`` as a
    prioritize-only extender entry (weight 10) over HTTPS.

Reported per arm: pods bound/s and its ratio to the mean of the two (a) runs, kube-scheduler's
mean scheduling attempt and algorithm time (its histograms), CPU per bound pod by process, and the
nodes the arm's pods landed on (binpack through prioritize should use few; the default scoring
spreads). Claims of (c) and (d) consume the same slices, dialect pods of (b) are booked by the
extender's records on the same cards: the two accountings are separate, as they would be in a
cluster that runs both paths on different node pools.

With ``--pack-nodes N``: the packing outcome when the cluster fills up. A seeded mix of quarter
cards, halves and whole cards (whole: a claim without capacity) arrives one pod at a time on N
empty nodes of each DRA arm's own, until it asks ``--pack-demand`` of the compute of their cards; (c)'s default
scoring against (d)'s binpack through prioritize: pods placed, compute booked, whole cards left.

Run: .venv/bin/python bench/dra_bench.py --nodes 300 --pods 400 [--pack-nodes 4] [--json out.json] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kubernetes import client  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

from bench.extender_bench import CARDS, PAUSE, admin_client, finish, make_nodes, new_plane, throughput, wait_cached  # noqa: E402
from bench.extender_bench import pod as dialect_pod  # noqa: E402
from qgpu_runtime.contract.dra import DRIVER, SHARED_CLASS, device_classes, slice_device, slice_name  # noqa: E402
from tests.k8s.controlplane import extender_server  # noqa: E402
from tests.k8s.kubeobjects import MANAGED_RESOURCES, cards  # noqa: E402

CORE_MILLI, MEMORY_MIB = 250, 4096  # the same share as the dialect pods' qgpu-core 25, qgpu-memory 4
PRIORITIZE_WEIGHT = 10


def plain_pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [{"name": "c", "image": PAUSE}]}}


def claim_pod(name: str) -> dict[str, Any]:
    """A pod whose share comes through the ResourceClaim of its own name."""
    doc = plain_pod(name)
    doc["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    doc["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": name}]
    return doc


def share_claim(name: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": SHARED_CLASS,
                "capacity": {"requests": {"core": str(CORE_MILLI), "memory": str(MEMORY_MIB)}}}}]}}}


def publish_dra(resource: client.ResourceV1Api, nodes: int) -> None:
    for doc in device_classes():
        try:
            resource.create_device_class(doc)
        except ApiException as exc:
            if exc.status != 409:
                raise

    def publish(i: int) -> None:
        node = f"node-{i:05d}"
        devices = [slice_device(c, "burst-share") for c in cards(CARDS, node=node)]
        resource.create_resource_slice({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                                        "metadata": {"name": slice_name(node)},
                                        "spec": {"driver": DRIVER, "nodeName": node, "devices": devices,
                                                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}}},
                                       _preload_content=False)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(publish, range(nodes)))


def claims_for(resource: client.ResourceV1Api):
    def prepare(namespace: str, pods: int) -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: resource.create_namespaced_resource_claim(namespace, share_claim(f"p{i:05d}"),
                                                                              _preload_content=False), range(pods)))
    return prepare


PACK_LABEL = "qgpu.io/bench-pack"
PACK_SHAPES = ((250, 4096), (500, 8192), (None, None))  # a quarter, a half, a whole card (no capacity asked)
PACK_WEIGHTS = (0.55, 0.25, 0.20)


def pack_mix(nodes: int, seed: int, demand: float) -> list[tuple[int | None, int | None]]:
    """A seeded mix of shares and whole cards asking, in all, ``demand`` of the compute of ``nodes`` nodes."""
    import random
    rng = random.Random(seed)
    capacity, asked, out = int(nodes * CARDS * 1000 * demand), 0, []
    while asked < capacity:
        shape = rng.choices(PACK_SHAPES, PACK_WEIGHTS)[0]
        out.append(shape)
        asked += shape[0] or 1000
    return out


def pack_claim(name: str, shape: tuple[int | None, int | None]) -> dict[str, Any]:
    core, memory = shape
    if core is None:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": SHARED_CLASS}}]}}}
    doc = share_claim(name)
    doc["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"] = {"core": str(core), "memory": str(memory)}
    return doc


def packing(api: client.CoreV1Api, resource: client.ResourceV1Api, group: str, nodes: int,
            mix: list[tuple[int | None, int | None]]) -> dict[str, Any]:
    """The mix arriving one pod at a time on ``nodes`` empty tainted nodes of their own; a pod the
    scheduler reports unschedulable is deleted (so it cannot take a later pod's place). Reported:
    pods placed, compute booked, whole cards left free and nodes used."""
    names = [f"pack-{group}-{i:03d}" for i in range(nodes)]
    for name in names:
        make_pack_node(api, resource, name, group)
    ns = f"pack-{group}-{int(time.time() * 1000) % 10**8}"
    api.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    placed, booked = 0, 0
    for i, shape in enumerate(mix):
        name = f"p{i:04d}"
        resource.create_namespaced_resource_claim(ns, pack_claim(name, shape), _preload_content=False)
        doc = claim_pod(name)
        doc["spec"]["nodeSelector"] = {PACK_LABEL: group}
        doc["spec"]["tolerations"] = [{"key": PACK_LABEL, "operator": "Equal", "value": group, "effect": "NoSchedule"}]
        api.create_namespaced_pod(ns, doc, _preload_content=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pod = json.loads(api.read_namespaced_pod(name, ns, _preload_content=False).data)
            if pod["spec"].get("nodeName"):
                placed += 1
                booked += shape[0] or 1000
                break
            if any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
                   for c in (pod.get("status") or {}).get("conditions") or []):
                api.delete_namespaced_pod(name, ns, grace_period_seconds=0, _preload_content=False)
                break
            time.sleep(0.05)
        time.sleep(0.2)  # one arrival at a time: the claim's allocation reaches every watcher
    claims = json.loads(resource.list_namespaced_resource_claim(ns, _preload_content=False).data)["items"]
    used_cards: set[tuple[str, str]] = set()
    for c in claims:
        for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
            used_cards.add((r["pool"], r["device"]))
    return {"nodes": nodes, "cards": nodes * CARDS, "pods": len(mix), "placed": placed,
            "compute_booked_pct": round(100 * booked / (nodes * CARDS * 1000), 1),
            "whole_cards_free": nodes * CARDS - len(used_cards), "nodes_used": len({p for p, _ in used_cards}),
            "empty_nodes": nodes - len({p for p, _ in used_cards})}


def make_pack_node(api: client.CoreV1Api, resource: client.ResourceV1Api, name: str, group: str) -> None:
    resources = {"cpu": "96", "memory": "768Gi", "pods": "250"}
    api.create_node({"apiVersion": "v1", "kind": "Node",
                     "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, PACK_LABEL: group}},
                     "spec": {"taints": [{"key": PACK_LABEL, "value": group, "effect": "NoSchedule"}]}})
    api.patch_node_status(name, {"status": {"capacity": resources, "allocatable": resources,
                                            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}})
    devices = [slice_device(c, "burst-share") for c in cards(CARDS, node=name)]
    resource.create_resource_slice({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                                    "metadata": {"name": slice_name(name)},
                                    "spec": {"driver": DRIVER, "nodeName": name, "devices": devices,
                                             "pool": {"name": name, "generation": 1, "resourceSliceCount": 1}}})


def nodes_used(api: client.CoreV1Api, namespace: str) -> int:
    items = json.loads(api.list_namespaced_pod(namespace, _preload_content=False).data)["items"]
    return len({p["spec"].get("nodeName") for p in items if p["spec"].get("nodeName")})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=300)
    parser.add_argument("--pods", type=int, default=400)
    parser.add_argument("--priority", default="binpack")
    parser.add_argument("--pack-nodes", type=int, default=0,
                        help="also pack a seeded mix one pod at a time on this many empty nodes per DRA arm")
    parser.add_argument("--pack-seed", type=int, default=7)
    parser.add_argument("--pack-demand", type=float, default=0.75, help="compute the mix asks, of the pack nodes' total")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", action="store_true", help="append the table to docs/benchmarks.md")
    args = parser.parse_args()
    cp, version = new_plane("qgpu-drabench-")
    result: dict[str, Any] = {"kubernetes": version, "nodes": args.nodes, "pods": args.pods, "priority": args.priority}
    extender = None
    try:
        cp.start()
        api_client = admin_client(cp)
        api = client.CoreV1Api(api_client)
        resource = client.ResourceV1Api(api_client)
        t = time.perf_counter()
        make_nodes(api, 0, args.nodes)
        publish_dra(resource, args.nodes)
        result["setup_s"] = round(time.perf_counter() - t, 1)
        holds = ("--max-holds", str(max(1000, 2 * args.pods)))

        result["a_no_gpu"] = throughput(cp, api, [], args.pods, make_pod=plain_pod)
        cp.stop_scheduler()

        extender = extender_server(cp, priority=args.priority, assume_timeout=120, extra_args=holds)
        extender.start()
        wait_cached(extender.url, extender.ssl_context(), args.nodes)
        entry = extender.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s")
        result["b_extender"] = throughput(cp, api, [entry], args.pods, extender.process.popen.pid, extender,
                                          make_pod=dialect_pod)
        cp.stop_scheduler()
        extender.stop()
        extender = None

        result["c_dra"] = throughput(cp, api, [], args.pods, make_pod=claim_pod, prepare=claims_for(resource))
        cp.stop_scheduler()

        extender = extender_server(cp, priority=args.priority, assume_timeout=120, extra_args=(*holds, "--dra-prioritize"),
                                   name="qgpu-extender-dra")
        extender.start()
        wait_cached(extender.url, extender.ssl_context(), args.nodes)
        entry = extender.scheduler_config(timeout="30s", weight=PRIORITIZE_WEIGHT)
        entry.update(filterVerb="", bindVerb="", ignorable=True)
        result["d_dra_prioritize"] = throughput(cp, api, [entry], args.pods, extender.process.popen.pid, extender,
                                                make_pod=claim_pod, prepare=claims_for(resource))
        cp.stop_scheduler()
        extender.stop()
        extender = None

        result["a_no_gpu_again"] = throughput(cp, api, [], args.pods, make_pod=plain_pod)
        cp.stop_scheduler()
        base = (result["a_no_gpu"]["pods_per_s"] + result["a_no_gpu_again"]["pods_per_s"]) / 2
        for arm in ("a_no_gpu", "b_extender", "c_dra", "d_dra_prioritize", "a_no_gpu_again"):
            result[arm]["ratio"] = round(result[arm]["pods_per_s"] / base, 3)
            result[arm]["nodes_used"] = nodes_used(api, result[arm]["namespace"])
        if args.pack_nodes:
            mix = pack_mix(args.pack_nodes, args.pack_seed, args.pack_demand)
            result["pack_demand"] = args.pack_demand
            cp.start_scheduler([])
            result["packing"] = {"c_dra": packing(api, resource, "dra", args.pack_nodes, mix)}
            extender = extender_server(cp, priority=args.priority, assume_timeout=120,
                                       extra_args=(*holds, "--dra-prioritize"), name="qgpu-extender-dra")
            extender.start()
            wait_cached(extender.url, extender.ssl_context(), args.nodes)
            entry = extender.scheduler_config(timeout="30s", weight=PRIORITIZE_WEIGHT)  # the new server's port
            entry.update(filterVerb="", bindVerb="", ignorable=True)
            cp.start_scheduler([entry])
            result["packing"]["d_dra_prioritize"] = packing(api, resource, "qgpu", args.pack_nodes, mix)
            cp.stop_scheduler()
    finally:
        if extender is not None:
            extender.stop()
        cp.stop()
    return finish(result, "dra_bench.py", args.json, append_markdown if args.markdown else None)


ARMS = (("a_no_gpu", "(a) no GPU request, no extender (first run)"),
        ("b_extender", "(b) qgpu dialect pods, extender filter+prioritize+bind (HTTPS)"),
        ("c_dra", "(c) DRA, consumable capacity, one ResourceClaim per pod, no extender"),
        ("d_dra_prioritize", "(d) DRA + qgpu prioritize-only (`--dra-prioritize`, weight 10, HTTPS)"),
        ("a_no_gpu_again", "(a) again (last run)"))


def table(r: dict[str, Any]) -> list[str]:
    lines = ["| arm | pods bound/s | ratio to mean (a) | scheduling attempt ms (mean) | algorithm ms (mean) "
             "| extender prioritize ms (mean) | CPU ms per pod, all | nodes used |",
             "|---|---|---|---|---|---|---|---|"]
    for key, label in ARMS:
        a = r[key]
        split = a["time_split"]
        lines.append(f"| {label} | {a['pods_per_s']} | {a['ratio']} | {split.get('scheduler_attempt_ms')} | "
                     f"{split.get('scheduler_algorithm_ms')} | {split.get('extender_prioritize_ms', '-')} | "
                     f"{a['cpu_ms_per_pod']['all']} | {a['nodes_used']} |")
    return lines


def append_markdown(r: dict[str, Any]) -> None:
    lines = ["", f"## qgpu's scheduling paths: extender, DRA, DRA + prioritize ({r['date']})", "",
             f"- Command: `.venv/bin/{r['command']}`",
             f"- Machine: {r['machine']}; {r['kubernetes']}; load average at the end {r['load_average_at_end']}",
             f"- {r['nodes']} fake nodes with {CARDS} cards, {r['pods']} pods per arm, policy {r['priority']}", "",
             *table(r), ""]
    if "packing" in r:
        lines += ["| packing: the same seeded mix (55 % quarter cards, 25 % halves, 20 % whole cards), one pod at a time, "
                  f"on identical empty nodes, asking {round(100 * r['pack_demand'])} % of their compute "
                  "| pods placed of asked | compute booked | whole cards left free | nodes used | nodes left empty |",
                  "|---|---|---|---|---|---|"]
        for key, label in (("c_dra", "(c) DRA alone"), ("d_dra_prioritize", "(d) DRA + qgpu prioritize")):
            pk = r["packing"][key]
            lines.append(f"| {label} ({pk['nodes']} nodes, {pk['cards']} cards) | {pk['placed']} / {pk['pods']} | "
                         f"{pk['compute_booked_pct']} % | {pk['whole_cards_free']} | {pk['nodes_used']} | {pk['empty_nodes']} |")
        lines.append("")
    with (ROOT / "docs" / "benchmarks.md").open("a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
