"""Client for kubelet's pod-resources API (v1): which device IDs each container holds.

The real kubelet answers ``List`` with one ``ContainerDevices`` per device ID
(``pkg/kubelet/cm/container_manager.go containerDevicesFromResourceDeviceInstances``): a container
holding 30 qgpu-core and 4 qgpu-memory devices comes back as 34 entries of one ID each. Callers
compare whole grants (the owner check at PreStartContainer, reconciliation's reassign step), so
:func:`list_held` merges the entries back into one per (namespace, pod, container, resource).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from qgpu_runtime import protos

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


@dataclass(frozen=True)
class HeldDevices:
    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: frozenset[str]


def list_held(socket: Path, timeout_s: float = 5.0) -> list[HeldDevices] | None:
    """Every (container, resource) with devices, one entry each however kubelet split them, or None
    when kubelet does not serve the API here."""
    if not socket.exists():
        return None
    api = protos.podresources()
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = api.grpc.PodResourcesListerStub(channel)
        try:
            resp = stub.List(api.pb2.ListPodResourcesRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED):
                return None
            raise
    merged: dict[tuple[str, str, str, str], set[str]] = {}
    for p in resp.pod_resources:
        for c in p.containers:
            for d in c.devices:
                merged.setdefault((p.namespace, p.name, c.name, d.resource_name), set()).update(d.device_ids)
    return [HeldDevices(ns, pod, container, resource, frozenset(ids))
            for (ns, pod, container, resource), ids in merged.items()]
