"""Fixtures for the node manager: a simulated node with a real test kubelet on real unix sockets."""

from __future__ import annotations

import json
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from podfactory import write_pods  # noqa: E402
from testkubelet import TestKubelet  # noqa: E402

from qgpu_runtime.gpu.simulated import SimulatedBackend, build_cards, parse_spec  # noqa: E402
from qgpu_runtime.node.deviceplugin.resources import DEFAULT_RESOURCES, parse_resources  # noqa: E402
from qgpu_runtime.node.manager import ManagerConfig, NodeManager  # noqa: E402
from qgpu_runtime.node.pods import FilePodSource  # noqa: E402
from qgpu_runtime.node.store import Store  # noqa: E402
from tests.recordkeys import VERIFIER

NODE = "gpu-node-1"
RESOURCES = ",".join(DEFAULT_RESOURCES)  # what `qgpu-node serve` serves without --resources


@pytest.fixture
def short_tmp():
    """unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer."""
    with tempfile.TemporaryDirectory(prefix="qgpu-", dir="/tmp") as d:
        yield Path(d)


@dataclass
class Node:
    root: Path
    manager: NodeManager
    kubelet: TestKubelet
    store: Store
    pods_file: Path
    control: Path

    def set_pods(self, pods: list[dict]) -> None:
        write_pods(self.pods_file, pods)

    def pods(self) -> list[dict]:
        return json.loads(self.pods_file.read_text())["items"]

    def control_write(self, data: dict) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.control)

    def uuid(self, index: int) -> str:
        return self.manager.cards[index].uuid


@pytest.fixture
def node(short_tmp):
    root = short_tmp
    plugin_dir = root / "device-plugins"
    seed = random.randrange(2**32)
    print(f"test kubelet seed {seed} (TestKubelet(..., seed={seed}) repeats this run's Allocate order)")
    kubelet = TestKubelet(plugin_dir, root / "pod-resources" / "kubelet.sock", seed=seed)
    kubelet.start()
    control = root / "control.json"
    backend = SimulatedBackend(build_cards(parse_spec("2xT4-16G"), NODE), control)
    store = Store(root / "meta.db")
    pods_file = root / "pods.json"
    write_pods(pods_file, [])
    config = ManagerConfig(node=NODE, resources=parse_resources(RESOURCES), plugin_dir=plugin_dir,
                           pod_resources_socket=root / "pod-resources" / "kubelet.sock", state_dir=root / "state",
                           sample_interval_s=0.2, watch_interval_s=0.1, pod_refresh_s=0.0,
                           isolation_policy="fixed-share", record_verifier=VERIFIER)
    manager = NodeManager(config, backend, store, FilePodSource(pods_file))
    manager.start()
    kubelet.wait_for(lambda: len(kubelet.plugins) == len(DEFAULT_RESOURCES) and all(p.devices for p in kubelet.plugins.values()))
    n = Node(root, manager, kubelet, store, pods_file, control)
    yield n
    n.manager.stop()  # the test may have replaced it (restart tests)
    kubelet.stop()
    store.close()
