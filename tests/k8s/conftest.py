"""Session fixtures: one real control plane (etcd, kube-apiserver, kube-scheduler) with qgpu's
extender plugged into the scheduler over HTTPS, shared by the tests of one process
(each test worker brings up its own: docs/testing.md#workers).

Tests isolate themselves with their own namespace and their own nodes (a unique label every pod of
the test selects), so they can share one cluster without seeing each other's capacity.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import pytest
from kubernetes import client, config

from tests.k8s.controlplane import ControlPlane, QgpuServer, extender_server, testbin_dir
from tests.k8s.kubeobjects import MANAGED_RESOURCES

QGPU_NAMESPACE = "qgpu-system"  # the roles' qgpu_namespace and the extender's default --commitment-namespace


class Cluster:
    """The running control plane plus the extender the scheduler calls."""

    def __init__(self, cp: ControlPlane, extender: QgpuServer):
        self.cp = cp
        self.extender = extender
        self.api_client = config.new_client_from_config(config_file=str(cp.admin_kubeconfig))
        self.api = client.CoreV1Api(self.api_client)

    def scheduler_extenders(self, node_cache_capable: bool = True) -> list[dict]:
        return [self.extender.scheduler_config(node_cache_capable=node_cache_capable, managed_resources=MANAGED_RESOURCES,
                                               timeout="30s")]

    def restart_extender(self, **kwargs: object) -> None:
        self.extender.stop()
        port = self.extender.port
        self.extender = extender_server(self.cp, port=port, **kwargs)  # type: ignore[arg-type]
        self.extender.start()

    def namespace(self) -> str:
        name = f"t-{uuid.uuid4().hex[:8]}"
        self.api.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        return name


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    bindir = testbin_dir(build=True)
    cp = ControlPlane(bindir, Path(tmp_path_factory.mktemp("controlplane")))
    extender = None
    try:
        cp.start()
        # qgpu's own namespace, as the roles create it: the extender's default --commitment-namespace
        admin = config.new_client_from_config(config_file=str(cp.admin_kubeconfig))
        client.CoreV1Api(admin).create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": QGPU_NAMESPACE}})
        extender = extender_server(cp)
        extender.start()
        c = Cluster(cp, extender)
        cp.start_scheduler(c.scheduler_extenders())
        yield c
        extender = c.extender
    finally:
        if extender is not None:
            extender.stop()
        cp.stop()


@pytest.fixture
def ns(cluster: Cluster) -> str:
    return cluster.namespace()


@pytest.fixture
def label() -> dict[str, str]:
    """A node label unique to one test; its pods select it so they only see the test's nodes."""
    return {"qgpu-test": uuid.uuid4().hex[:10]}
