"""Diagnose NVML per-process utilization semantics on a real GPU: run a worker under an open-loop
SIGSTOP/SIGCONT duty pattern, poll nvmlDeviceGetProcessUtilization every 10 ms, and record every
sample plus the worker's step times, so the sample window can be fitted offline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pynvml

HERE = os.path.dirname(os.path.abspath(__file__))
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
tmp = tempfile.mkdtemp()
result = {"offset_us": int(time.time() * 1e6) - int(time.monotonic() * 1e6)}
for name, on_s, off_s in (("d33", 0.1, 0.2), ("d70", 0.21, 0.09), ("d50slow", 0.5, 0.5)):
    out = f"{tmp}/{name}.txt"
    w = subprocess.Popen([sys.executable, f"{HERE}/isolation_workload.py", "--seconds", "7", "--out", out], start_new_session=True)
    while True:
        try:
            if len(open(out).read().splitlines()) > 5:
                break
        except OSError:
            pass
        time.sleep(0.02)
    samples, switches = [], []
    last = 0
    t0 = time.monotonic()
    running = True
    next_switch = t0 + on_s
    while time.monotonic() - t0 < 5.0:
        now = time.monotonic()
        if now >= next_switch:
            os.killpg(w.pid, signal.SIGSTOP if running else signal.SIGCONT)
            running = not running
            switches.append((now, running))
            next_switch = now + (on_s if running else off_s)
        try:
            for s in pynvml.nvmlDeviceGetProcessUtilization(h, last):
                if s.timeStamp > last:
                    samples.append((now, s.pid, s.timeStamp, s.smUtil))
            if samples:
                last = max(last, max(x[2] for x in samples))
        except pynvml.NVMLError_NotFound:
            pass
        time.sleep(0.01)
    os.killpg(w.pid, signal.SIGCONT)
    w.wait()
    steps = [float(l.split()[0]) for l in open(out) if not l.startswith("#")]
    result[name] = {"samples": samples, "switches": switches, "steps": steps[::5]}
json.dump(result, open(sys.argv[1], "w"))
print("ok", {k: len(v["samples"]) for k, v in result.items() if isinstance(v, dict)})
