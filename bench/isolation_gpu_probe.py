"""Probe what the isolation engine can rely on on a real GPU: NVML per-process utilization
(sample cadence, behaviour under SIGSTOP), driver/CUDA versions, and whether MPS starts.
Prints a JSON report; run on the device machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pynvml

out = {}
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
out["driver"] = pynvml.nvmlSystemGetDriverVersion()
out["cuda_driver_version"] = pynvml.nvmlSystemGetCudaDriverVersion_v2()
out["name"] = pynvml.nvmlDeviceGetName(h)
out["compute_mode"] = pynvml.nvmlDeviceGetComputeMode(h)
out["mps_control"] = shutil.which("nvidia-cuda-mps-control")
tmp = tempfile.mkdtemp()
worker = subprocess.Popen([sys.executable, "bench/isolation_workload.py", "--seconds", "12", "--out", f"{tmp}/w.txt"],
                          start_new_session=True)
t_start = time.monotonic()
while time.monotonic() - t_start < 90:
    try:
        if len(open(f"{tmp}/w.txt").read().splitlines()) > 20:
            break
    except OSError:
        pass
    time.sleep(0.1)
out["worker_ready_after_s"] = round(time.monotonic() - t_start, 2)
out["procs_running"] = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
out["device_util_running"] = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
try:
    out["process_util_all"] = [(g.pid, g.timeStamp, g.smUtil, g.memUtil) for g in pynvml.nvmlDeviceGetProcessUtilization(h, 0)]
except pynvml.NVMLError as e:
    out["process_util_all"] = str(e)
try:
    out["smi_apps"] = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"], capture_output=True, text=True).stdout
    out["smi_pmon"] = subprocess.run(["nvidia-smi", "pmon", "-c", "1"], capture_output=True, text=True).stdout
except OSError as e:
    out["smi"] = str(e)
samples = []
last = 0
t0 = time.monotonic()
phase = "run"
while time.monotonic() - t0 < 3.0:
    el = time.monotonic() - t0
    if el > 1.0 and phase == "run":
        os.killpg(worker.pid, signal.SIGSTOP); phase = "stopped"
    if el > 2.0 and phase == "stopped":
        os.killpg(worker.pid, signal.SIGCONT); phase = "resumed"
    now_us = int(time.time() * 1e6)
    du = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
    try:
        got = pynvml.nvmlDeviceGetProcessUtilization(h, last)
        samples.append({"t": round(el, 3), "phase": phase, "n": len(got), "du": du,
                        "s": [(g.pid, g.timeStamp, g.smUtil) for g in got]})
    except pynvml.NVMLError as e:
        samples.append({"t": round(el, 3), "phase": phase, "err": str(e), "du": du})
    last = now_us
    time.sleep(0.02)
out["util_samples"] = samples
out["procs"] = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
out["worker_pid"] = worker.pid
out["device_util"] = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
worker.wait()
out["worker_tail"] = open(f"{tmp}/w.txt").read().splitlines()[-2:]
# MPS
if False:
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": f"{tmp}/mps", "CUDA_MPS_LOG_DIRECTORY": f"{tmp}/mpslog"}
    os.makedirs(f"{tmp}/mps"); os.makedirs(f"{tmp}/mpslog")
    r = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, capture_output=True, text=True)
    out["mps_start"] = [r.returncode, r.stdout, r.stderr]
    cenv = {**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M"}
    r = subprocess.run([sys.executable, "-c", "import torch;x=torch.empty(1<<20,device='cuda');print('ok', torch.cuda.get_device_properties(0).multi_processor_count);"
                        "\ntry:\n  y=torch.empty(6<<30,dtype=torch.uint8,device='cuda');print('grabbed 6GiB')\nexcept Exception as e: print('oom', type(e).__name__, str(e)[:200])"],
                       env=cenv, capture_output=True, text=True, timeout=120)
    out["mps_client"] = [r.returncode, r.stdout, r.stderr[-2000:]]
    r = subprocess.run(["nvidia-cuda-mps-control"], input="get_server_list\n", env=env, capture_output=True, text=True)
    out["mps_servers"] = [r.returncode, r.stdout, r.stderr]
    r = subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env=env, capture_output=True, text=True)
    out["mps_quit"] = [r.returncode, r.stdout, r.stderr]
    try:
        out["mps_log"] = open(f"{tmp}/mpslog/control.log").read()[-3000:]
    except OSError as e:
        out["mps_log"] = str(e)
out["worker_rc"] = worker.returncode
print(json.dumps(out, default=str))
