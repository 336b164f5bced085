"""NVIDIA MPS as a hardware-backed cap: active thread percentage and pinned memory limits.

MPS gives what duty cycling cannot: a compute cap that holds within a kernel (a client only gets
that share of the SMs) and a memory limit the driver enforces at allocation time, so the
application sees an ordinary CUDA out-of-memory error instead of being killed. Pinned limits need
CUDA >= 11.5 on the driver side. The control daemon is driven through its documented stdin
commands; clients are configured through their environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

MPS_CONTROL = "nvidia-cuda-mps-control"
PINNED_LIMIT_MIN_CUDA = 11050  # NVML encoding of CUDA 11.5


class MpsError(RuntimeError):
    """The MPS control daemon could not be started or refused a command."""


def pinned_limits_supported(cuda_driver_version: int) -> bool:
    return cuda_driver_version >= PINNED_LIMIT_MIN_CUDA


def client_env(pipe_dir: str, log_dir: str, core_milli: int, memory_mib: int, pinned_limits: bool) -> dict[str, str]:
    """Environment for one MPS client using one card, seen by it as device 0.

    core_milli 0 (online tenants, whole cards) leaves the thread percentage at the default of 100.
    """
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir, "CUDA_MPS_LOG_DIRECTORY": log_dir}
    if 0 < core_milli < 1000:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = f"{max(1, round(core_milli / 10))}"
    if pinned_limits and memory_mib > 0:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={memory_mib}M"
    return env


@dataclass
class MpsDaemon:
    """One MPS control daemon with its own pipe and log directories."""

    pipe_dir: str
    log_dir: str
    binary: str = MPS_CONTROL

    @staticmethod
    def find() -> str | None:
        return shutil.which(MPS_CONTROL)

    def _env(self) -> dict[str, str]:
        return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def start(self) -> None:
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        done = subprocess.run([self.binary, "-d"], env=self._env(), capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise MpsError(f"{self.binary} -d exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")

    def command(self, line: str) -> str:
        done = subprocess.run([self.binary], input=line + "\n", env=self._env(), capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise MpsError(f"MPS command {line!r} exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout.strip()

    def stop(self) -> None:
        self.command("quit")
