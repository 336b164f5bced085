"""The node manager's only door to the Kubernetes API (pods on this node, annotations, node labels).

Kept small so it can be exercised against a real kube-apiserver fixture (tests/k8s) without
touching the rest of the manager. Responses are read as raw JSON (``_preload_content=False``),
which is both faster than the generated models and the API-JSON shape the rest of qgpu reads.
"""

from __future__ import annotations

import json
from typing import Any, Mapping


class KubePodSource:
    def __init__(self, kubeconfig: str | None = None, context: str | None = None) -> None:
        from kubernetes import client, config

        if kubeconfig:
            api_client = config.new_client_from_config(config_file=kubeconfig, context=context)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config(context=context)
            api_client = client.ApiClient()
        self._core = client.CoreV1Api(api_client)

    def pods_on_node(self, node: str) -> list[dict[str, Any]]:
        resp = self._core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}", _preload_content=False)
        return list(json.loads(resp.data).get("items", []))

    def list_pods(self) -> list[dict[str, Any]]:
        resp = self._core.list_pod_for_all_namespaces(_preload_content=False)
        return list(json.loads(resp.data).get("items", []))

    def list_nodes(self) -> list[dict[str, Any]]:
        resp = self._core.list_node(_preload_content=False)
        return list(json.loads(resp.data).get("items", []))

    def patch_pod_annotations(self, namespace: str, name: str, values: Mapping[str, str]) -> None:
        self._core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": dict(values)}})

    def patch_node(self, node: str, labels: Mapping[str, str], annotations: Mapping[str, str]) -> None:
        self._core.patch_node(node, {"metadata": {"labels": dict(labels), "annotations": dict(annotations)}})

    def node_labels(self, node: str) -> dict[str, str]:
        resp = self._core.read_node(node, _preload_content=False)
        return dict((json.loads(resp.data).get("metadata") or {}).get("labels") or {})

    def record_event(self, namespace: str, pod: str, pod_uid: str, reason: str, message: str) -> None:
        """A Warning Event on the pod, so ``kubectl describe pod`` shows why qgpu acted on it."""
        from datetime import datetime, timezone

        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._core.create_namespaced_event(namespace, {
            "metadata": {"generateName": f"{pod}.qgpu-", "namespace": namespace},
            "involvedObject": {"kind": "Pod", "apiVersion": "v1", "namespace": namespace, "name": pod, "uid": pod_uid},
            "reason": reason, "message": message, "type": "Warning",
            "source": {"component": "qgpu-manager"}, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        })
