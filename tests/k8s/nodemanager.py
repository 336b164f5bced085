"""A GPU node for tests/k8s: a Node object created through the API, a test kubelet on short /tmp
unix sockets, and a real `qgpu manager serve` process (simulated GPUs, chosen explicitly) reading
that node's pods from the fixture's kube-apiserver."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml
from kubernetes import client

from qgpu_runtime.gpu.simulated import build_cards, parse_spec
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model.requests import AppClass
from qgpu_runtime.placement.state import CardShare, ContainerPlacement, Placement
from tests.k8s.controlplane import ROOT
from tests.k8s.kubeobjects import ready_node
from tests.node.testkubelet import TestKubelet
from tests.recordkeys import signed, write_keys

# No preexec_fn here (controlplane.py's way to tie children to the test process): this process runs
# gRPC threads (the test kubelet), and a child that runs Python between fork and exec can abort in
# gRPC's fork handlers. setpriv sets the same parent-death signal from outside.
_DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []

CORE = "tke.cloud.tencent.com/qgpu-core"
MEMORY = "tke.cloud.tencent.com/qgpu-memory"


def bare_node(api: client.CoreV1Api, name: str, labels: Mapping[str, str]) -> None:
    """A Ready node without any qgpu annotation: what a GPU node looks like before its manager runs
    (created whole, as kubelet registers itself)."""
    ready_node(api, name, {"cpu": "16", "memory": "64Gi", "pods": "110"}, labels)


def read_node(api: client.CoreV1Api, name: str) -> dict[str, Any]:
    return json.loads(api.read_node(name, _preload_content=False).data)


def bind_with_record(api: client.CoreV1Api, namespace: str, pod: str, node: str,
                     cards: list[tuple[int, str, int, int]], bind_time_ns: int, container: str = "c0") -> None:
    """Bind as qgpu's extender does: one pods/binding POST whose annotations carry the record."""
    placement = Placement(node, (ContainerPlacement(container, tuple(CardShare(*c) for c in cards)),), AppClass.NORMAL)
    uid = api.read_namespaced_pod(pod, namespace).metadata.uid
    notes = signed(placement.record("binpack", bind_time_ns), bind_time_ns, uid)  # signed as the extender signs
    body = client.V1Binding(metadata=client.V1ObjectMeta(name=pod, namespace=namespace, annotations=notes),
                            target=client.V1ObjectReference(api_version="v1", kind="Node", name=node))
    api.create_namespaced_pod_binding(pod, namespace, body, _preload_content=False)  # pods/binding, as the extender


@dataclass
class ManagedNode:
    """One node: API object, test kubelet, manager process (restartable), store and log on disk."""

    name: str
    spec: str
    kubeconfig: Path
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="qgpu-nm-", dir="/tmp")))
    resources: tuple[str, ...] = (CORE, MEMORY)
    process: subprocess.Popen[bytes] | None = None
    extra_args: tuple[str, ...] = ()  # appended to `qgpu manager serve` (e.g. --dra)

    def __post_init__(self) -> None:
        self.kubelet = TestKubelet(self.root / "dp", self.root / "pr" / "kubelet.sock")
        self.kubelet.start()
        self.control = self.root / "control.json"
        self.control.write_text("{}")
        (self.root / "gpus.yaml").write_text(yaml.safe_dump({
            "cards": [{"model": s.model, "memory_mib": s.memory_mib, "count": s.count} for s in parse_spec(self.spec)],
            "control": str(self.control)}))

    @property
    def cards(self) -> tuple[CardInfo, ...]:
        return build_cards(parse_spec(self.spec), self.name)  # the manager's UUIDs: stable per node name

    @property
    def log_path(self) -> Path:
        return self.root / "manager.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def argv(self, kubeconfig: Path | str | None = None) -> list[str]:
        return [sys.executable, "-m", "qgpu_runtime.cli", "manager", "serve", "--nodename", self.name,
                "--kubeconfig", str(kubeconfig or self.kubeconfig), "--dbfile", str(self.root / "meta.db"),
                "--gpu-backend", "simulated", "--simulated-gpus", str(self.root / "gpus.yaml"),
                "--device-plugin-dir", str(self.root / "dp"), "--pod-resources-socket", str(self.root / "pr" / "kubelet.sock"),
                "--state-dir", str(self.root / "state"), "--resources", ",".join(self.resources),
                "--sample-interval", "0.5", "--metrics-port", "-1", "--no-device-specs", "--log-level", "INFO",
                "--isolation-policy", "fixed-share",  # as the DaemonSet passes it; the label path: test_e2e_node_isolation
                "--record-verify-key", str(write_keys(self.root / "keys")[1]),
                *self.dra_args(), *self.extra_args]

    @property
    def dra(self) -> bool:
        return "--dra" in self.extra_args

    def dra_args(self) -> list[str]:
        """With --dra: the kubelet plugin's sockets and CDI specs under this node's folder, never the host's."""
        if not self.dra:
            return []
        return ["--kubelet-plugins-dir", str(self.root / "plugins"), "--plugins-registry-dir", str(self.root / "registry"),
                "--cdi-dir", str(self.root / "cdi")]

    def spawn(self, kubeconfig: Path | str | None = None) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(_DIE_WITH_PARENT + self.argv(kubeconfig), cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, "PYTHONPATH": str(ROOT)})
        return self.process

    def start(self, kubeconfig: Path | str | None = None, timeout: float = 60.0) -> None:
        """Start the manager and wait until every resource is registered with devices listed (with --dra: until
        its DRA registration socket is served)."""
        before = len(self.kubelet.registrations)
        proc = self.spawn(kubeconfig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"manager exited with {proc.returncode}:\n{self.log()[-4000:]}")
            if self.dra:  # no device plugin registers: the DRA registration socket is the sign of life
                if (self.root / "registry" / "gpu.qgpu.io-reg.sock").exists():
                    return
                time.sleep(0.1)
                continue
            try:
                self.kubelet.wait_for(lambda: len(self.kubelet.registrations) >= before + len(self.resources)
                                      and all(p.devices for p in self.kubelet.plugins.values()), timeout=1)
                return
            except TimeoutError:
                continue
        raise AssertionError(f"manager did not register in {timeout:.0f}s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> int:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else 0
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # stacks into the log, then give up
            time.sleep(1)
            proc.kill()
            proc.wait(5)
            raise AssertionError(f"manager ignored SIGTERM for {timeout:.0f}s:\n{self.log()[-8000:]}") from None

    def grants(self) -> list[tuple[str, str, str, str]]:
        """(namespace, pod, container, resource) rows of the store, read-only (works while it runs)."""
        db = sqlite3.connect(f"file:{self.root / 'meta.db'}?mode=ro", uri=True)
        try:
            return sorted(db.execute("SELECT namespace, pod, container, resource FROM grants").fetchall())
        finally:
            db.close()

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self.kubelet.stop()
            shutil.rmtree(self.root, ignore_errors=True)
