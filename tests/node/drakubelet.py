"""kubelet's side of the DRA plugin's two sockets, for tests: the plugin watcher's GetInfo and
NotifyRegistrationStatus, the v1.DRAPlugin calls and the v1.DRAResourceHealth stream, over the real
unix sockets."""

from __future__ import annotations

import grpc

from qgpu_runtime import protos
from qgpu_runtime.node.dra.settings import DraSettings


class Kubelet:
    """kubelet's side of the two sockets."""

    def __init__(self, settings: DraSettings) -> None:
        self.settings = settings

    def get_info(self):
        reg = protos.pluginregistration()
        with grpc.insecure_channel(f"unix://{self.settings.registration_socket}") as ch:
            return reg.grpc.RegistrationStub(ch).GetInfo(reg.pb2.InfoRequest(), timeout=5)

    def notify(self, ok: bool, error: str = "") -> None:
        reg = protos.pluginregistration()
        with grpc.insecure_channel(f"unix://{self.settings.registration_socket}") as ch:
            reg.grpc.RegistrationStub(ch).NotifyRegistrationStatus(
                reg.pb2.RegistrationStatus(plugin_registered=ok, error=error), timeout=5)

    def _call(self, method: str, claims: list[tuple[str, str, str]]):
        dra = protos.dra()
        with grpc.insecure_channel(f"unix://{self.settings.dra_socket}") as ch:
            stub = dra.grpc.DRAPluginStub(ch)
            request_type = dra.pb2.NodePrepareResourcesRequest if method == "prepare" else dra.pb2.NodeUnprepareResourcesRequest
            call = stub.NodePrepareResources if method == "prepare" else stub.NodeUnprepareResources
            return call(request_type(claims=[dra.pb2.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]),
                        timeout=5).claims

    def watch_health(self, timeout_s: float = 10):
        """(channel, stream) of NodeWatchResources; the caller closes the channel."""
        hl = protos.dra_health()
        ch = grpc.insecure_channel(f"unix://{self.settings.dra_socket}")
        return ch, hl.grpc.DRAResourceHealthStub(ch).NodeWatchResources(hl.pb2.NodeWatchResourcesRequest(),
                                                                       timeout=timeout_s)

    def prepare(self, *claims: tuple[str, str, str]):
        return self._call("prepare", list(claims))

    def unprepare(self, *claims: tuple[str, str, str]):
        return self._call("unprepare", list(claims))
