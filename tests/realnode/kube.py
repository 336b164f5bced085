"""Small helpers over the official client for the real-node tests: pods that really run, their
logs, the node's allocatable, events."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import pytest
from kubernetes import client, config

from tests.polling import poll
from tests.realnode.localcluster import LocalCluster

GPU_RESOURCE_PREFIXES = ("tke.cloud.tencent.com/", "tencent.com/", "tensorstack.dev/", "nvidia.com/")


def core(cluster: LocalCluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(cluster.admin_kubeconfig)))


def apps(cluster: LocalCluster) -> client.AppsV1Api:
    return client.AppsV1Api(config.new_client_from_config(str(cluster.admin_kubeconfig)))


def namespace(api: client.CoreV1Api, name: str) -> str:
    api.create_namespace({"metadata": {"name": name}})
    # kube-controller-manager creates the namespace's default ServiceAccount; pods need it.
    poll(lambda: any(sa.metadata.name == "default" for sa in api.list_namespaced_service_account(name).items),
         timeout=30, what=f"the default ServiceAccount of namespace {name}")
    return name


def namespace_fixture(name: str) -> Any:
    """A module fixture: namespace ``name`` for the module's pods, deleted after it."""

    @pytest.fixture(scope="module")
    def ns(local_cluster: LocalCluster) -> Iterator[str]:
        api = core(local_cluster)
        yield namespace(api, name)
        api.delete_namespace(name)

    return ns


def shell_pod(name: str, image: str, script: str, *, limits: Mapping[str, str] | None = None,
              annotations: Mapping[str, str] | None = None, restart: str = "Never") -> dict[str, Any]:
    """A pod of qgpu's own image running ``script`` with sh; GPU ``limits`` as a user writes them."""
    container: dict[str, Any] = {"name": "main", "image": image, "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", script],
                                 "resources": {"limits": dict(limits or {})}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": dict(annotations or {})},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 1,
                     "automountServiceAccountToken": False, "containers": [container]}}


def read(api: client.CoreV1Api, ns: str, name: str) -> dict[str, Any]:
    return api.api_client.sanitize_for_serialization(api.read_namespaced_pod(name, ns))


def phase(api: client.CoreV1Api, ns: str, name: str) -> str:
    return str(read(api, ns, name).get("status", {}).get("phase", ""))


def wait_phase(api: client.CoreV1Api, ns: str, name: str, phases: tuple[str, ...], timeout: float = 90.0) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        pod = read(api, ns, name)
        return pod if pod.get("status", {}).get("phase") in phases else None

    try:
        return poll(probe, timeout=timeout, interval=0.2, what=f"pod {ns}/{name} in {'/'.join(phases)}")
    except AssertionError as exc:
        pod = read(api, ns, name)
        raise AssertionError(f"{exc}\nstatus: {pod.get('status')}\nevents: {events(api, ns, name)}") from None


def logs(api: client.CoreV1Api, ns: str, name: str, container: str = "main") -> str:
    return str(api.read_namespaced_pod_log(name, ns, container=container))


def wait_log(api: client.CoreV1Api, ns: str, name: str, needle: str, timeout: float = 60.0) -> str:
    def probe() -> str | None:
        try:
            text = logs(api, ns, name)
        except client.ApiException:
            return None
        return text if needle in text else None

    return poll(probe, timeout=timeout, interval=0.3, what=f"'{needle}' in the log of {ns}/{name}")


def events(api: client.CoreV1Api, ns: str, name: str) -> list[str]:
    out = api.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}")
    return [f"{e.reason}: {e.message}" for e in out.items]


def allocatable(api: client.CoreV1Api, node: str = "localhost") -> dict[str, str]:
    return dict(api.read_node(node).status.allocatable or {})


def wait_gone(api: client.CoreV1Api, ns: str, name: str, timeout: float = 60.0) -> None:
    def probe() -> bool:
        try:
            api.read_namespaced_pod(name, ns)
        except client.ApiException as exc:
            return exc.status == 404
        return False

    poll(probe, timeout=timeout, interval=0.2, what=f"pod {ns}/{name} gone")


def poll_allocatable(api: client.CoreV1Api, want: Mapping[str, str], node: str = "localhost",
                     timeout: float = 60.0) -> dict[str, str]:
    """The node's allocatable once it lists every resource of ``want`` (the kubelet reports device
    plugins' counts at its next node-status update, not at registration)."""
    def probe() -> dict[str, str] | None:
        have = allocatable(api, node)
        return have if all(k in have for k in want) else None

    return poll(probe, timeout=timeout, interval=0.5, what=f"node {node} allocatable listing {sorted(want)}")
