"""Event bodies (core/v1), so every qgpu component reports on API objects alike."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

# An Event's message is for a person reading `kubectl describe`; the events.k8s.io API caps its
# `note` at 1 KiB, and a message built from a file's error text (the re-wiring watcher) could be longer.
MAX_MESSAGE = 1024


def node_reference(node: str) -> dict[str, str]:
    """A Node as an Event's involvedObject (uid = name, as the kubelet writes it; `kubectl describe
    node` lists such Events)."""
    return {"kind": "Node", "apiVersion": "v1", "name": node, "uid": node}


def event_body(namespace: str, involved: Mapping[str, str], event_type: str, reason: str, message: str,
               source: Mapping[str, str]) -> dict[str, Any]:
    """A core/v1 Event on ``involved`` (Node Events go to namespace default, as the kubelet's do)."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "metadata": {"generateName": f"{involved['name']}.qgpu-", "namespace": namespace},
        "involvedObject": dict(involved), "reason": reason, "message": message[:MAX_MESSAGE], "type": event_type,
        "source": dict(source), "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }


class NodeEvents:
    """Posts Events on one Node with the credentials of ``kubeconfig`` (retried, bounded by the
    client's timeouts); what the caller needs is ``create events`` in namespace default."""

    def __init__(self, kubeconfig: str, node: str, component: str) -> None:
        from kubernetes import client

        from qgpu_runtime.kube.client import drain
        from qgpu_runtime.kube.reader import ApiCaller, load_client

        self._call = ApiCaller(load_client(kubeconfig, None))
        self._core = client.CoreV1Api(self._call.api_client)
        self._drain = drain
        self.node = node
        self.component = component

    def post(self, event_type: str, reason: str, message: str) -> None:
        body = event_body("default", node_reference(self.node), event_type, reason, message,
                          {"component": self.component, "host": self.node})
        self._drain(self._call(f"recording event {reason} on node {self.node}", lambda: self._core.create_namespaced_event(
            "default", body, _preload_content=False, _request_timeout=self._call.timeout)))
