"""The DRA kubelet plugin: kubelet's second front door to the node's cards (docs/dra.md), served.

kube-scheduler allocates a ResourceClaim (resource.k8s.io/v1, consumable capacity) to a card of
this node's ResourceSlice (node/dra/slices.py); kubelet then calls ``NodePrepareResources`` with
the claim's namespace, name and UID only. This module is the gRPC side: the servicers hand each
claim to the ``ClaimPreparer`` (node/dra/preparer.py: the decisions, the store booking, the CDI
spec) and answer per claim; ``NodeUnprepareResources`` likewise. A failure of one claim is that
claim's ``error`` in the response, never an exception of the whole call: kubelet retries just that
claim.

Sockets (the kubelet plugin watcher's conventions, node/dra/settings.py): registration on
``<plugins_registry>/gpu.qgpu.io-reg.sock`` answering GetInfo{type DRAPlugin, name gpu.qgpu.io,
endpoint <abs DRA socket>, supported_versions [v1.DRAPlugin, v1.DRAResourceHealth]}; both services
on ``<kubelet plugins dir>/gpu.qgpu.io/dra.sock``. Device health (``v1.DRAResourceHealth``):
node/dra/health.py.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable, Mapping

import grpc

from qgpu_runtime import protos
from qgpu_runtime.contract.dra import DRIVER
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.node.dra.health import HEALTH_RESEND_S
from qgpu_runtime.node.dra.health import health_servicer as dra_health_servicer
from qgpu_runtime.node.dra.preparer import ClaimPreparer, ClaimRefused, ClaimSource
from qgpu_runtime.node.dra.settings import DraSettings
from qgpu_runtime.node.health import CardHealth
from qgpu_runtime.node.store import Store
from qgpu_runtime.node.streams import server_pool

log = logging.getLogger("qgpu_runtime.node.draplugin")  # the logger's name before the split

PLUGIN_TYPE = "DRAPlugin"
SERVICE_VERSION = "v1.DRAPlugin"
HEALTH_SERVICE = "v1.DRAResourceHealth"


def _servicers(preparer: ClaimPreparer, settings: DraSettings, registered: Callable[[bool, str], None]):
    dra, reg = protos.dra(), protos.pluginregistration()

    class DraServicer(dra.grpc.DRAPluginServicer):
        def NodePrepareResources(self, request, context):
            out = {}
            for c in request.claims:
                try:
                    devices = preparer.prepare(c.namespace, c.uid, c.name)
                    out[c.uid] = dra.pb2.NodePrepareResourceResponse(devices=[dra.pb2.Device(
                        request_names=list(d.request_names), pool_name=d.pool_name, device_name=d.device_name,
                        cdi_device_ids=list(d.cdi_device_ids), **({"share_id": d.share_id} if d.share_id else {}))
                        for d in devices])
                except ClaimRefused as exc:
                    log.warning("NodePrepareResources refused: %s", exc)
                    out[c.uid] = dra.pb2.NodePrepareResourceResponse(error=str(exc))
                except Exception as exc:  # noqa: BLE001 - one claim's failure must not fail the others
                    log.exception("NodePrepareResources %s/%s failed", c.namespace, c.name)
                    out[c.uid] = dra.pb2.NodePrepareResourceResponse(
                        error=f"ResourceClaim {c.namespace}/{c.name}: preparing failed: {type(exc).__name__}: {exc}")
            return dra.pb2.NodePrepareResourcesResponse(claims=out)

        def NodeUnprepareResources(self, request, context):
            out = {}
            for c in request.claims:
                try:
                    preparer.unprepare(c.namespace, c.uid, c.name)
                    out[c.uid] = dra.pb2.NodeUnprepareResourceResponse()
                except Exception as exc:  # noqa: BLE001 - reported per claim; kubelet retries it
                    log.exception("NodeUnprepareResources %s/%s failed", c.namespace, c.name)
                    out[c.uid] = dra.pb2.NodeUnprepareResourceResponse(
                        error=f"ResourceClaim {c.namespace}/{c.name}: unpreparing failed: {type(exc).__name__}: {exc}")
            return dra.pb2.NodeUnprepareResourcesResponse(claims=out)

    class RegistrationServicer(reg.grpc.RegistrationServicer):
        def GetInfo(self, request, context):
            return reg.pb2.PluginInfo(type=PLUGIN_TYPE, name=DRIVER, endpoint=str(settings.dra_socket),
                                      supported_versions=[SERVICE_VERSION, HEALTH_SERVICE])

        def NotifyRegistrationStatus(self, request, context):
            registered(bool(request.plugin_registered), str(request.error))
            return reg.pb2.RegistrationStatusResponse()

    return DraServicer(), RegistrationServicer()


class DraKubeletPlugin:
    """The two sockets, served; the node manager holds it where it would hold the device plugins'
    registration (``serve``, ``stop``, ``check_kubelet``)."""

    def __init__(self, settings: DraSettings, preparer: ClaimPreparer, health: CardHealth | None = None,
                 health_resend_s: float = HEALTH_RESEND_S) -> None:
        """``health``: the node's CardHealth (None: the preparer's cards, always healthy)."""
        self.plugins: list = []  # no device-plugin servers in DRA mode
        self.settings = settings
        self.preparer = preparer
        self.health = health if health is not None else CardHealth(preparer.cards)
        self.health_resend_s = health_resend_s
        self._stopping = threading.Event()
        self.registered: tuple[bool, str] | None = None
        self._servers: list[tuple[grpc.Server, Path, int]] = []

    def _on_registration(self, ok: bool, error: str) -> None:
        self.registered = (ok, error)
        if ok:
            log.info("kubelet registered DRA driver %s (%s)", DRIVER, self.settings.dra_socket)
        else:
            log.error("kubelet refused DRA driver %s: %s", DRIVER, error)

    def serve(self) -> None:
        dra_servicer, reg_servicer = _servicers(self.preparer, self.settings, self._on_registration)
        self._stopping = threading.Event()
        health_servicer = dra_health_servicer(self.settings.node, sorted(self.preparer.cards), self.health,
                                              self._stopping, self.health_resend_s)

        def add_services(server: grpc.Server) -> None:
            protos.dra().grpc.add_DRAPluginServicer_to_server(dra_servicer, server)
            protos.dra_health().grpc.add_DRAResourceHealthServicer_to_server(health_servicer, server)

        # The services first: kubelet calls GetInfo as soon as the registration socket appears and
        # then connects to the endpoint it names.
        self._servers.append(self._serve_on(self.settings.dra_socket, "dra", add_services))
        self._servers.append(self._serve_on(self.settings.registration_socket, "dra-reg",
                                            lambda s: protos.pluginregistration().grpc.add_RegistrationServicer_to_server(
                                                reg_servicer, s)))
        log.info("DRA driver %s: serving %s, registration %s, CDI specs in %s", DRIVER, self.settings.dra_socket,
                 self.settings.registration_socket, self.settings.cdi_dir)

    @staticmethod
    def _serve_on(socket: Path, prefix: str, add: Callable[[grpc.Server], None]) -> tuple[grpc.Server, Path, int]:
        socket.parent.mkdir(parents=True, exist_ok=True)
        if socket.exists() or socket.is_symlink():
            socket.unlink()  # a stale socket from a previous run
        # A health stream holds a worker for as long as kubelet watches: node/streams.py bounds them.
        server = grpc.server(server_pool(prefix))
        add(server)
        server.add_insecure_port(f"unix://{socket}")
        server.start()
        return server, socket, os.stat(socket).st_ino

    def alive(self) -> bool:
        try:
            return bool(self._servers) and all(os.stat(p).st_ino == ino for _, p, ino in self._servers)
        except FileNotFoundError:
            return False

    def check_kubelet(self) -> None:
        """Serve again when a socket vanished (someone cleaned the folder): kubelet's plugin watcher
        registers whatever appears in its registry folder, so serving is registering."""
        if self._servers and not self.alive():
            log.warning("DRA sockets gone; serving them again")
            self.stop()
            self.serve()

    def stop(self) -> None:
        self._stopping.set()
        self.health.wake()  # health streams end (a stopped server also cancels them)
        for server, socket, inode in self._servers:
            server.stop(grace=0.5).wait()
            try:
                if os.stat(socket).st_ino == inode:
                    socket.unlink()
            except FileNotFoundError:
                pass
        self._servers = []


def dra_plugin(config, cards: Mapping[int, CardInfo], store: Store, claims: ClaimSource, policy: Callable[[], str],
               health: CardHealth, node_labels: Callable[[], Mapping[str, str]] | None = None) -> DraKubeletPlugin:
    """The plugin for the node manager's ``config`` (ManagerConfig with ``dra`` set)."""
    settings = DraSettings(config.node, config.kubelet_plugins_dir, config.plugins_registry_dir, config.cdi_dir,
                           config.pass_device_specs)
    return DraKubeletPlugin(settings, ClaimPreparer(settings, cards, store, claims, policy, health.unhealthy,
                                                    node_labels=node_labels), health)
