"""On a GPU host: does the NVML backend see the real cards, and does metrics sampling work?

Starts a small CUDA load (PyTorch, when installed) so utilisation and memory move, samples the
NVML backend directly, then runs ``qgpu manager serve --gpu-backend nvml`` and scrapes /metrics.
Prints one JSON document with what was seen. Run from the repository root:

    python bench/manager_nvml_probe.py > nvml-probe.json
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qgpu_runtime.gpu.nvml import NvmlBackend  # noqa: E402

LOAD = """
import time, torch
x = torch.randn(8192, 8192, device='cuda')
keep = torch.empty(4 * 1024**3, dtype=torch.uint8, device='cuda')
end = time.time() + float(__import__('sys').argv[1])
while time.time() < end:
    y = x @ x
    torch.cuda.synchronize()
"""


def main() -> int:
    report: dict = {}
    backend = NvmlBackend()
    report["cards"] = [asdict(c) for c in backend.cards()]
    load = None
    try:
        load = subprocess.Popen([sys.executable, "-c", LOAD, "25"])
        report["load_pid"] = load.pid
    except OSError as exc:
        report["load_error"] = str(exc)
    time.sleep(6)
    report["samples"] = []
    for _ in range(3):
        report["samples"].append([
            {"index": u.index, "util_pct": u.util_pct, "memory_used_mib": u.memory_used_mib,
             "processes": [{"pid": p.pid, "memory_mib": p.memory_mib, "sm_util_pct": p.sm_util_pct,
                            "cgroup_first_line": p.cgroup.splitlines()[0] if p.cgroup else ""} for p in u.processes]}
            for u in backend.sample()])
        time.sleep(1)
    report["health_events_in_1s"] = [asdict(e) for e in backend.wait_health_events(1.0)]
    backend.close()

    with tempfile.TemporaryDirectory(prefix="qgpu-probe-", dir="/tmp") as d:
        root = Path(d)
        (root / "pods.json").write_text('{"items": []}')
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mgr = subprocess.Popen([sys.executable, "-m", "qgpu_runtime.cli", "manager", "serve", "--nodename", "h100",
                                "--dbfile", str(root / "meta.db"), "--gpu-backend", "nvml", "--pods-file",
                                str(root / "pods.json"), "--device-plugin-dir", str(root / "dp"),
                                "--state-dir", str(root / "state"), "--metrics-port", str(port),
                                "--metrics-address", "127.0.0.1", "--sample-interval", "1"],
                               cwd=ROOT, stderr=open(root / "log", "w"))
        time.sleep(5)
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            report["metrics"] = [line for line in body.splitlines() if line.startswith("qgpu_card_")]
        except OSError as exc:
            report["metrics_error"] = str(exc)
        mgr.terminate()
        report["manager_exit"] = mgr.wait(timeout=30)
        report["manager_log"] = (root / "log").read_text().splitlines()[-15:]
        node = json.loads((root / "pods.node.json").read_text()) if (root / "pods.node.json").exists() else None
        report["node_metadata"] = node
    if load:
        load.wait(timeout=60)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
