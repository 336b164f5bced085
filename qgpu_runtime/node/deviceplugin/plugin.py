"""One device-plugin gRPC server per served resource, on its own unix socket.

The servicer is thin: every decision lives behind :class:`~qgpu_runtime.node.deviceplugin.devices.DeviceService`
(the node manager: matching, store, health). This module owns the gRPC edge — socket lifecycle, registration with
kubelet, turning a manager answer into protobuf, and a refused Allocate into a gRPC error whose
text kubelet shows on the pod (UnexpectedAdmissionError).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import grpc

from qgpu_runtime import protos
from qgpu_runtime.node.deviceplugin.devices import AllocateRefused, DeviceService
from qgpu_runtime.node.deviceplugin.resources import ResourceKind
from qgpu_runtime.node.streams import StreamSlots, server_pool

log = logging.getLogger("qgpu_runtime.node.plugin")  # the name from before node/ became two doors: operators grep log lines by logger
API_VERSION = "v1beta1"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


def _servicer_class():
    api = protos.deviceplugin()
    pb2 = api.pb2

    class Servicer(api.grpc.DevicePluginServicer):
        def __init__(self, kind: ResourceKind, devices: DeviceService, stopping: threading.Event) -> None:
            self.kind = kind
            self.devices = devices
            self.stopping = stopping
            self.streams = StreamSlots()  # a stream holds a worker: bounded, so Allocate always has one

        def GetDevicePluginOptions(self, request, context):
            return pb2.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)

        def ListAndWatch(self, request, context):
            with self.streams.slot(context, f"ListAndWatch {self.kind.name}"):
                seen = -1
                while context.is_active() and not self.stopping.is_set():
                    version, devices = self.devices.wait_devices(self.kind, seen, timeout_s=0.5)
                    if version == seen:
                        continue
                    seen = version
                    yield pb2.ListAndWatchResponse(devices=[pb2.Device(ID=d, health=HEALTHY if ok else UNHEALTHY)
                                                            for d, ok in devices])

        def GetPreferredAllocation(self, request, context):
            out = []
            for req in request.container_requests:
                ids = self.devices.preferred(self.kind, list(req.available_deviceIDs),
                                             list(req.must_include_deviceIDs), int(req.allocation_size))
                out.append(pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
            return pb2.PreferredAllocationResponse(container_responses=out)

        def Allocate(self, request, context):
            responses = []
            for req in request.container_requests:
                try:
                    grant = self.devices.allocate(self.kind, tuple(req.devices_ids))
                except AllocateRefused as exc:
                    log.warning("Allocate %s refused: %s", self.kind.name, exc)
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                responses.append(pb2.ContainerAllocateResponse(
                    envs=grant.envs,
                    mounts=[pb2.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                            for m in grant.mounts],
                    devices=[pb2.DeviceSpec(container_path=d.container_path, host_path=d.host_path,
                                            permissions=d.permissions) for d in grant.devices],
                    annotations=grant.annotations,
                ))
            return pb2.AllocateResponse(container_responses=responses)

        def PreStartContainer(self, request, context):
            self.devices.prestart(self.kind, tuple(request.devices_ids))
            return pb2.PreStartContainerResponse()

    return Servicer


class PluginServer:
    """Serves one resource on ``<plugin_dir>/<kind.socket_name>`` and registers it with kubelet."""

    def __init__(self, kind: ResourceKind, devices: DeviceService, plugin_dir: Path) -> None:
        self.kind = kind
        self.devices = devices
        self.socket = plugin_dir / kind.socket_name
        self._server: grpc.Server | None = None
        self._stopping = threading.Event()
        self._inode: int | None = None

    def start(self) -> None:
        self._stopping = threading.Event()
        if self.socket.exists() or self.socket.is_symlink():
            self.socket.unlink()  # a stale socket from a previous run
        server = grpc.server(server_pool(f"dp-{self.kind.short}"))
        protos.deviceplugin().grpc.add_DevicePluginServicer_to_server(
            _servicer_class()(self.kind, self.devices, self._stopping), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        self._inode = os.stat(self.socket).st_ino

    def alive(self) -> bool:
        """False once kubelet (or anyone) removed or replaced our socket: time to serve again."""
        try:
            return self._server is not None and os.stat(self.socket).st_ino == self._inode
        except FileNotFoundError:
            return False

    def register(self, kubelet_socket: Path, timeout_s: float = 5.0) -> None:
        api = protos.deviceplugin()
        with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
            api.grpc.RegistrationStub(channel).Register(api.pb2.RegisterRequest(
                version=API_VERSION, endpoint=self.socket.name, resource_name=self.kind.name,
                options=api.pb2.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True),
            ), timeout=timeout_s)

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
            self._server = None
        try:
            if self._inode is not None and os.stat(self.socket).st_ino == self._inode:
                self.socket.unlink()
        except FileNotFoundError:
            pass
