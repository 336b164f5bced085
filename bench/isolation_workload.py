"""A real CUDA workload for the isolation benchmarks: bf16 matrix products in a loop (PyTorch).

Writes one line per completed step, ``<monotonic seconds> <steps so far>``, flushed every
``--report-every`` seconds, so the benchmark reads throughput over any window afterwards. The
loop synchronizes every step, as a training loop that reads its loss does, which bounds the work
queued on the GPU when the process is suspended.

``--grab-mib`` allocates that much extra memory after ``--grab-after`` seconds: the memory-cap
scenario's offender.
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--report-every", type=float, default=0.05)
    p.add_argument("--hold-mib", type=int, default=0, help="memory to allocate at start")
    p.add_argument("--grab-mib", type=int, default=0)
    p.add_argument("--grab-after", type=float, default=0.0)
    p.add_argument("--idle-until", type=float, default=0.0, help="sleep until this monotonic time before working")
    a = p.parse_args()

    import torch

    dev = torch.device("cuda", 0)
    x = torch.randn(a.size, a.size, device=dev, dtype=torch.bfloat16)
    y = torch.randn(a.size, a.size, device=dev, dtype=torch.bfloat16)
    held = torch.empty(a.hold_mib << 20, dtype=torch.uint8, device=dev) if a.hold_mib else None
    torch.cuda.synchronize()
    if a.idle_until:
        time.sleep(max(0.0, a.idle_until - time.monotonic()))
    start = time.monotonic()
    steps = 0
    grabbed = None
    last_flush = start
    with open(a.out, "w") as out:
        out.write(f"{start:.6f} 0\n")
        while True:
            now = time.monotonic()
            if now - start >= a.seconds:
                break
            torch.matmul(x, y)
            torch.cuda.synchronize()
            steps += 1
            now = time.monotonic()
            out.write(f"{now:.6f} {steps}\n")
            if now - last_flush >= a.report_every:
                out.flush()
                last_flush = now
            if a.grab_mib and grabbed is None and now - start >= a.grab_after:
                try:
                    grabbed = torch.empty(a.grab_mib << 20, dtype=torch.uint8, device=dev)
                    grabbed.fill_(1)
                    out.write(f"# grabbed {a.grab_mib} MiB\n")
                except torch.cuda.OutOfMemoryError as err:
                    out.write(f"# oom {str(err).splitlines()[0]}\n")
                    out.flush()
                    print(f"workload: CUDA out of memory: {err}", file=sys.stderr)
                    return 3
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
