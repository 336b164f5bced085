"""HAMi's scheduler extender (v2.10.0) as a process beside the benchmark's control plane.

It runs as HAMi's chart runs it: HTTPS on its own port, the filter and bind verbs wired into
kube-scheduler's configuration as an extender (no prioritize verb: HAMi's filter answers with one
node), ``nodeCacheCapable`` so kube-scheduler sends node names, HAMi's resource names managed by
the extender and ignored by kube-scheduler. The binary comes from bench/peers/hami-build.

What the benchmark plays instead of a real cluster, and why:
- HAMi's device plugin registers each node's cards; the benchmark writes the same annotations
  (bench/peers/hami_nodes.py) and ``nvidia.com/gpu`` in allocatable.
- HAMi's bind locks the node (annotation ``hami.io/mutex.lock``) and its device plugin releases the
  lock when the kubelet calls Allocate. There is no kubelet here, so the lock is given an expiry of
  ``node_lock_timeout`` (1 ms): every bind finds the previous lock expired, releases it and takes it
  again in HAMi's own process. This is HAMi's best case: on a real node the next pod for the same
  node waits for the kubelet (its bind fails with "node ... has been locked" and is retried).
"""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.peers.hami_nodes import GPU, GPU_CORES, GPU_MEMORY, GPU_MEMORY_PERCENTAGE, HAMI_RESOURCES
from tests.k8s.controlplane import _die_with_parent

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "bench" / "peers" / "hami-build"

# HAMi's device configuration (the nvidia section of its chart's ConfigMap, resource names as in
# its defaults). Other vendors are initialised by HAMi with empty configurations either way.
DEVICE_CONFIG = f"""\
nvidia:
  resourceCountName: "{GPU}"
  resourceMemoryName: "{GPU_MEMORY}"
  resourceMemoryPercentageName: "{GPU_MEMORY_PERCENTAGE}"
  resourceCoreName: "{GPU_CORES}"
  resourcePriorityName: "nvidia.com/priority"
  overwriteEnv: false
  defaultMemory: 0
  defaultCores: 0
  defaultGPUNum: 1
"""
NODE_ADDED = re.compile(r'"Node device added" nodeName="([^"]+)"')


class HamiError(RuntimeError):
    """HAMi's scheduler could not be built, started or did not register the nodes; carries its log."""


def build() -> Path:
    """Build HAMi's scheduler (cached); its path. Raises HamiError with the build's output."""
    result = subprocess.run([str(BUILD_SCRIPT)], capture_output=True, text=True)
    if result.returncode != 0:
        raise HamiError(f"{BUILD_SCRIPT} failed with exit code {result.returncode}:\n{result.stderr[-4000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


@dataclass
class HamiScheduler:
    """``hami-scheduler`` serving HTTPS on 127.0.0.1, talking to the control plane as ``kubeconfig``."""

    binary: Path
    workdir: Path
    kubeconfig: Path
    cert_file: Path
    key_file: Path
    ca_file: Path
    port: int
    metrics_port: int
    node_policy: str = "binpack"
    gpu_policy: str = "binpack"
    node_lock_timeout: str = "1ms"
    kube_qps: int = 5000
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _registered: set[str] = field(default_factory=set, init=False)
    _log_offset: int = field(default=0, init=False)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / "hami-scheduler.log"

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise HamiError("hami-scheduler is not running")
        return self.popen.pid

    def argv(self) -> list[str]:
        config = self.workdir / "hami-device-config.yaml"
        config.write_text(DEVICE_CONFIG)
        return [str(self.binary),
                f"--http_bind=127.0.0.1:{self.port}",
                f"--cert_file={self.cert_file}", f"--key_file={self.key_file}",
                "--scheduler-name=hami-scheduler",
                f"--node-scheduler-policy={self.node_policy}", f"--gpu-scheduler-policy={self.gpu_policy}",
                f"--metrics-bind-address=127.0.0.1:{self.metrics_port}",
                f"--kube-qps={self.kube_qps}", f"--kube-burst={2 * self.kube_qps}",
                f"--node-lock-timeout={self.node_lock_timeout}",
                f"--device-config-file={config}"]

    def start(self, timeout: float = 60.0) -> None:
        """Start (or start again: a new process registers the nodes anew)."""
        self._registered = set()
        self._log_offset = self.log.stat().st_size if self.log.exists() else 0
        handle = open(self.log, "ab")
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        self.popen = subprocess.Popen(self.argv(), stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, start_new_session=True, preexec_fn=_die_with_parent)
        handle.close()
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise HamiError(f"hami-scheduler exited with {self.popen.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2, context=ctx) as r:
                    if r.status == 200:
                        return
            except (OSError, ssl.SSLError):
                pass
            time.sleep(0.2)
        raise HamiError(f"hami-scheduler not answering /healthz after {timeout:.0f}s:\n{self.tail()}")

    def registered_nodes(self) -> set[str]:
        """Nodes whose cards HAMi has taken into its cache (it logs each the first time). The log
        grows by megabytes per filter at 5,000 nodes, so it is read from where the last call stopped."""
        try:
            with self.log.open("rb") as f:
                f.seek(self._log_offset)
                chunk = f.read()
        except OSError:
            return set(self._registered)
        complete = chunk.rfind(b"\n") + 1
        self._log_offset += complete
        self._registered.update(NODE_ADDED.findall(chunk[:complete].decode(errors="replace")))
        return set(self._registered)

    def wait_registered(self, names: set[str], timeout: float = 300.0) -> float:
        """Wait until HAMi has registered every node in ``names``; seconds waited."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.popen is not None and self.popen.poll() is not None:
                raise HamiError(f"hami-scheduler exited with {self.popen.returncode}:\n{self.tail()}")
            missing = names - self.registered_nodes()
            if not missing:
                return time.monotonic() - started
            time.sleep(1.0)
        raise HamiError(f"hami-scheduler registered {len(names - missing)}/{len(names)} nodes in {timeout:.0f}s; "
                        f"e.g. missing {sorted(missing)[:3]}:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            with self.log.open("rb") as f:
                f.seek(max(0, self.log.stat().st_size - 65536))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def scheduler_extender(hami: HamiScheduler, timeout: str = "30s") -> dict[str, Any]:
    """The ``extenders`` entry of KubeSchedulerConfiguration v1 for HAMi, as its chart writes it."""
    return {
        "urlPrefix": hami.url,
        "filterVerb": "filter",
        "bindVerb": "bind",
        "weight": 1,
        "enableHTTPS": True,
        "tlsConfig": {"caFile": str(hami.ca_file)},
        "httpTimeout": timeout,
        "nodeCacheCapable": True,
        "managedResources": [{"name": name, "ignoredByScheduler": True} for name in HAMI_RESOURCES],
        "ignorable": False,
    }
