"""A test kubelet: kubelet's side of the device-plugin and pod-resources gRPC APIs, for real.

It serves ``Registration`` on ``<dir>/kubelet.sock``, connects back to every plugin that registers,
consumes its ListAndWatch stream, and admits pods the way kubelet does: containers in spec order,
a container's resources in random order (kubelet walks a Go map; ``seed`` makes a run repeatable),
for each resource GetPreferredAllocation (when offered) then Allocate, with device IDs taken from
the healthy, unused ones. It also serves pod-resources ``List`` from what it handed out, one
``ContainerDevices`` per device ID as the real kubelet does
(``pkg/kubelet/cm/container_manager.go containerDevicesFromResourceDeviceInstances``), and can
"restart" (delete every socket in the folder and serve a new kubelet.sock), as kubelet does.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import grpc

from qgpu_runtime import protos


@dataclass
class Plugin:
    resource: str
    endpoint: str
    options: Any
    channel: grpc.Channel
    stub: Any
    devices: dict[str, str] = field(default_factory=dict)  # id -> health
    updates: int = 0


class TestKubelet:
    __test__ = False  # not a pytest class

    def __init__(self, plugin_dir: Path, pod_resources_socket: Path | None = None, seed: int | None = None) -> None:
        self.dir = plugin_dir
        self.rng = random.Random(seed)
        self.pod_resources_socket = pod_resources_socket
        self.plugins: dict[str, Plugin] = {}
        self.registrations: list[str] = []
        self.held: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}  # (ns, pod) -> container -> resource -> ids
        self.responses: dict[tuple[str, str, str, str], Any] = {}  # (ns, pod, container, resource) -> response
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._pr_server: grpc.Server | None = None
        self._watchers: list[threading.Thread] = []

    # --- lifecycle ---
    def start(self) -> None:
        api = protos.deviceplugin()
        kubelet = self

        class Registration(api.grpc.RegistrationServicer):
            def Register(self, request, context):
                kubelet._on_register(request)
                return api.pb2.Empty()

        self.dir.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api.grpc.add_RegistrationServicer_to_server(Registration(), server)
        server.add_insecure_port(f"unix://{self.dir / 'kubelet.sock'}")
        server.start()
        self._server = server
        if self.pod_resources_socket and self._pr_server is None:
            self._start_pod_resources()

    def _start_pod_resources(self) -> None:
        api = protos.podresources()
        kubelet = self

        class Lister(api.grpc.PodResourcesListerServicer):
            def List(self, request, context):
                with kubelet._cond:
                    pods = [api.pb2.PodResources(namespace=ns, name=name, containers=[
                        api.pb2.ContainerResources(name=c, devices=[
                            api.pb2.ContainerDevices(resource_name=r, device_ids=[d]) for r, ids in res.items() for d in ids])
                        for c, res in containers.items()]) for (ns, name), containers in kubelet.held.items()]
                return api.pb2.ListPodResourcesResponse(pod_resources=pods)

        self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api.grpc.add_PodResourcesListerServicer_to_server(Lister(), server)
        server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        server.start()
        self._pr_server = server

    def stop(self) -> None:
        if self._server:
            self._server.stop(0).wait()
            self._server = None
        with self._cond:
            plugins, self.plugins = list(self.plugins.values()), {}
        for p in plugins:
            p.channel.close()
        if self._pr_server:
            self._pr_server.stop(0).wait()
            self._pr_server = None

    def restart(self) -> None:
        """What kubelet does on restart: forget plugins, wipe the folder's sockets, serve anew."""
        if self._server:
            self._server.stop(0).wait()
        with self._cond:
            plugins, self.plugins = list(self.plugins.values()), {}
        for p in plugins:
            p.channel.close()
        for entry in self.dir.iterdir():
            if entry.is_socket():
                entry.unlink()
        self.start()

    # --- registration and ListAndWatch ---
    def _on_register(self, request) -> None:
        api = protos.deviceplugin()
        assert request.version == "v1beta1", request.version
        channel = grpc.insecure_channel(f"unix://{self.dir / request.endpoint}")
        plugin = Plugin(request.resource_name, request.endpoint, request.options, channel, api.grpc.DevicePluginStub(channel))
        with self._cond:
            old = self.plugins.get(request.resource_name)
            self.plugins[request.resource_name] = plugin
            self.registrations.append(request.resource_name)
            self._cond.notify_all()
        if old:
            old.channel.close()
        t = threading.Thread(target=self._watch, args=(plugin,), daemon=True)
        t.start()
        self._watchers.append(t)

    def _watch(self, plugin: Plugin) -> None:
        api = protos.deviceplugin()
        try:
            for resp in plugin.stub.ListAndWatch(api.pb2.Empty()):
                with self._cond:
                    plugin.devices = {d.ID: d.health for d in resp.devices}
                    plugin.updates += 1
                    self._cond.notify_all()
        except grpc.RpcError:
            return  # plugin went away or channel closed

    def wait_for(self, predicate, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"test kubelet: condition not met in {timeout}s; registrations {self.registrations}")
                self._cond.wait(left)

    def devices(self, resource: str) -> dict[str, str]:
        with self._cond:
            p = self.plugins.get(resource)
            return dict(p.devices) if p else {}

    # --- admission ---
    def _free(self, resource: str) -> list[str]:
        in_use = {d for containers in self.held.values() for res in containers.values() for d in res.get(resource, [])}
        return sorted((d for d, h in self.devices(resource).items() if h == "Healthy" and d not in in_use),
                      key=lambda d: tuple(int(x) if x.isdigit() else x for x in d.rsplit("-", 2)))

    def allocate(self, resource: str, ids: list[str]):
        api = protos.deviceplugin()
        req = api.pb2.AllocateRequest(container_requests=[api.pb2.ContainerAllocateRequest(devices_ids=ids)])
        return self.plugins[resource].stub.Allocate(req, timeout=10)

    def preferred(self, resource: str, available: list[str], size: int, must: list[str] = ()) -> list[str]:
        api = protos.deviceplugin()
        req = api.pb2.PreferredAllocationRequest(container_requests=[api.pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=list(must), allocation_size=size)])
        return list(self.plugins[resource].stub.GetPreferredAllocation(req, timeout=10).container_responses[0].deviceIDs)

    def prestart(self, resource: str, ids: list[str]) -> None:
        api = protos.deviceplugin()
        self.plugins[resource].stub.PreStartContainer(api.pb2.PreStartContainerRequest(devices_ids=ids), timeout=10)

    def admit(self, pod: Mapping[str, Any]) -> dict[str, dict[str, str]]:
        """Admit one pod: returns container -> merged envs. Raises grpc.RpcError as kubelet would see it."""
        meta = pod["metadata"]
        key = (meta.get("namespace", "default"), meta["name"])
        envs: dict[str, dict[str, str]] = {}
        for container in pod["spec"]["containers"]:
            limits = (container.get("resources") or {}).get("limits") or {}
            wanted = [(r, q) for r, q in limits.items() if r in self.plugins]
            self.rng.shuffle(wanted)
            for resource, qty in wanted:
                size = int(qty)
                with self._cond:
                    free = self._free(resource)
                if len(free) < size:
                    raise RuntimeError(f"test kubelet: {resource}: {size} wanted, {len(free)} free")
                ids = free[:size]
                if self.plugins[resource].options.get_preferred_allocation_available:
                    ids = self.preferred(resource, free, size)
                resp = self.allocate(resource, ids)
                with self._cond:
                    self.held.setdefault(key, {}).setdefault(container["name"], {})[resource] = list(ids)
                    self.responses[(*key, container["name"], resource)] = resp.container_responses[0]
                envs.setdefault(container["name"], {}).update(resp.container_responses[0].envs)
                if self.plugins[resource].options.pre_start_required:
                    self.prestart(resource, ids)
        return envs

    def forget(self, namespace: str, name: str) -> None:
        with self._cond:
            self.held.pop((namespace, name), None)


def socket_inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None
