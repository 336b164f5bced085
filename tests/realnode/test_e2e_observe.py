"""Seeing it on the real node (issue 26 §1): a real Prometheus (Debian's package, installed by
scripts/local-cluster-deps) scrapes the node managers at the endpoints of the Service the roles
deployed (`gpu-manager-metric`, at the port and path of its prometheus.io/* annotations) and finds
a running pod's share; `qgpu status` reads the manager DaemonSet's pod through the apiserver's pod
proxy; the Node says whether its shares are enforced."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from kubernetes import client

from tests.k8s.controlplane import free_port
from tests.polling import poll
from tests.realnode import kube
from tests.realnode.localcluster import QGPU_NAMESPACE, LocalCluster
from tests.realnode.test_e2e_dialects import cluster_image, delete

CORE = "tke.cloud.tencent.com/qgpu-core"
MEMORY = "tke.cloud.tencent.com/qgpu-memory"
ROOT = Path(__file__).resolve().parents[2]

ns = kube.namespace_fixture("observe")


SERVICE = "gpu-manager-metric"  # qgpu_manager_metrics_service_name's default, gpu-manager's name


def service_targets(cluster: LocalCluster) -> list[dict[str, Any]]:
    """What the annotation-driven job of an upstream Prometheus derives from the Service (its
    kubernetes_sd_configs, docs/operations.md), as a file_sd target list: Debian's Prometheus is built
    without Kubernetes service discovery. The ready endpoints of the Service's EndpointSlices, at the
    port and path its prometheus.io/* annotations name; nothing when it is not annotated for scraping."""
    api = kube.core(cluster)
    service = api.read_namespaced_service(SERVICE, QGPU_NAMESPACE)
    notes = service.metadata.annotations or {}
    if notes.get("prometheus.io/scrape") != "true":
        return []
    slices = client.DiscoveryV1Api(api.api_client).list_namespaced_endpoint_slice(
        QGPU_NAMESPACE, label_selector=f"kubernetes.io/service-name={SERVICE}").items
    addresses = sorted({a for s in slices for e in s.endpoints or [] if e.conditions is None or e.conditions.ready is not False
                        for a in e.addresses})
    return [{"targets": [f"{a}:{notes['prometheus.io/port']}" for a in addresses],
             "labels": {"service": SERVICE, "__metrics_path__": notes.get("prometheus.io/path", "/metrics")}}] if addresses else []


def scrape_config(targets_file: Path) -> dict[str, Any]:
    return {"global": {"scrape_interval": "2s", "scrape_timeout": "2s"}, "scrape_configs": [{
        "job_name": "kubernetes-service-endpoints", "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "2s"}]}]}


@pytest.fixture(scope="module")
def prometheus(local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: scripts/local-cluster-deps installs Debian's package"
    work = tmp_path_factory.mktemp("prometheus")
    targets = poll(lambda: service_targets(local_cluster), timeout=60, what=f"the endpoints of Service {SERVICE}")
    (work / "targets.json").write_text(json.dumps(targets))
    (work / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(work / "targets.json")))
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        poll(lambda: proc.poll() is None and _get(f"{url}/-/ready") is not None, timeout=60,
             what=f"prometheus ready (log: {work / 'prometheus.log'})")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _get(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read()
    except OSError:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return {}


def query(url: str, promql: str) -> list[dict[str, Any]]:
    doc = _get(f"{url}/api/v1/query?query={urllib.parse.quote(promql)}") or {}
    return list((doc.get("data") or {}).get("result") or [])


def test_prometheus_finds_a_running_pods_share_through_the_deployed_service(local_cluster: LocalCluster, ns: str,
                                                                            prometheus: str) -> None:
    api = kube.core(local_cluster)
    api.create_namespaced_pod(ns, kube.shell_pod("shared", cluster_image(local_cluster), "sleep 600",
                                                 limits={CORE: "30", MEMORY: "4"}))
    try:
        kube.wait_phase(api, ns, "shared", ("Running",))
        selector = f'namespace="{ns}",pod_name="shared"'
        memory = poll(lambda: query(prometheus, f"container_request_gpu_memory{{{selector}}}"), timeout=60,
                      what="prometheus scraping the pod's requested memory")
        ((sample),) = memory
        assert sample["metric"]["service"] == "gpu-manager-metric" and sample["metric"]["node"] == "localhost", sample
        assert float(sample["value"][1]) == 4096, sample
        (cards,) = query(prometheus, f"container_request_gpu_utilization{{{selector}}}")
        assert float(cards["value"][1]) == 0.3, cards
        targets = (_get(f"{prometheus}/api/v1/targets") or {})["data"]["activeTargets"]
        assert [t["health"] for t in targets] == ["up"], targets  # the one manager of the one node

        # `qgpu status` reads the manager DaemonSet's pod through the apiserver's pod proxy
        out = subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", "status", "--kubeconfig",
                              str(local_cluster.admin_kubeconfig), "--node", "localhost", "--json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        (node,) = json.loads(out.stdout)["nodes"]
        assert node["usage_error"] == "", node["usage_error"]
        (shared,) = [w for c in node["cards"] for w in c["workloads"] if w["name"] == f"{ns}/shared"]
        assert (shared["core_milli"], shared["memory_mib"], shared["used_memory_mib"]) == (300, 4096, 0), shared
        assert all(c["memory_used_mib"] is not None for c in node["cards"]), node["cards"]
    finally:
        delete(local_cluster, ns, "shared")


def test_the_node_says_its_shares_are_not_enforced_on_simulated_cards(local_cluster: LocalCluster) -> None:
    api = kube.core(local_cluster)
    node = api.api_client.sanitize_for_serialization(api.read_node_status("localhost"))
    (condition,) = [c for c in node["status"]["conditions"] if c["type"] == "QGPUSharesEnforced"]
    assert (condition["status"], condition["reason"]) == ("False", "SimulatedGPUs"), condition
    reasons = [e.reason for e in api.list_namespaced_event("default", field_selector="involvedObject.kind=Node").items]
    assert "SharesNotEnforced" in reasons, reasons
