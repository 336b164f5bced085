"""The admission half of bench/manager_bench.py (its docstring says what is measured and how)."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kubernetes import client, config  # noqa: E402

from tests.k8s.controlplane import ControlPlane, testbin_dir  # noqa: E402
from tests.k8s.kubeobjects import gpu_pod  # noqa: E402
from tests.k8s.nodemanager import CORE, MEMORY, ManagedNode, bare_node, bind_with_record  # noqa: E402

SPEC = "8xV100-32G"
NOBODY = "qgpu-bench-nobody"  # no scheduler: the benchmark binds
TICKS = os.sysconf("SC_CLK_TCK")
REQUEST = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def requests(api_client: client.ApiClient) -> dict[tuple[str, str], float]:
    """kube-apiserver's own count of pod requests by (verb, subresource)."""
    body = api_client.call_api("GET", api_client.configuration.host + "/metrics",
                               header_params=api_client.default_headers).read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in body.splitlines():
        m = REQUEST.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        if labels.get("resource") == "pods":
            key = (labels.get("verb", ""), labels.get("subresource", ""))
            out[key] = out.get(key, 0.0) + float(m["value"])
    return out


def delta(after: dict, before: dict, verb: str, sub: str = "") -> float:
    return after.get((verb, sub), 0.0) - before.get((verb, sub), 0.0)


class CpuLimit:
    """A cgroup holding the manager under a CPU quota; None where none can be made (not root, no controller)."""

    def __init__(self, millicores: int, name: str) -> None:
        self.path: Path | None = None
        self.v2 = False
        period = 100_000
        for base, v2 in ((Path("/sys/fs/cgroup/cpu"), False), (Path("/sys/fs/cgroup"), True)):
            try:
                if v2 and not (base / "cgroup.controllers").exists():
                    continue
                path = base / name
                path.mkdir(exist_ok=True)
                if v2:
                    (path / "cpu.max").write_text(f"{millicores * period // 1000} {period}")
                else:
                    (path / "cpu.cfs_period_us").write_text(str(period))
                    (path / "cpu.cfs_quota_us").write_text(str(millicores * period // 1000))
                self.path, self.v2 = path, v2
                return
            except OSError:
                continue

        self.acct: Path | None = None  # v1: cpuacct is a hierarchy of its own

    def add(self, pid: int) -> None:
        if self.path is None:
            return
        (self.path / "cgroup.procs").write_text(str(pid))
        if not self.v2:
            try:
                acct = Path("/sys/fs/cgroup/cpuacct") / self.path.name
                acct.mkdir(exist_ok=True)
                (acct / "cgroup.procs").write_text(str(pid))
                self.acct = acct
            except OSError:
                self.acct = None

    def usage_s(self) -> float | None:
        """CPU seconds of every task the cgroup ever held (exited threads included), to the
        microsecond (v2 cpu.stat) or nanosecond (v1 cpuacct.usage); None where it cannot be read.
        /proc's utime+stime count in clock ticks (10 ms): too coarse for one admission."""
        try:
            if self.path is not None and self.v2:
                stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
                return int(stat["usage_usec"]) / 1e6
            if self.acct is not None:
                return int((self.acct / "cpuacct.usage").read_text()) / 1e9
        except (OSError, KeyError, ValueError):
            return None
        return None

    def throttled(self) -> tuple[int, int]:
        """(periods, throttled periods) so far."""
        if self.path is None:
            return (0, 0)
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0))

    def remove(self) -> None:
        for path in (self.acct, self.path):
            if path is not None:
                try:
                    path.rmdir()
                except OSError:
                    pass


def bind(api: client.CoreV1Api, ns: str, node: ManagedNode, name: str, card: int, bind_time: int,
         running: bool) -> dict[str, Any]:
    api.create_namespaced_pod(ns, gpu_pod(name, {CORE: 10, MEMORY: 2}, scheduler_name=NOBODY))
    bind_with_record(api, ns, name, node.name, [(card, node.cards[card].uuid, 100, 2048)], bind_time)
    if running:
        api.patch_namespaced_pod_status(name, ns, {"status": {"phase": "Running"}})
    return json.loads(api.read_namespaced_pod(name, ns, _preload_content=False).data)


def settle(api_client: client.ApiClient, before: dict, want_patches: int, timeout: float = 10.0) -> dict:
    """Wait until the admission's annotation write landed (its PATCH counted), so its CPU is counted too."""
    deadline = time.monotonic() + timeout
    while True:
        now = requests(api_client)
        if delta(now, before, "PATCH") >= want_patches or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


def one_size(cp: ControlPlane, api: client.CoreV1Api, api_client: client.ApiClient, size: int, pods: int,
             cpu_limit: int) -> dict[str, Any]:
    name = f"bench-{size}-{os.getpid()}"
    bare_node(api, name, {"qgpu-bench": name})
    ns = f"bench-{size}-{int(time.time())}"
    api.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    node = ManagedNode(name, SPEC, cp.admin_kubeconfig)
    limit = CpuLimit(cpu_limit, f"qgpu-bench-{os.getpid()}") if cpu_limit else None
    try:
        base = time.time_ns()
        with ThreadPoolExecutor(8) as pool:  # the pods already running on the node
            list(pool.map(lambda i: bind(api, ns, node, f"run-{i:03d}", i % 8, base + i, True), range(size)))
        node.start()
        assert node.process is not None
        pid = node.process.pid
        if limit is not None:
            limit.add(pid)
        time.sleep(3.0)  # start-up: reconciliation, the first samples, the watch
        precise = limit is not None and limit.usage_s() is not None

        def used() -> float:
            if precise:
                assert limit is not None
                return limit.usage_s() or 0.0
            return cpu_seconds(pid)

        c0, t0 = used(), time.monotonic()
        time.sleep(5.0)
        idle_rate = (used() - c0) / (time.monotonic() - t0)
        cpu, wall, lists, patches_inside = [], [], [], []
        periods0 = limit.throttled() if limit else (0, 0)
        for i in range(pods):
            pod = bind(api, ns, node, f"gpu-{i:03d}", i % 8, time.time_ns(), False)
            time.sleep(0.3)  # as kubelet: the pod reaches it after the bind
            before = requests(api_client)
            c0, t0 = used(), time.monotonic()
            node.kubelet.admit(pod)
            t1 = time.monotonic()
            inside = requests(api_client)
            after = settle(api_client, before, 1)
            t2 = time.monotonic()
            cpu.append(used() - c0 - idle_rate * (t2 - t0))
            wall.append(t1 - t0)
            lists.append(delta(after, before, "LIST") / 2)  # two Allocate calls per pod
            patches_inside.append(delta(inside, before, "PATCH"))
        periods1 = limit.throttled() if limit else (0, 0)
        wall_sorted = sorted(wall)
        return {
            "pods_on_node": size, "admitted": pods,
            "cpu_ms_per_pod_p50": round(statistics.median(cpu) * 1000, 1),
            "cpu_ms_per_pod_mean": round(statistics.mean(cpu) * 1000, 1),
            "cpu_ms_per_pod_max": round(max(cpu) * 1000, 1),
            "admission_p50_ms": round(statistics.median(wall) * 1000, 1),
            "admission_p99_ms": round(wall_sorted[int(0.99 * (len(wall) - 1))] * 1000, 1),
            "lists_per_allocate": round(statistics.mean(lists), 2),
            "patches_inside_admission": round(statistics.mean(patches_inside), 2),
            "idle_cpu_pct": round(idle_rate * 100, 2),
            "cpu_clock": "cgroup" if precise else "proc ticks",
            "throttled_periods": [periods1[1] - periods0[1], periods1[0] - periods0[0]] if limit and limit.path else None,
        }
    finally:
        node.close()
        if limit is not None:
            limit.remove()


def admission_bench(sizes: list[int], pods: int, cpu_limit: str) -> dict[str, Any]:
    millicores = int(cpu_limit[:-1]) if cpu_limit.endswith("m") else int(float(cpu_limit or 0) * 1000)
    with tempfile.TemporaryDirectory(prefix="qgpu-mbench-", dir="/tmp") as d:
        cp = ControlPlane(testbin_dir(build=True), Path(d))
        cp.start()
        try:
            api_client = config.new_client_from_config(config_file=str(cp.admin_kubeconfig))
            api = client.CoreV1Api(api_client)
            runs = [one_size(cp, api, api_client, n, pods, millicores) for n in sizes]
        finally:
            cp.stop()
    return {"runs": runs, "cpu_limit": cpu_limit or None, "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "machine": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
