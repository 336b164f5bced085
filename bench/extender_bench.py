"""Benchmark of the scheduler extender under the real control plane (issue 3, section 6).

1. Throughput: N GPU pods created while no scheduler runs, then kube-scheduler is started and the
   time from the first to the last binding is measured on kube-scheduler's own log of each bind
   (a watch only tells when all are bound: a saturated kube-apiserver closes watchers that fall
   behind, and a watch-timed rate was off by up to 4x, docs/benchmarks.md 2026-11-29). Once without the extender
   (nodes advertise qgpu-core/qgpu-memory in allocatable and the scheduler counts them, like a
   plain device-plugin setup) and once with it (same pods, resources ignoredByScheduler, the
   extender filters, prioritizes and binds). Reported: pods/s of each and their ratio.
2. Latency: filter followed by prioritize for one pod, as kube-scheduler sends them (HTTPS,
   keep-alive, NodeNames form), against the running extender whose cache follows the apiserver, at
   1,000 and at 5,000 nodes. Reported: p50/p99 of the pair as seen by the client, and the server's
   own histogram.

   Every throughput arm also records each process's CPU per pod net of what it spends idle
   (sampled for IDLE_SAMPLE_S before kube-scheduler starts) and kube-apiserver's requests per pod.
   The arm ``with_null_extender`` runs bench/null_extender.py, an extender that decides nothing,
   with the same verbs: ``floor`` splits a pod's CPU into what the extender protocol makes the
   control plane spend, what qgpu adds over that, and each extender's own (issue 14 §2).

3. With ``--peers hami``: HAMi's scheduler extender (v2.10.0, bench/peers/) on the same control
   plane, nodes and pods (in HAMi's resource names): throughput as in 1 (HAMi's default node
   policy binpack, and pods asking it to spread), and its filter latency with all names sent.
   One extender runs at a time. The plain-HTTP and ``best`` variants of qgpu are left out.
4. With ``--pack-nodes N``: packing on N empty nodes per scheduler, the same seeded mix of shares
   and whole cards arriving one by one until the cluster is full: pods placed, compute booked.

5. With --compare-commitments (only this is run): throughput without the extender, then through it
   with node commitments off, always, auto alone (the default with one binder: no Lease writes),
   auto beside a second published binder (it commits), off again, and without it again (issue 11
   §5, issue 23 §2). Reported: pods/s of each, its ratio to the mean no-extender baseline and to
   the mean of the two off runs.

6. With --compare-http2 ROUNDS (only this is run): ROUNDS rounds, each a baseline without the
   extender, then qgpu's extender and the null extender with HTTP/2 offered (`--http2 on`, the
   default) and with HTTP/1.1 only, the arms reversed every other round. Reported per arm: pods/s,
   ratio to its round's baseline, net CPU per pod, connections the extender accepted during the
   run; and HTTP/2 over HTTP/1.1 per round.
7. With --compare-source DIR (only this is run): --rounds rounds, each a baseline without the
   extender, then qgpu's extender from this checkout and from DIR (a worktree of the revision to
   compare with), the two reversed every other round; reported per arm: pods/s, ratio to the
   round's baseline, the extender's own CPU per pod; and this checkout's over DIR's per round.

8. With --compare-floor ROUNDS (only this is run): ROUNDS rounds, each a baseline without the
   extender, then qgpu's extender over HTTP/2, the null extender on qgpu_runtime.serving over
   HTTP/2, and the null extender behind granian (a Rust HTTP/1.1 and HTTP/2 server; mTLS; the
   same handler), the arms reversed every other round: how much of the floor is the Python HTTP/2
   layer. Reported per arm as with --compare-http2.

Run: .venv/bin/python bench/extender_bench.py [--nodes 1000 --big-nodes 5000 --pods 1000 --samples 300]
     [--peers hami --peer-pods 200 --peer-samples 60 --pack-nodes 8] [--pin] [--json out.json]
     .venv/bin/python bench/extender_bench.py --compare-commitments --nodes 100 --pods 300
     .venv/bin/python bench/extender_bench.py --compare-http2 4 --nodes 400 --pods 300
     .venv/bin/python bench/extender_bench.py --compare-floor 2 --nodes 400 --pods 300   # needs granian installed
     git worktree add /tmp/rev REV && .venv/bin/python bench/extender_bench.py --compare-source /tmp/rev --nodes 400 --pods 300
Prints one JSON document; --markdown appends a section to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import os
import platform
import random
import re
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kubernetes import client, config, watch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.peers import hami as hami_peer  # noqa: E402
from bench.peers.hami_nodes import node_allocatable as hami_allocatable  # noqa: E402
from bench.peers.hami_nodes import node_annotations as hami_annotations  # noqa: E402
from bench.peers.hami_nodes import translate_pod  # noqa: E402
from qgpu_runtime.contract.inventory import cards_annotation  # noqa: E402
from qgpu_runtime.model.requests import parse_pod  # noqa: E402
from tests.k8s.controlplane import ControlPlane, QgpuServer, extender_ca, extender_config, extender_server, free_port, testbin_dir  # noqa: E402
from tests.k8s.kubeobjects import MANAGED_RESOURCES, PAUSE, cards  # noqa: E402

CARDS = 8
CORE, MEMORY = "tke.cloud.tencent.com/qgpu-core", "tke.cloud.tencent.com/qgpu-memory"


# --peers hami: fake nodes also carry what HAMi's device plugin would register for the same cards.
HAMI_NODES = False
PACK_LABEL = "qgpu.io/bench-pack"


def make_node(api: client.CoreV1Api, name: str, group: str | None = None) -> None:
    """A fake node with CARDS V100 cards; ``group`` makes it a packing node: labelled and tainted so
    only that group's packing pods land on it."""
    inventory = cards(CARDS, node=name)
    annotations = {"qgpu.io/gpus": cards_annotation(inventory)}
    resources = {"cpu": "96", "memory": "768Gi", "pods": "250", CORE: str(100 * CARDS), MEMORY: str(32 * CARDS)}
    if HAMI_NODES:
        annotations.update(hami_annotations(inventory, datetime.datetime.now()))
        resources.update(hami_allocatable(inventory))
    labels = {"kubernetes.io/hostname": name, **({PACK_LABEL: group} if group else {})}
    spec = {"taints": [{"key": PACK_LABEL, "value": group, "effect": "NoSchedule"}]} if group else {}
    api.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels, "annotations": annotations},
                     "spec": spec})
    api.patch_node_status(name, {"status": {"capacity": resources, "allocatable": resources,
                                            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}})


def make_nodes(api: client.CoreV1Api, start: int, stop: int) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: make_node(api, f"node-{i:05d}"), range(start, stop)))


def pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": PAUSE, "resources": {"limits": {CORE: "25", MEMORY: "4"}}}]}}


def hami_pod(name: str) -> dict[str, Any]:
    """The same pod asking HAMi for the same share (nvidia.com/gpu 1, gpumem 4096, gpucores 25)."""
    qgpu = pod(name)
    return translate_pod(qgpu, parse_pod(qgpu))


def hami_pod_spread(name: str) -> dict[str, Any]:
    """The same, asking HAMi to spread it over nodes (HAMi's per-pod node policy annotation). HAMi
    binds one pod per node at a time (its node lock), so where binpack sends consecutive pods to
    the same node their binds collide and are retried; spread measures HAMi without that."""
    doc = hami_pod(name)
    doc["metadata"]["annotations"] = {"hami.io/node-scheduler-policy": "spread"}
    return doc


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Seconds each throughput arm watches the processes idle before kube-scheduler starts.
IDLE_SAMPLE_S = 2.0
# --pin: (control-plane CPUs, CPUs of the extender and this script), or None to share every core.
PIN: tuple[set[int], set[int]] | None = None


@contextlib.contextmanager
def control_plane_cpus() -> Iterator[None]:
    """Processes spawned inside inherit the control plane's CPUs (with --pin); Go sizes GOMAXPROCS
    from that mask at start. Affinity is per thread: only the calling thread is switched."""
    if PIN is None:
        yield
        return
    os.sched_setaffinity(0, PIN[0])
    try:
        yield
    finally:
        os.sched_setaffinity(0, PIN[1])


def metric_samples(url: str, ctx: ssl.SSLContext | None = None) -> list[Any]:
    """The samples of the Prometheus page at ``url`` (prometheus_client's parser; each has ``name``,
    ``labels`` and ``value``). Without a context, TLS is not verified: the bench's own local plane."""
    import urllib.request
    if ctx is None and url.startswith("https"):
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, context=ctx if url.startswith("https") else None, timeout=10) as r:  # noqa: S310
        text = r.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def scrape(url: str, ctx: ssl.SSLContext | None = None) -> dict[tuple[str, str], float]:
    """Prometheus page of ``url`` as {(sample name, label text): value}; the label text is
    ``k="v"`` pairs joined by commas, in the page's order."""
    out: dict[tuple[str, str], float] = {}
    for sample in metric_samples(url, ctx):
        labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
        out[(sample.name, labels)] = out.get((sample.name, labels), 0.0) + sample.value
    return out


def mean_ms(metrics: dict[tuple[str, str], float], name: str, must: str = "") -> float | None:
    """Mean of a histogram (sum/count) over the series whose labels contain ``must``, in ms."""
    total = sum(v for (n, labels), v in metrics.items() if n == f"{name}_sum" and must in labels)
    count = sum(v for (n, labels), v in metrics.items() if n == f"{name}_count" and must in labels)
    return round(1000 * total / count, 3) if count else None


CONNECTION_COUNTERS = ("qgpu_extender_connections_total", "qgpu_extender_http2_connections_total")


def connection_counts(extender: Any | None) -> dict[str, float]:
    """The extender's connection counters now (empty for an extender without them)."""
    if extender is None:
        return {}
    metrics = scrape(f"{extender.url}/metrics", extender.ssl_context())
    return {name: metrics[(name, "")] for name in CONNECTION_COUNTERS if (name, "") in metrics}


def time_split(cp: ControlPlane, extender: Any | None, connections_before: dict[str, float] | None = None) -> dict[str, Any]:
    """Where a pod's time went: kube-scheduler's own histograms (the scheduling cycle, which is
    serial, and the binding cycle, which is not), and the extender's time per verb as it saw it;
    with ``connections_before``, the connections the extender accepted since (its readiness probes
    before the arm not counted: they were in the totals published before 2026-11-29 afternoon)."""
    sched = scrape(f"https://127.0.0.1:{cp.scheduler_port}/metrics")
    split: dict[str, Any] = {
        "scheduler_algorithm_ms": mean_ms(sched, "scheduler_scheduling_algorithm_duration_seconds"),
        "scheduler_attempt_ms": mean_ms(sched, "scheduler_scheduling_attempt_duration_seconds", 'result="scheduled"'),
        "scheduler_bind_ms": mean_ms(sched, "scheduler_framework_extension_point_duration_seconds", 'extension_point="Bind"'),
    }
    if extender is not None:
        ext = scrape(f"{extender.url}/metrics", extender.ssl_context())
        for verb in ("filter", "prioritize", "bind"):
            split[f"extender_{verb}_ms"] = mean_ms(ext, "qgpu_extender_request_duration_seconds", f'verb="{verb}"')
        if connections_before is not None:
            # one scrape of ours (this one) is a connection of its own
            for name, before in connections_before.items():
                key = "extender_connections" if name == CONNECTION_COUNTERS[0] else "extender_http2_connections"
                split[key] = ext.get((name, ""), before) - before - (1 if key == "extender_connections" else 0)
    return split


def apiserver_requests(api: client.CoreV1Api) -> dict[str, float]:
    """kube-apiserver's request counters (apiserver_request_total) summed by verb, resource and
    subresource, read from its /metrics as the cluster admin."""
    ac = api.api_client
    raw = ac.call_api("GET", ac.configuration.host + "/metrics", header_params=ac.default_headers).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(raw):
        for sample in family.samples:
            if sample.name != "apiserver_request_total":
                continue
            labels = sample.labels
            key = " ".join(filter(None, (labels.get("verb"), labels.get("resource"), labels.get("subresource"))))
            out[key] = out.get(key, 0.0) + sample.value
    return out


# kube-scheduler (started with --v=2) logs each bind as it completes, to the microsecond: the clock
# of record for the rate. The benchmark's own watch is not: on two saturated cores kube-apiserver
# closes watchers that fall behind ("Forcing ... watcher close due to unresponsiveness"), the
# benchmark's included, and binds seen late would be timed late.
BOUND_LINE = re.compile(r'^I\d{4} (\d\d):(\d\d):(\d\d\.\d+)\s+\d+ \S+\] "Successfully bound pod to node" pod="([^"/]+)/')
WATCHER_CLOSED = "watcher close due to unresponsiveness"


def bind_times(log: Path, namespace: str) -> list[float]:
    """When kube-scheduler finished binding each pod of ``namespace``, in seconds of the day as its
    log has them (past midnight the count goes on), sorted."""
    times: list[float] = []
    day = 0.0
    last = -1.0
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        m = BOUND_LINE.match(line)
        if not m:
            continue
        t = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
        if t + day < last - 43200:  # the log passed midnight
            day += 86400
        last = t + day
        if m.group(4) == namespace:
            times.append(last)
    return sorted(times)


def count_lines(log: Path, needle: str) -> int:
    try:
        return sum(needle in line for line in log.read_text(errors="replace").splitlines())
    except OSError:
        return 0


def throughput(cp: ControlPlane, api: client.CoreV1Api, extenders: list[dict[str, Any]], pods: int,
               extender_pid: int | None = None, extender: Any | None = None, *, extender_name: str = "qgpu-extender",
               make_pod: Callable[[str], dict[str, Any]] = pod,
               prepare: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Pods bound per second by a freshly started scheduler facing `pods` pending pods, and the CPU
    each process spent per bound pod meanwhile (on a small machine CPU is what bounds the rate).
    ``prepare(namespace, pods)`` runs before the pods are created (e.g. their ResourceClaims)."""
    cp.stop_scheduler()
    ns = f"bench-{int(time.time() * 1000) % 10**8}"
    api.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    if prepare is not None:
        prepare(ns, pods)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: api.create_namespaced_pod(ns, make_pod(f"p{i:05d}"), _preload_content=False), range(pods)))
    bound_at: dict[str, float] = {}
    done = threading.Event()
    version = json.loads(api.list_namespaced_pod(ns, _preload_content=False).data)["metadata"]["resourceVersion"]

    def follow() -> None:
        # Only tells when every pod is bound (the rate is timed from kube-scheduler's log). A watch
        # that kube-apiserver closes is followed again from the last version it delivered.
        seen = version
        try:
            while not done.is_set():
                w = watch.Watch()
                for event in w.stream(api.list_namespaced_pod, ns, resource_version=seen, deserialize=False, timeout_seconds=600):
                    obj = event["object"]
                    if event.get("type") == "ERROR":
                        raise RuntimeError(f"watch error: {obj.get('message') or obj}")
                    seen = obj["metadata"].get("resourceVersion") or seen
                    name = obj["metadata"]["name"]
                    if obj["spec"].get("nodeName") and name not in bound_at:
                        bound_at[name] = time.perf_counter()
                        if len(bound_at) == pods:
                            done.set()
                            w.stop()
                done.wait(0.05)  # closed: follow again, but never in a tight loop
        except Exception as exc:  # noqa: BLE001 - reported; the list below still finds the bound pods
            print(f"watch failed: {exc!r}", file=sys.stderr)

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    time.sleep(0.5)
    pids = {name: cp.processes[name].popen.pid for name in ("etcd", "kube-apiserver")}
    if extender_pid is not None:
        pids[extender_name] = extender_pid
    # What each process spends idle (leader-election renewals, watches' bookmarks, etcd's ticks) is
    # spent per second, not per pod: measured here, it is taken out of the net figures below.
    idle_from = {name: cpu_seconds(pid) for name, pid in pids.items()}
    idle_t = time.perf_counter()
    time.sleep(IDLE_SAMPLE_S)
    idle_rate = {name: (cpu_seconds(pid) - idle_from[name]) / (time.perf_counter() - idle_t) for name, pid in pids.items()}
    requests_before = apiserver_requests(api)
    connections_before = connection_counts(extender)
    apiserver_log = cp.processes["kube-apiserver"].log
    closed_before = count_lines(apiserver_log, WATCHER_CLOSED)
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    started = time.perf_counter()
    with control_plane_cpus():
        scheduler = cp.start_scheduler(extenders, qps=5000)
    pids["kube-scheduler"] = scheduler.popen.pid
    cpu_before["kube-scheduler"] = 0.0
    deadline = time.perf_counter() + 600
    while not done.wait(2.0) and time.perf_counter() < deadline:
        # Belt and braces: a watch can drop; the list is the truth about who is bound.
        items = json.loads(api.list_namespaced_pod(ns, _preload_content=False).data)["items"]
        now = time.perf_counter()
        for item in items:
            if item["spec"].get("nodeName"):
                bound_at.setdefault(item["metadata"]["name"], now)
        if len(bound_at) >= pods:
            done.set()
    finished = len(bound_at) >= pods
    elapsed = time.perf_counter() - started
    cpu = {name: round((cpu_seconds(pid) - cpu_before[name]) * 1000 / pods, 2) for name, pid in pids.items()}
    net = {name: round(max(0.0, used - idle_rate.get(name, 0.0) * elapsed * 1000 / pods), 2) for name, used in cpu.items()}
    requests_after = apiserver_requests(api)
    per_pod = {key: round((n - requests_before.get(key, 0.0)) / pods, 2) for key, n in requests_after.items()}
    times = sorted(bound_at.values())
    if not finished or len(times) < 2:
        raise RuntimeError(f"only {len(times)}/{pods} pods bound within 600 s")
    logged = bind_times(scheduler.log, ns)
    if len(logged) != pods:
        raise RuntimeError(f"kube-scheduler's log has {len(logged)} of the {pods} binds of {ns} (is it still at --v=2?)")
    span = logged[-1] - logged[0]
    split = time_split(cp, extender, connections_before)
    return {"pods": pods, "time_split": split, "first_bind_after_start_s": round(times[0] - started, 3), "span_s": round(span, 3),
            "pods_per_s": round((len(logged) - 1) / span, 1), "namespace": ns,
            # as the benchmark's watch saw them (before 2026-11-29 the rate was timed so)
            "watch_span_s": round(times[-1] - times[0], 3),
            "watchers_closed_by_apiserver": count_lines(apiserver_log, WATCHER_CLOSED) - closed_before,
            "cpu_ms_per_pod": {**cpu, "all": round(sum(cpu.values()), 2)},
            "idle_cpu_ms_per_s": {name: round(rate * 1000, 1) for name, rate in idle_rate.items()},
            "net_cpu_ms_per_pod": {**net, "all": round(sum(net.values()), 2)},
            # the bench's own list/watch calls included (the same in every arm)
            "apiserver_requests_per_pod": {key: n for key, n in sorted(per_pod.items()) if n >= 0.01}}


CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-scheduler")


def protocol_floor(result: dict[str, Any]) -> dict[str, Any]:
    """Where the CPU of a pod placed through an extender goes, against the baseline (ms per pod, net
    of each process's idle CPU): what the protocol makes the control plane spend (the null
    extender's arm), what qgpu adds on the control plane's side over that (its watches, its Lease
    write, the allocation record on the Binding), and each extender's own. On a machine whose cores
    the control plane already fills, the rate follows CPU per pod, so ``zero_cpu_extender_ratio``
    is the ratio an extender costing nothing could reach."""
    def cpu(arm: str, name: str) -> float:
        doc = result[arm]
        return float(doc.get("net_cpu_ms_per_pod", doc["cpu_ms_per_pod"]).get(name, 0.0))

    def cp(arm: str) -> float:
        return sum(cpu(arm, name) for name in CONTROL_PLANE)

    base = (cp("without_extender") + cp("without_extender_again")) / 2
    by_process = {arm: {name: round(cpu(arm, name) - (cpu("without_extender", name) + cpu("without_extender_again", name)) / 2, 2)
                        for name in CONTROL_PLANE} for arm in ("with_null_extender", "with_extender")}
    forced = cp("with_null_extender") - base
    return {"baseline_control_plane_ms": round(base, 2),
            "protocol_control_plane_ms": round(forced, 2),
            "qgpu_control_plane_over_protocol_ms": round(cp("with_extender") - cp("with_null_extender"), 2),
            "null_extender_own_ms": round(cpu("with_null_extender", "null-extender"), 2),
            "qgpu_extender_own_ms": round(cpu("with_extender", "qgpu-extender"), 2),
            "over_baseline_by_process_ms": by_process,
            "zero_cpu_extender_ratio": round(base / (base + forced), 3) if base + forced > 0 else None}


def null_extender_server(cp: ControlPlane) -> QgpuServer:
    """bench/null_extender.py as kube-scheduler meets qgpu's extender: HTTPS, client certificates."""
    port = free_port()
    ca = extender_ca(cp)
    pair = ca.issue("null-extender", "null-extender", server=True, hosts=("127.0.0.1", "localhost"))
    scheduler = ca.issue("kube-scheduler", "system:kube-scheduler", client=True)
    argv = ["--port", str(port), "--kubeconfig", str(cp.admin_kubeconfig), "--tls-cert-file", str(pair.cert),
            "--tls-private-key-file", str(pair.key), "--client-ca-file", str(ca.cert_path)]
    return QgpuServer("null-extender", argv, cp.workdir, port, "https", ca.cert_path, client_cert=scheduler,
                      module="bench.null_extender")


def latency_pods(api: client.CoreV1Api, count: int) -> list[dict[str, Any]]:
    """Pending pods the apiserver has (the extender refuses filters for any other), which no
    scheduler picks up (their schedulerName has none)."""
    namespace = f"bench-latency-{time.time_ns()}"
    api.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    out = []
    for i in range(count):
        body = {**pod(f"lat-{i}"), "metadata": {"name": f"lat-{i}", "namespace": namespace}}
        body["spec"] = {**body["spec"], "schedulerName": "nobody"}
        out.append(api.api_client.sanitize_for_serialization(api.create_namespaced_pod(namespace, body)))
    return out


def latency(extender: Any, api: client.CoreV1Api, node_names: list[str], samples: int) -> dict[str, Any]:
    """filter+prioritize round trips for one pod each, over one keep-alive HTTPS connection."""
    host, port = extender.url.removeprefix("https://").split(":")
    conn = http.client.HTTPSConnection(host, int(port), context=extender.ssl_context(), timeout=30)
    pairs, filters, prioritizes = [], [], []
    for i, real in enumerate(latency_pods(api, samples + 20)):
        body = json.dumps({"Pod": real, "Nodes": None, "NodeNames": node_names}).encode()
        timings = []
        for verb in ("filter", "prioritize"):
            t = time.perf_counter()
            conn.request("POST", f"/{verb}", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            timings.append(time.perf_counter() - t)
            if response.status != 200:
                raise RuntimeError(f"{verb}: {response.status} {data[:200]!r}")
        if i >= 20:  # warm-up excluded
            filters.append(timings[0])
            prioritizes.append(timings[1])
            pairs.append(sum(timings))
    conn.close()

    def pct(values: list[float], q: float) -> float:
        return round(1000 * statistics.quantiles(values, n=100, method="inclusive")[q - 1], 2)

    return {"samples": samples, "nodes": len(node_names),
            "filter_plus_prioritize_ms": {"p50": pct(pairs, 50), "p99": pct(pairs, 99)},
            "filter_ms": {"p50": pct(filters, 50), "p99": pct(filters, 99)},
            "prioritize_ms": {"p50": pct(prioritizes, 50), "p99": pct(prioritizes, 99)}}


def hami_latency(api: client.CoreV1Api, hami: hami_peer.HamiScheduler, node_names: list[str], samples: int) -> dict[str, Any]:
    """HAMi's filter for one pod each, over one keep-alive HTTPS connection, as kube-scheduler sends
    it. HAMi's filter writes its choice onto the pod (annotations through the apiserver) and books
    it, so every sample is a real pending pod of its own (no scheduler runs meanwhile)."""
    ns = f"bench-hami-lat-{int(time.time() * 1000) % 10**8}"
    api.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    names = [f"lat-{i:05d}" for i in range(samples + 20)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: api.create_namespaced_pod(ns, hami_pod(n), _preload_content=False), names))
    items = {item["metadata"]["name"]: item for item in json.loads(api.list_namespaced_pod(ns, _preload_content=False).data)["items"]}
    host, port = hami.url.removeprefix("https://").split(":")
    conn = http.client.HTTPSConnection(host, int(port), context=ssl.create_default_context(cafile=str(hami.ca_file)), timeout=60)
    filters, chosen = [], 0
    for i, name in enumerate(names):
        item = {**items[name], "apiVersion": "v1", "kind": "Pod"}
        body = json.dumps({"Pod": item, "Nodes": None, "NodeNames": node_names}).encode()
        t = time.perf_counter()
        conn.request("POST", "/filter", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        elapsed = time.perf_counter() - t
        result = json.loads(data) if response.status == 200 else {}
        if response.status != 200 or result.get("Error"):
            raise RuntimeError(f"HAMi filter: {response.status} {data[:300]!r}")
        chosen += len(result.get("NodeNames") or [])
        if i >= 20:  # warm-up excluded
            filters.append(elapsed)
    conn.close()
    if chosen != len(names):
        raise RuntimeError(f"HAMi filter chose a node for {chosen} of {len(names)} pods")

    def pct(values: list[float], q: int) -> float:
        return round(1000 * statistics.quantiles(values, n=100, method="inclusive")[q - 1], 2)

    return {"samples": samples, "nodes": len(node_names), "filter_ms": {"p50": pct(filters, 50), "p99": pct(filters, 99)}}


# Packing: a mix of shares and whole cards, in qgpu's names; the HAMi arm asks for the same shares
# in HAMi's names. Weights are relative frequencies.
PACK_SHAPES: tuple[tuple[dict[str, str], int], ...] = (
    ({CORE: "10", MEMORY: "2"}, 3),
    ({CORE: "25", MEMORY: "4"}, 4),
    ({CORE: "50", MEMORY: "8"}, 3),
    ({CORE: "30", MEMORY: "16"}, 1),
    ({CORE: "100"}, 2),
    ({CORE: "200"}, 1),
)


def pack_cores(limits: dict[str, str]) -> int:
    """Percent of one card's compute a packing shape books (whole cards: 100 each)."""
    return int(limits[CORE])


def pack_mix(nodes: int, seed: int, demand: float) -> list[dict[str, str]]:
    """Shapes drawn (seeded) until their compute reaches ``demand`` times the group's cards."""
    rng = random.Random(seed)
    shapes, weights = zip(*PACK_SHAPES)
    out: list[dict[str, str]] = []
    total, capacity = 0, demand * nodes * CARDS * 100
    while total < capacity:
        shape = rng.choices(shapes, weights)[0]
        out.append(shape)
        total += pack_cores(shape)
    return out


def pack_pod(name: str, group: str, limits: dict[str, str], hami: bool) -> dict[str, Any]:
    doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"terminationGracePeriodSeconds": 0, "nodeSelector": {PACK_LABEL: group},
                    "tolerations": [{"key": PACK_LABEL, "operator": "Equal", "value": group, "effect": "NoSchedule"}],
                    "containers": [{"name": "c", "image": PAUSE, "resources": {"limits": dict(limits)}}]}}
    return translate_pod(doc, parse_pod(doc)) if hami else doc


def packing(cp: ControlPlane, api: client.CoreV1Api, extenders: list[dict[str, Any]], group: str, nodes: int,
            mix: list[dict[str, str]], hami: bool) -> dict[str, Any]:
    """Pods arrive one by one (each is bound or found unschedulable before the next is created), so
    both schedulers see the same pods in the same order on identical, initially empty nodes; then
    pods that failed get a last chance while the queue drains. Reported: pods placed, and the share
    of the group's compute they booked."""
    cp.stop_scheduler()
    ns = f"pack-{group}-{int(time.time() * 1000) % 10**8}"
    api.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    with control_plane_cpus():
        cp.start_scheduler(extenders, qps=5000)
    started = time.perf_counter()
    for i, limits in enumerate(mix):
        name = f"p{i:04d}"
        api.create_namespaced_pod(ns, pack_pod(name, group, limits, hami), _preload_content=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            doc = json.loads(api.read_namespaced_pod(name, ns, _preload_content=False).data)
            if doc["spec"].get("nodeName"):
                break
            if any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in doc.get("status", {}).get("conditions") or []):
                break
            time.sleep(0.02)
    arrival_s = time.perf_counter() - started

    def bound() -> dict[str, str]:
        items = json.loads(api.list_namespaced_pod(ns, _preload_content=False).data)["items"]
        return {item["metadata"]["name"]: item["spec"]["nodeName"] for item in items if item["spec"].get("nodeName")}

    placed, still = bound(), 0
    while still < 5:  # settle: five seconds without a new binding
        time.sleep(1.0)
        now = bound()
        still = still + 1 if len(now) == len(placed) else 0
        placed = now
    cp.stop_scheduler()
    booked = sum(pack_cores(mix[int(name[1:])]) for name in placed)
    by_shape: dict[str, list[int]] = {}
    for i, limits in enumerate(mix):
        key = "+".join(f"{k.rsplit('-', 1)[-1]}={v}" for k, v in sorted(limits.items()))
        entry = by_shape.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += f"p{i:04d}" in placed
    return {"nodes": nodes, "cards": nodes * CARDS, "pods": len(mix), "placed": len(placed),
            "compute_booked_pct": round(100 * booked / (nodes * CARDS * 100), 1),
            "arrival_s": round(arrival_s, 1), "by_shape_asked_placed": by_shape}


def scheduler_sample(nodes: int) -> int:
    """How many feasible nodes kube-scheduler passes on with its default (adaptive)
    percentageOfNodesToScore: 50% minus 1% per 125 nodes, at least 5%, at least 100 nodes."""
    if nodes < 100:
        return nodes
    percentage = max(5, 50 - nodes // 125)
    return max(100, nodes * percentage // 100)


def wait_cached(url: str, ctx: ssl.SSLContext | None, nodes: int) -> None:
    import urllib.request
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/metrics", context=ctx, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("qgpu_extender_cached_nodes ") and float(line.split()[1]) >= nodes:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"extender cache did not reach {nodes} nodes")


def new_plane(prefix: str) -> tuple[ControlPlane, str]:
    """A control plane (not started) in a fresh temporary directory, and its Kubernetes version."""
    cp = ControlPlane(testbin_dir(build=True), Path(tempfile.mkdtemp(prefix=prefix)))
    version = subprocess.run([str(cp.bindir / "kube-apiserver"), "--version"], capture_output=True, text=True).stdout.strip()
    return cp, version


def admin_client(cp: ControlPlane) -> client.ApiClient:
    """The started plane's admin client, with qgpu-system created: the extender's Lease
    commitments live in its namespace (issue 21 §3), which the roles create."""
    api_client = config.new_client_from_config(config_file=str(cp.admin_kubeconfig))
    client.CoreV1Api(api_client).create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "qgpu-system"}})
    return api_client


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python {platform.python_version()}"


def finish(result: dict[str, Any], script: str, json_path: Path | None = None,
           markdown: Callable[[dict[str, Any]], None] | None = None) -> int:
    """The end of a benchmark run: where and when it ran and how, printed as one JSON document,
    written to ``json_path`` and handed to ``markdown`` when asked."""
    result["machine"] = machine()
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result["command"] = f"python bench/{script} " + " ".join(sys.argv[1:])
    print(json.dumps(result, indent=2))
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    if markdown is not None:
        markdown(result)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--big-nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--priority", default="binpack", choices=("binpack", "spread", "frag"))
    parser.add_argument("--markdown", action="store_true", help="append the results to docs/benchmarks.md")
    parser.add_argument("--json", type=Path, help="also write the result document to this file")
    parser.add_argument("--pin", action="store_true",
                        help="etcd, kube-apiserver and kube-scheduler on CPU 0, the extender and this script on the "
                             "others (the extender on cores of its own, as in its own pod on a bigger control-plane node)")
    parser.add_argument("--compare-commitments", action="store_true",
                        help="only compare throughput with node commitments off, on and off again")
    parser.add_argument("--compare-source", type=Path, metavar="DIR",
                        help="only compare qgpu's extender from this checkout with the one from DIR (another checkout "
                             "or worktree of the project), --rounds rounds, each with its own baseline")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of --compare-source (default 4)")
    parser.add_argument("--compare-http2", type=int, default=0, metavar="ROUNDS",
                        help="only compare throughput with HTTP/2 offered and with HTTP/1.1 only, qgpu's extender and the "
                             "null one, over ROUNDS rounds each with its own baseline")
    parser.add_argument("--compare-floor", type=int, default=0, metavar="ROUNDS",
                        help="only compare qgpu's extender with the null extender on qgpu's server and behind granian "
                             "(HTTP/2), over ROUNDS rounds each with its own baseline")
    parser.add_argument("--peers", default="", help="comma-separated peer schedulers to run beside qgpu's extender: hami "
                        "(built by bench/peers/hami-build). With a peer, the plain-HTTP and `best` variants are left out")
    parser.add_argument("--peer-pods", type=int, help="pods per throughput run with peers (default: --pods), for every arm")
    parser.add_argument("--peer-samples", type=int, default=60,
                        help="filter calls per latency figure for a peer (HAMi's filter takes up to a second at 5,000 nodes)")
    parser.add_argument("--pack-nodes", type=int, default=0,
                        help="packing comparison on this many nodes per scheduler (0: none)")
    parser.add_argument("--pack-demand", type=float, default=1.25, help="packing pods' compute / the group's compute")
    parser.add_argument("--pack-seed", type=int, default=42)
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    for peer in peers:
        if peer != "hami":
            parser.error(f"--peers: {peer!r} is not a known peer; known: hami")
    for name in ("nodes", "pods", "samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: {getattr(args, name)} is not allowed: must be >= 1")
    if args.pack_nodes < 0 or (args.peer_pods is not None and args.peer_pods < 1):
        parser.error("--pack-nodes must be >= 0 and --peer-pods >= 1")
    global PIN, HAMI_NODES
    HAMI_NODES = "hami" in peers
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            parser.error("--pin needs at least 2 CPUs")
        PIN = ({cpus[0]}, set(cpus[1:]))
        os.sched_setaffinity(0, PIN[1])
    pods = args.peer_pods or args.pods if peers else args.pods
    # Every arm's pods stay bound (each arm has a namespace of its own): the nodes must hold them
    # all, or an arm waits out its 600 s for pods that cannot fit.
    # (with peers, the plain-HTTP and best arms are left out and HAMi's pods ask HAMi's resources)
    if args.compare_source is not None:
        if not (args.compare_source / "qgpu_runtime" / "cli.py").is_file():
            parser.error(f"--compare-source {args.compare_source}: not a checkout of this project (no qgpu_runtime/cli.py in it)")
        if args.compare_source.resolve() == ROOT.resolve():
            parser.error(f"--compare-source {args.compare_source}: is this checkout; name another one (a worktree of the "
                         "revision to compare with: git worktree add DIR REV)")
        if args.rounds < 1 or args.compare_http2 or args.compare_commitments:
            parser.error("--compare-source: --rounds must be >= 1, and it runs alone (not with --compare-http2 or "
                         "--compare-commitments)")
    if args.compare_http2 < 0 or args.compare_floor < 0:
        parser.error("--compare-http2, --compare-floor: must be >= 1 (rounds), or 0 for the full benchmark")
    arms = (len(COMMITMENT_ARMS) + 2 if args.compare_commitments else
            (len(FLOOR_ARMS) + 1) * args.compare_floor if args.compare_floor else
            (len(HTTP2_ARMS) + 1) * args.compare_http2 if args.compare_http2 else
            (len(SOURCE_ARMS) + 1) * args.rounds if args.compare_source is not None else (4 if peers else 6))
    per_node = min(100 * CARDS // 25, 32 * CARDS // 4, 250)  # each pod asks qgpu-core 25, qgpu-memory 4
    if arms * pods > args.nodes * per_node:
        parser.error(f"--pods {pods} in {arms} throughput arms needs room for {arms * pods} pods; --nodes {args.nodes} "
                     f"hold {args.nodes * per_node} ({per_node} each): raise --nodes to at least "
                     f"{-(-arms * pods // per_node)} or lower --pods")
    hami_binary = hami_peer.build() if HAMI_NODES else None  # before the clock starts: cached after the first time

    if args.compare_commitments:
        return compare_commitments(args)
    if args.compare_http2:
        return compare_http2(args)
    if args.compare_floor:
        return compare_floor(args)
    if args.compare_source is not None:
        return compare_source(args)
    cp, version = new_plane("qgpu-bench-")
    extender = None
    hami: hami_peer.HamiScheduler | None = None
    result: dict[str, Any] = {"kubernetes": version, "priority": args.priority, "peers": peers}

    def checkpoint() -> None:
        """A long run keeps what it measured so far if it is stopped (--json only)."""
        if args.json:
            args.json.write_text(json.dumps({**result, "partial": True}, indent=2) + "\n")
    try:
        with control_plane_cpus():
            cp.start()
        api = client.CoreV1Api(config.new_client_from_config(config_file=str(cp.admin_kubeconfig)))
        # The extender's Lease commitments live in its namespace (qgpu-system, issue 21 §3), which the roles create.
        api.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "qgpu-system"}})
        t = time.perf_counter()
        make_nodes(api, 0, args.nodes)
        groups = ["qgpu"] + (["hami"] if HAMI_NODES else []) if args.pack_nodes else []
        for group in groups:
            for i in range(args.pack_nodes):
                make_node(api, f"pack-{group}-{i:03d}", group)
        result["node_creation_s"] = round(time.perf_counter() - t, 1)
        result["without_extender"] = throughput(cp, api, [], pods)
        # the latency samples hold cards for up to samples + 20 pods at once
        holds = ("--max-holds", str(max(1000, 2 * args.samples + 100)))
        extender = extender_server(cp, priority=args.priority, assume_timeout=120, extra_args=holds)
        extender.start()
        ext = [extender.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s")]
        result["with_extender"] = throughput(cp, api, ext, pods, extender.process.popen.pid, extender)
        checkpoint()
        cp.stop_scheduler()
        variants = ["with_extender"]
        if not peers:
            plain = extender_server(cp, priority=args.priority, assume_timeout=120, tls=False, extra_args=holds)
            extender.stop()
            plain.start()
            result["with_extender_plain_http"] = throughput(
                cp, api, [extender_config(plain.url, ca_file=None, managed_resources=MANAGED_RESOURCES, timeout="30s")], pods,
                plain.process.popen.pid, plain)
            cp.stop_scheduler()
            plain.stop()
            best = extender_server(cp, priority=args.priority, assume_timeout=120, filter_result="best", extra_args=holds)
            best.start()
            result["with_extender_best_filter"] = throughput(
                cp, api, [best.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s", prioritize=False)],
                pods, best.process.popen.pid, best)
            best.stop()
            variants += ["with_extender_plain_http", "with_extender_best_filter"]
        # One scheduler extender at a time: an idle one still follows every node and pod change
        # (HAMi's node locks and annotations included) on the same two cores.
        extender.stop()
        # The protocol's floor: an extender that decides nothing (bench/null_extender.py), same verbs.
        null = null_extender_server(cp)
        null.start()
        result["with_null_extender"] = throughput(
            cp, api, [null.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s")], pods, null.process.popen.pid,
            None, extender_name="null-extender")
        cp.stop_scheduler()
        null.stop()
        variants.append("with_null_extender")
        checkpoint()
        mix = pack_mix(args.pack_nodes, args.pack_seed, args.pack_demand) if args.pack_nodes else []
        if hami_binary is not None:
            pair = cp.ca.issue("hami", "hami-scheduler", server=True, hosts=("127.0.0.1", "localhost"))
            hami = hami_peer.HamiScheduler(hami_binary, cp.workdir, cp.admin_kubeconfig, pair.cert, pair.key, cp.ca.cert_path,
                                           free_port(), free_port())
            hami.start()
            all_nodes = {f"node-{i:05d}" for i in range(args.nodes)} | {f"pack-hami-{i:03d}" for i in range(args.pack_nodes)}
            result["hami_registration_s"] = round(hami.wait_registered(all_nodes), 1)
            result["with_hami"] = throughput(cp, api, [hami_peer.scheduler_extender(hami)], pods, hami.pid, None,
                                             extender_name="hami-scheduler", make_pod=hami_pod)
            result["with_hami_spread"] = throughput(cp, api, [hami_peer.scheduler_extender(hami)], pods, hami.pid, None,
                                                    extender_name="hami-scheduler", make_pod=hami_pod_spread)
            cp.stop_scheduler()
            variants += ["with_hami", "with_hami_spread"]
            checkpoint()
            if mix:
                result["packing"] = {"hami": packing(cp, api, [hami_peer.scheduler_extender(hami)], "hami", args.pack_nodes, mix,
                                                     hami=True)}
                checkpoint()
            hami.stop()
        # The machine may be shared: measure the baseline again and compare with the mean of both.
        result["without_extender_again"] = throughput(cp, api, [], pods)
        base = (result["without_extender"]["pods_per_s"] + result["without_extender_again"]["pods_per_s"]) / 2
        for variant in variants:
            result[f"ratio_{variant}"] = round(result[variant]["pods_per_s"] / base, 3)
        result["floor"] = protocol_floor(result)
        checkpoint()
        cp.stop_scheduler()
        extender.start()
        if mix:
            result.setdefault("packing", {})["qgpu"] = packing(cp, api, ext, "qgpu", args.pack_nodes, mix, hami=False)
            checkpoint()
        result["latency"] = []
        result["hami_latency"] = []
        for total in [args.nodes] + ([args.big_nodes] if args.big_nodes > args.nodes else []):
            if total > args.nodes:
                make_nodes(api, args.nodes, total)
            wait_cached(extender.url, extender.ssl_context(), total)
            for sent in sorted({total, scheduler_sample(total)}):
                names = [f"node-{i:05d}" for i in range(sent)]
                result["latency"].append({"cluster_nodes": total, **latency(extender, api, names, args.samples)})
            checkpoint()
            if hami is not None:
                # HAMi alone (qgpu's extender stopped); all names only: its filter costs up to seconds a
                # call here, and it builds the usage of every node it knows whatever names it is sent.
                extender.stop()
                hami.start()
                result.setdefault("hami_registration_s_by_nodes", {})[str(total)] = round(
                    hami.wait_registered({f"node-{i:05d}" for i in range(total)}, timeout=600), 1)
                names = [f"node-{i:05d}" for i in range(total)]
                result["hami_latency"].append({"cluster_nodes": total, **hami_latency(api, hami, names, args.peer_samples)})
                checkpoint()
                hami.stop()
                extender.start()
    finally:
        if hami is not None:
            hami.stop()
        if extender is not None:
            extender.stop()
        cp.stop()
    result["cpus"] = "shared" if PIN is None else {"control_plane": sorted(PIN[0]), "extender_and_bench": sorted(PIN[1])}
    return finish(result, "extender_bench.py", args.json,
                  (append_peer_markdown if peers else append_markdown) if args.markdown else None)


COMMITMENT_ARMS = (
    ("commitments_off", ["--node-commitments=off"]),
    ("commitments_always", ["--node-commitments=always"]),
    ("commitments_auto", ["--node-commitments=auto"]),  # the default, one binder: no Lease writes
    ("commitments_auto_two_binders", ["--node-commitments=auto"]),  # a second binder published: it commits
    ("commitments_off_again", ["--node-commitments=off"]),
)


@contextlib.contextmanager
def second_binder(cp: ControlPlane) -> Iterator[None]:
    """A second binder's presence in qgpu-system's binders' Lease, renewed until the block ends: the
    extender then commits every bind as it does beside a second extender (extender/presence.py).
    It binds nothing itself."""
    from qgpu_runtime.contract.names import BINDERS
    from qgpu_runtime.extender.presence import BinderPresence
    from qgpu_runtime.kube.leasedoc import LeaseDocuments

    coordination = client.CoordinationV1Api(config.new_client_from_config(config_file=str(cp.admin_kubeconfig)))
    presence = BinderPresence(LeaseDocuments(coordination, "qgpu-system", BINDERS, {}), "bench-second-binder", "always",
                              flush=lambda recent: None)
    stop = threading.Event()
    thread = threading.Thread(target=presence.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        presence.leave()


def compare_commitments(args: argparse.Namespace) -> int:
    """Throughput without the extender, then through it with node commitments off, always, auto
    alone, auto beside a second binder, and off again (one control plane, the same nodes; each run
    has its own namespace and fills its own share of the cards), then without it again."""
    cp, version = new_plane("qgpu-bench-")
    result: dict[str, Any] = {"kubernetes": version, "priority": args.priority, "nodes": args.nodes, "pods": args.pods}
    try:
        cp.start()
        api = client.CoreV1Api(config.new_client_from_config(config_file=str(cp.admin_kubeconfig)))
        api.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "qgpu-system"}})
        make_nodes(api, 0, args.nodes)
        result["without_extender"] = throughput(cp, api, [], args.pods)
        for key, flags in COMMITMENT_ARMS:
            extender = extender_server(cp, priority=args.priority, assume_timeout=120, extra_args=flags)
            extender.start()
            try:
                with second_binder(cp) if key.endswith("two_binders") else contextlib.nullcontext():
                    wait_cached(extender.url, extender.ssl_context(), args.nodes)
                    ext = [extender.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s")]
                    result[key] = throughput(cp, api, ext, args.pods, extender.process.popen.pid, extender)
            finally:
                cp.stop_scheduler()
                extender.stop()
        result["without_extender_again"] = throughput(cp, api, [], args.pods)
        base = (result["without_extender"]["pods_per_s"] + result["without_extender_again"]["pods_per_s"]) / 2
        off = (result["commitments_off"]["pods_per_s"] + result["commitments_off_again"]["pods_per_s"]) / 2
        for key, _ in COMMITMENT_ARMS:
            result[key]["ratio_to_baseline"] = round(result[key]["pods_per_s"] / base, 3)
            result[key]["ratio_to_off"] = round(result[key]["pods_per_s"] / off, 3)
    finally:
        cp.stop()
    return finish(result, "extender_bench.py", args.json, commitments_markdown if args.markdown else None)


HTTP2_ARMS = ("qgpu_http2", "qgpu_http1", "null_http2", "null_http1")


def arm_means(rounds: list[dict[str, Any]], arm: str, own: str) -> dict[str, Any] | None:
    """One arm of paired rounds: pods/s and net CPU per pod (all processes; ``own``, the extender's
    process) as the mean over the rounds that ran it, and the ratio to each round's own baseline;
    None when no round ran it."""
    runs = [r[arm] for r in rounds if arm in r]
    if not runs:
        return None
    return {"pods_per_s": round(statistics.mean(a["pods_per_s"] for a in runs), 1),
            "ratio_to_baseline": round(statistics.mean(r[arm]["pods_per_s"] / r["without_extender"]["pods_per_s"]
                                                       for r in rounds if arm in r), 3),
            "cpu_ms_per_pod_all": round(statistics.mean(a["net_cpu_ms_per_pod"]["all"] for a in runs), 2),
            "cpu_ms_per_pod_extender": round(statistics.mean(a["net_cpu_ms_per_pod"].get(own, 0.0) for a in runs), 2),
            "connections": [a.get("time_split", {}).get("extender_connections") for a in runs]}


def http2_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm of ``--compare-http2``: pods/s and net CPU per pod (all processes; the extender's
    own) as the mean over the rounds, the ratio to each round's own baseline, and HTTP/2 over
    HTTP/1.1 per round (paired, so the machine's drift between rounds cancels)."""
    out: dict[str, Any] = {}
    for arm in HTTP2_ARMS:
        means = arm_means(rounds, arm, "qgpu-extender" if arm.startswith("qgpu") else "null-extender")
        if means is not None:
            out[arm] = means
    for kind in ("qgpu", "null"):
        pairs = [(r[f"{kind}_http2"]["pods_per_s"], r[f"{kind}_http1"]["pods_per_s"]) for r in rounds
                 if f"{kind}_http2" in r and f"{kind}_http1" in r]
        if pairs:
            out[f"{kind}_http2_over_http1"] = [round(a / b, 3) for a, b in pairs]
    return out


def paired_rounds(args: argparse.Namespace, rounds: int, arms: tuple[str, ...],
                  server_for: Callable[[ControlPlane, str, tuple[str, ...]], tuple[QgpuServer, str | None]],
                  **about: Any) -> dict[str, Any]:
    """``rounds`` rounds on one control plane, each a baseline without the extender and then one
    run per arm, the arms' order reversed every other round (paired within a round, so the
    machine's drift between rounds cancels). ``server_for(cp, arm, holds)`` gives the arm's server
    and the name of its process in the CPU figures (None: qgpu's extender, whose metrics are read)."""
    cp, version = new_plane("qgpu-bench-")
    result: dict[str, Any] = {"kubernetes": version, "priority": args.priority, "nodes": args.nodes, "pods": args.pods,
                              **about, "rounds": []}
    holds = ("--max-holds", str(max(1000, args.pods)))
    try:
        with control_plane_cpus():
            cp.start()
        api = client.CoreV1Api(admin_client(cp))
        make_nodes(api, 0, args.nodes)
        for n in range(rounds):
            round_: dict[str, Any] = {"without_extender": throughput(cp, api, [], args.pods)}
            for arm in (arms if n % 2 == 0 else tuple(reversed(arms))):
                server, name = server_for(cp, arm, holds)
                server.start()
                try:
                    ext = [server.scheduler_config(managed_resources=MANAGED_RESOURCES, timeout="30s")]
                    pid = server.process.popen.pid
                    round_[arm] = (throughput(cp, api, ext, args.pods, pid, server) if name is None else
                                   throughput(cp, api, ext, args.pods, pid, None, extender_name=name))
                finally:
                    cp.stop_scheduler()
                    server.stop()
                print(f"extender_bench: round {n} {arm}: {round_[arm]['pods_per_s']} pods/s", file=sys.stderr, flush=True)
            result["rounds"].append(round_)
    finally:
        cp.stop()
    return result


def compare_http2(args: argparse.Namespace) -> int:
    """``--compare-http2 N``: N rounds (:func:`paired_rounds`) of qgpu's extender and the null
    extender with HTTP/2 offered and with HTTP/1.1 only."""

    def server_for(cp: ControlPlane, arm: str, holds: tuple[str, ...]) -> tuple[QgpuServer, str | None]:
        http2 = "on" if arm.endswith("http2") else "off"
        if arm.startswith("qgpu"):
            return extender_server(cp, priority=args.priority, assume_timeout=120, extra_args=(*holds, "--http2", http2)), None
        server = null_extender_server(cp)
        server.argv += ["--http2", http2]
        return server, "null-extender"

    result = paired_rounds(args, args.compare_http2, HTTP2_ARMS, server_for)
    result["summary"] = http2_summary(result["rounds"])
    return finish(result, "extender_bench.py", args.json, http2_markdown if args.markdown else None)


FLOOR_ARMS = ("qgpu_http2", "null_http2", "null_granian")


def compare_floor(args: argparse.Namespace) -> int:
    """``--compare-floor N``: N rounds (:func:`paired_rounds`) of qgpu's extender and the null
    extender on qgpu_runtime.serving, both over HTTP/2, and the null extender behind granian."""

    def server_for(cp: ControlPlane, arm: str, holds: tuple[str, ...]) -> tuple[QgpuServer, str | None]:
        if arm.startswith("qgpu"):
            return extender_server(cp, priority=args.priority, assume_timeout=120, extra_args=(*holds, "--http2", "on")), None
        server = null_extender_server(cp)
        server.argv += ["--server", "granian"] if arm == "null_granian" else ["--http2", "on"]
        return server, "null-extender"

    result = paired_rounds(args, args.compare_floor, FLOOR_ARMS, server_for)
    summary: dict[str, Any] = {}
    for arm in FLOOR_ARMS:
        means = arm_means(result["rounds"], arm, "qgpu-extender" if arm.startswith("qgpu") else "null-extender")
        if means is not None:
            summary[arm] = means
    result["summary"] = summary
    return finish(result, "extender_bench.py", args.json, None)


SOURCE_ARMS = ("qgpu", "source")


def source_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """``--compare-source``: per round, this checkout's extender over the other's (pods/s; own CPU
    per pod), paired within the round so the machine's drift between rounds cancels; and each
    arm's mean pods/s, ratio to its round's baseline and own CPU per pod."""
    out: dict[str, Any] = {}
    for arm in SOURCE_ARMS:
        means = arm_means(rounds, arm, "qgpu-extender")
        if means is not None:
            out[arm] = means
    paired = [r for r in rounds if all(a in r for a in SOURCE_ARMS)]
    out["qgpu_over_source_pods_per_s"] = [round(r["qgpu"]["pods_per_s"] / r["source"]["pods_per_s"], 3) for r in paired]
    out["qgpu_over_source_extender_cpu"] = [round(r["qgpu"]["net_cpu_ms_per_pod"]["qgpu-extender"]
                                                  / r["source"]["net_cpu_ms_per_pod"]["qgpu-extender"], 3) for r in paired]
    return out


def compare_source(args: argparse.Namespace) -> int:
    """``--compare-source DIR``: ``--rounds`` rounds (:func:`paired_rounds`) of qgpu's extender
    from this checkout and from DIR (another checkout or worktree, its code run with the same
    interpreter and flags, HTTP/2 offered): a change's effect under the real control plane."""

    def server_for(cp: ControlPlane, arm: str, holds: tuple[str, ...]) -> tuple[QgpuServer, str | None]:
        source = ROOT if arm == "qgpu" else args.compare_source
        return extender_server(cp, priority=args.priority, assume_timeout=120, extra_args=holds,
                               name=f"qgpu-extender-{arm}", source=source), None

    result = paired_rounds(args, args.rounds, SOURCE_ARMS, server_for, source=str(args.compare_source))
    result["summary"] = source_summary(result["rounds"])
    return finish(result, "extender_bench.py", args.json)


def http2_markdown(r: dict[str, Any]) -> None:
    lines = ["", f"## HTTP/2 against HTTP/1.1 between kube-scheduler and the extender ({r['date']})", "",
             f"- Command: `{r['command']}`",
             f"- Machine: {r['machine']}; {r['kubernetes']}; {r['nodes']} fake nodes with {CARDS} cards, "
             f"{r['pods']} pods per run, {len(r['rounds'])} rounds (each with its own baseline; arms reversed every "
             "other round), HTTPS with client certificates", "",
             "| arm | pods bound/s (mean) | ratio to the round's baseline | net CPU ms per pod (all; extender) "
             "| connections per run |", "|---|---|---|---|---|"]
    for arm in HTTP2_ARMS:
        a = r["summary"].get(arm)
        if a:
            lines.append(f"| {arm.replace('_', ' ')} | {a['pods_per_s']} | {a['ratio_to_baseline']} | "
                         f"{a['cpu_ms_per_pod_all']}; {a['cpu_ms_per_pod_extender']} | {a['connections']} |")
    for kind in ("qgpu", "null"):
        if f"{kind}_http2_over_http1" in r["summary"]:
            lines.append(f"\n{kind}: HTTP/2 over HTTP/1.1 by round: {r['summary'][f'{kind}_http2_over_http1']}")
    with (ROOT / "docs" / "benchmarks.md").open("a") as f:
        f.write("\n".join(lines) + "\n")


def commitments_markdown(r: dict[str, Any]) -> None:
    lines = ["", f"## Node commitments: extender throughput by --node-commitments mode ({r['date']})", "",
             f"- Command: `{r['command']}`",
             f"- Machine: {r['machine']}; {r['kubernetes']}; {r['nodes']} fake nodes with {CARDS} cards, "
             f"{r['pods']} pods per run (qgpu-core 25, qgpu-memory 4), one kube-scheduler, one extender, HTTPS",
             "", "| run | pods bound/s | ratio to no extender | ratio to off | net CPU ms per pod (all; extender) "
             "| kube-apiserver requests per pod |", "|---|---|---|---|---|---|"]
    for key in ("without_extender", *(k for k, _ in COMMITMENT_ARMS), "without_extender_again"):
        arm = r[key]
        requests = ", ".join(f"{k} {v}" for k, v in arm.get("apiserver_requests_per_pod", {}).items())
        cpu = arm["net_cpu_ms_per_pod"]
        lines.append(f"| {key.replace('_', ' ')} | {arm['pods_per_s']} | {arm.get('ratio_to_baseline', '')} | "
                     f"{arm.get('ratio_to_off', '')} | {cpu.get('all')}; {cpu.get('qgpu-extender', '—')} | {requests} |")
    with (ROOT / "docs" / "benchmarks.md").open("a") as f:
        f.write("\n".join(lines) + "\n")


def append_markdown(r: dict[str, Any]) -> None:
    lines = [
        "",
        f"## Scheduler extender under a real control plane ({r['date']})",
        "",
        f"- Command: `{r['command']}`",
        f"- Machine: {r['machine']}; {r['kubernetes']} (kube-apiserver, kube-scheduler, etcd from scripts/k8s-testbin), all on this machine",
        f"- Policy: {r['priority']}; fake nodes with {CARDS} cards each; pods ask qgpu-core 25, qgpu-memory 4",
        f"- CPUs: {'all shared' if r['cpus'] == 'shared' else 'control plane on ' + str(r['cpus']['control_plane']) + ', extender and benchmark on ' + str(r['cpus']['extender_and_bench'])}",
        "",
        "| measurement | value |",
        "|---|---|",
        f"| pods bound/s without extender ({r['without_extender']['pods']} pods, scheduler counts allocatable), before / after the extender runs | {r['without_extender']['pods_per_s']} / {r['without_extender_again']['pods_per_s']} |",
        f"| pods bound/s with extender: filter+prioritize+bind over HTTPS (ratio to the mean baseline; target >= 0.70) | {r['with_extender']['pods_per_s']} ({r['ratio_with_extender']}) |",
        f"| same over plain HTTP | {r['with_extender_plain_http']['pods_per_s']} ({r['ratio_with_extender_plain_http']}) |",
        f"| `--filter-result best`, no prioritizeVerb: filter+bind over HTTPS | {r['with_extender_best_filter']['pods_per_s']} ({r['ratio_with_extender_best_filter']}) |",
    ]
    for key, label in (("without_extender", "without extender"), ("with_extender", "with extender, HTTPS"),
                       ("with_extender_best_filter", "with extender, `best`")):
        cpu = r[key]["cpu_ms_per_pod"]
        parts = ", ".join(f"{name} {value}" for name, value in cpu.items() if name != "all")
        lines.append(f"| CPU ms per bound pod, {label}: all processes (by process) | {cpu['all']} ({parts}) |")
    for key, label in (("without_extender", "without extender"), ("with_extender", "with extender, HTTPS"),
                       ("with_extender_best_filter", "with extender, `best`")):
        split = r[key]["time_split"]
        parts = ", ".join(f"{name} {value}" for name, value in split.items())
        lines.append(f"| time split, {label}: mean ms per call from kube-scheduler's and the extender's histograms; connections accepted | {parts} |")
    for lat in r["latency"]:
        fp = lat["filter_plus_prioritize_ms"]
        lines.append(f"| filter+prioritize, {lat['cluster_nodes']} nodes in the cluster, {lat['nodes']} names per call: p50 / p99 ms | {fp['p50']} / {fp['p99']} |")
    lines.append("")
    path = ROOT / "docs" / "benchmarks.md"
    if not path.exists():
        path.write_text("# Benchmarks\n")
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")


def append_peer_markdown(r: dict[str, Any]) -> None:
    """One table: baseline, qgpu's extender and each peer from the same run."""
    arms = [("without_extender", "no extender (before / after)"), ("with_extender", "qgpu extender (filter+prioritize+bind, HTTPS)")]
    if "with_hami" in r:
        arms.append(("with_hami", "HAMi v2.10.0 scheduler (filter+bind, HTTPS), node policy binpack (its default)"))
        arms.append(("with_hami_spread", "same, pods annotated `hami.io/node-scheduler-policy: spread`"))
    lines = ["", f"### Run of {r['date']} ({'shared cores' if r['cpus'] == 'shared' else '--pin'})", "",
             f"- Command: `{r['command']}`",
             f"- Machine: {r['machine']}; load average at the end {r['load_average_at_end']}", "",
             "| arm | pods bound/s (ratio to baseline) | CPU ms per bound pod: all (by process) |", "|---|---|---|"]
    for key, label in arms:
        t = r[key]
        rate = f"{t['pods_per_s']} / {r['without_extender_again']['pods_per_s']}" if key == "without_extender" else \
            f"{t['pods_per_s']} ({r['ratio_' + key]})"
        cpu = t["cpu_ms_per_pod"]
        lines.append(f"| {label} | {rate} | {cpu['all']} ({', '.join(f'{k} {v}' for k, v in cpu.items() if k != 'all')}) |")
    lines += ["", "| filter latency, names sent / nodes in the cluster | qgpu filter p50 / p99 ms | qgpu filter+prioritize p50 / p99 ms "
              "| HAMi filter p50 / p99 ms |", "|---|---|---|---|"]
    hami = {(h["cluster_nodes"], h["nodes"]): h for h in r.get("hami_latency", [])}
    for lat in r["latency"]:
        h = hami.get((lat["cluster_nodes"], lat["nodes"]))
        lines.append(f"| {lat['nodes']} / {lat['cluster_nodes']} | {lat['filter_ms']['p50']} / {lat['filter_ms']['p99']} | "
                     f"{lat['filter_plus_prioritize_ms']['p50']} / {lat['filter_plus_prioritize_ms']['p99']} | "
                     f"{(str(h['filter_ms']['p50']) + ' / ' + str(h['filter_ms']['p99'])) if h else '-'} |")
    if "packing" in r:
        lines += ["", "| packing: same pods, one at a time, on identical empty nodes | pods placed of asked | compute booked |",
                  "|---|---|---|"]
        for name, pk in r["packing"].items():
            lines.append(f"| {name} ({pk['nodes']} nodes, {pk['cards']} cards) | {pk['placed']} / {pk['pods']} | {pk['compute_booked_pct']} % |")
    lines.append("")
    path = ROOT / "docs" / "benchmarks.md"
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
