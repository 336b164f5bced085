"""Benchmark of the node manager as a real process: a GPU pod's admission, and the steady state.

Admission (the default; issue 23 §3): a real kube-apiserver and etcd (tests/k8s/controlplane.py,
no scheduler: the benchmark binds pods as the extender does, signed records included), one node
with 8 simulated V100-32G cards, ``qgpu manager serve`` as a real process reading that node's pods
through the API, and kubelet played by the test kubelet over real unix sockets. For each size N
(``--sizes``, default 10, 100, 200), N pods already run on the node (bound, signed records, phase
Running); then ``--pods`` GPU pods are admitted one at a time as kubelet does (GetPreferredAllocation
and Allocate, for qgpu-core then qgpu-memory). Per admitted pod: the manager's CPU (utime+stime from
/proc, from the admission's start until its annotation write landed, less the idle rate measured
before), the admission's wall time seen by kubelet, and kube-apiserver's own request counters
(``apiserver_request_total``): LISTs of pods per Allocate, and PATCHes of pods that completed inside
the admission. With ``--cpu-limit 200m`` (the DaemonSet's limit) the manager runs in a cgroup (v1
``cpu`` controller, or v2) with that quota, and the throttled periods are reported; where no cgroup
can be made, CPU time alone is reported.

    .venv/bin/python bench/manager_bench.py [--sizes 10,100,200] [--pods 20] [--cpu-limit 200m] [--json OUT]

Steady state (``--steady-state``): the setup below.

Setup: 8 simulated cards (V100-32G), 64 containers holding shares (8 per card) with a GPU
process each in the simulated control file, sampling every second, /metrics scraped every 15 s
(Prometheus' default), kubelet played by the test kubelet over real unix sockets.

Phase 1 (latency): ROUNDS rounds of 64 pods, each admitted as kubelet does (GetPreferredAllocation
+ Allocate for qgpu-core, then for qgpu-memory); the client-side time of every Allocate is kept.
Pods of a finished round are deleted, as a churning node would see them.
Phase 2 (steady state): a fresh manager (reconciling away the deleted pods) serves the last 64
containers; CPU (utime+stime from /proc) and RSS are read over WINDOW seconds.

    .venv/bin/python bench/manager_bench.py --steady-state [--window 60] [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "node"))
sys.path.insert(0, str(ROOT))

from podfactory import pod, qgpu, write_pods  # noqa: E402
from testkubelet import TestKubelet  # noqa: E402

from qgpu_runtime.gpu.simulated import build_cards, parse_spec  # noqa: E402

NODE = "bench-node"
SPEC = "8xV100-32G"
CORE = "tke.cloud.tencent.com/qgpu-core"
MEM = "tke.cloud.tencent.com/qgpu-memory"
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def make_round(r: int, cards) -> list[dict]:
    pods = []
    for i in range(64):
        card = i % 8
        cid = f"{r:02x}{i:02x}".ljust(64, "c")
        pods.append(pod(f"r{r}-p{i:02d}", NODE, [("main", qgpu(10, 2), [(card, cards[card].uuid, 100, 2048)])],
                        bind_time=r * 1000 + i + 1, container_ids={"main": cid}))
    return pods


def control_for(pods: list[dict]) -> dict:
    procs = []
    for n, p in enumerate(pods):
        uid = p["metadata"]["uid"]
        cid = p["status"]["containerStatuses"][0]["containerID"].split("://")[1]
        card = json.loads(p["metadata"]["annotations"]["qgpu.io/allocation"])["containers"][0]["cards"][0]["index"]
        procs.append({"pid": 10000 + n, "card_index": card, "memory_mib": 1500, "sm_util_pct": 9,
                      "cgroup": f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-{cid}.scope"})
    return {"processes": procs}


def start(root: Path, port: int, backend: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "qgpu_runtime.cli", "manager", "serve", "--nodename", NODE,
           "--dbfile", str(root / "meta.db"), *backend, "--pods-file", str(root / "pods.json"),
           "--device-plugin-dir", str(root / "dp"), "--pod-resources-socket", str(root / "pr" / "kubelet.sock"),
           "--state-dir", str(root / "state"), "--resources", f"{CORE},{MEM}", "--metrics-port", str(port),
           "--metrics-address", "127.0.0.1", "--sample-interval", "1", "--log-level", "WARNING"]
    return subprocess.Popen(cmd, cwd=ROOT, stderr=open(root / "manager.log", "a"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steady-state", action="store_true", help="the steady-state benchmark instead of admissions")
    ap.add_argument("--window", type=float, default=60.0, help="steady-state measuring window, seconds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="10,100,200", help="pods already on the node, one run per size")
    ap.add_argument("--pods", type=int, default=20, help="GPU pods admitted per size")
    ap.add_argument("--cpu-limit", default="", help="run the manager under this CPU quota (e.g. 200m)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not args.steady_state:
        from manager_admission import admission_bench

        result = admission_bench([int(n) for n in args.sizes.split(",")], args.pods, args.cpu_limit)
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    cards = build_cards(parse_spec(SPEC), NODE)
    with tempfile.TemporaryDirectory(prefix="qgpu-bench-", dir="/tmp") as d:
        root = Path(d)
        (root / "gpus.yaml").write_text("cards:\n  - {model: V100, memory_mib: 32768, count: 8}\ncontrol: control.json\n")
        backend = ["--gpu-backend", "simulated", "--simulated-gpus", str(root / "gpus.yaml")]
        write_pods(root / "pods.json", [])
        kubelet = TestKubelet(root / "dp", root / "pr" / "kubelet.sock")
        kubelet.start()
        port = free_port()
        proc = start(root, port, backend)
        kubelet.wait_for(lambda: len(kubelet.plugins) == 2 and all(p.devices for p in kubelet.plugins.values()), timeout=60)
        latencies: list[float] = []
        original = kubelet.allocate

        def timed(resource, ids):
            t0 = time.perf_counter()
            try:
                return original(resource, ids)
            finally:
                latencies.append(time.perf_counter() - t0)

        kubelet.allocate = timed
        pods: list[dict] = []
        for r in range(args.rounds):
            for p in pods:
                kubelet.forget("default", p["metadata"]["name"])
            pods = make_round(r, cards)
            write_pods(root / "pods.json", pods)
            for p in pods:
                kubelet.admit(p)
            for p in pods:
                p["status"]["phase"] = "Running"
            write_pods(root / "pods.json", pods)
        proc.terminate()
        proc.wait(timeout=30)

        (root / "control.json").write_text(json.dumps(control_for(pods)))
        proc = start(root, port, backend)
        time.sleep(3.0)  # start-up, reconciliation, first samples
        url = f"http://127.0.0.1:{port}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        series = sum(1 for line in body.splitlines() if line.startswith("container_request_gpu_memory{"))
        used_series = sum(1 for line in body.splitlines()
                          if line.startswith("container_gpu_utilization{") and 'gpu="total"' in line)
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()
        rss_peak = rss_mib(proc.pid)
        next_scrape = t0
        while time.monotonic() - t0 < args.window:
            if time.monotonic() >= next_scrape:
                urllib.request.urlopen(url, timeout=10).read()
                next_scrape += 15
            rss_peak = max(rss_peak, rss_mib(proc.pid))
            time.sleep(1.0)
        cpu = (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0)
        rss = rss_mib(proc.pid)
        proc.terminate()
        proc.wait(timeout=30)
        kubelet.stop()
    lat = sorted(latencies)
    result = {
        "cards": 8, "containers": series, "containers_with_usage": used_series, "sample_interval_s": 1.0, "window_s": args.window,
        "cpu_pct_of_one_core": round(cpu * 100, 2), "rss_mib": round(rss, 1), "rss_peak_mib": round(rss_peak, 1),
        "allocate_calls": len(lat), "allocate_p50_ms": round(statistics.median(lat) * 1000, 2),
        "allocate_p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1000, 2), "allocate_max_ms": round(lat[-1] * 1000, 2),
        "python": sys.version.split()[0], "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
