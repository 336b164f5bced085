"""The DRA kubelet plugin: kubelet's second front door to the node's cards (docs/dra.md).

kube-scheduler allocates a ResourceClaim (resource.k8s.io/v1, consumable capacity) to a card of
this node's ResourceSlice; kubelet then calls ``NodePrepareResources`` with the claim's namespace,
name and UID only. This plugin reads the claim from the apiserver, checks the UID, decodes the
allocation with ``contract.dra.claim_shares`` and each request's class from the claim's opaque
ShareConfig (``contract.dra.claim_share_settings``), books the shares in the node store (the same
``shares`` table the device plugin writes, keyed by the claim's UID, so `qgpu status`, the metrics
and the isolation engine read one store) together with the pods of its ``status.reservedFor``
(node/tenants.py makes the containers that reference the claim its tenant), and writes a CDI spec
whose devices carry the container environment the device-plugin path sets (node/response.py).
``NodeUnprepareResources`` undoes both.

Order and crash safety: prepare books first and writes the spec second; a repeated prepare
answers from the store when the spec is in place, and goes the whole way again (replacing its own
booking) when it is not, which repairs a crash between the two writes. Unprepare removes the spec
first, then the booking; both steps accept what is already gone, so it can be repeated, run by a
restarted plugin, or run for a claim never prepared. A failure of one claim is that claim's
``error`` in the response, never an exception of the whole call: kubelet retries just that claim.

Sockets (the kubelet plugin watcher's conventions): registration on
``<plugins_registry>/gpu.qgpu.io-reg.sock`` answering GetInfo{type DRAPlugin, name gpu.qgpu.io,
endpoint <abs DRA socket>, supported_versions [v1.DRAPlugin, v1.DRAResourceHealth]}; both services
on ``<kubelet plugins dir>/gpu.qgpu.io/dra.sock``.

Device health (``v1.DRAResourceHealth.NodeWatchResources``, kubelet's ResourceHealthStatus gate):
each stream sends the health of every card of the node (pool = node, device ``gpu-<index>``) at
once, again whenever ``CardHealth`` changes (an XID marks a card unhealthy), and again every
``HEALTH_RESEND_S`` so kubelet's timeout never turns them unknown; it waits on CardHealth's version
and ends when the manager stops (``CardHealth.close``), the server stops or kubelet goes away.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import grpc

from qgpu_runtime import protos
from qgpu_runtime.contract.dra import DRIVER, device_name, pool_name
from qgpu_runtime.contract.draclaim import ClaimShare, DraClaimError, ShareSettings, claim_share_settings, claim_shares
from qgpu_runtime.contract.record import CardShare
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model import AppClass
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD
from qgpu_runtime.node import cdi
from qgpu_runtime.node.health import CardHealth
from qgpu_runtime.node.response import CONTROL_DEVICES, card_envs, t9k_share_envs
from qgpu_runtime.node.store import PreparedClaim, ReservedPod, Share, Store
from qgpu_runtime.node.streams import StreamSlots, server_pool
from qgpu_runtime.node.tenants import dominant_class
from qgpu_runtime.placement.commitments import CardUse, Commitment, over_commitment

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SERVICE_VERSION = "v1.DRAPlugin"
HEALTH_SERVICE = "v1.DRAResourceHealth"
# kubelet reads a device's health as unknown once its last report is older than the device's
# health_check_timeout_seconds (30 s when unset): the full list is sent again every
# HEALTH_RESEND_S even when nothing changed, well inside HEALTH_TIMEOUT_S.
HEALTH_RESEND_S = 10.0
HEALTH_TIMEOUT_S = 60


@dataclass(frozen=True)
class DraSettings:
    node: str
    kubelet_plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    plugins_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    cdi_dir: Path = cdi.DEFAULT_DIR
    pass_device_specs: bool = True

    @property
    def dra_socket(self) -> Path:
        return (self.kubelet_plugins_dir / DRIVER / "dra.sock").absolute()

    @property
    def registration_socket(self) -> Path:
        return (self.plugins_registry_dir / f"{DRIVER}-reg.sock").absolute()


class ClaimSource(Protocol):
    def resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The claim as API JSON; raises with a message naming the call and the reason."""
        ...


class ClaimRefused(RuntimeError):
    """This claim cannot be prepared; the message is the per-claim error kubelet reports."""


@dataclass(frozen=True)
class PreparedDevice:
    """One device of kubelet's answer (dra/v1 ``Device``)."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"requestNames": list(self.request_names), "pool": self.pool_name, "device": self.device_name,
                "cdiDeviceIDs": list(self.cdi_device_ids), "shareID": self.share_id}

    @classmethod
    def of_json(cls, doc: Mapping[str, Any]) -> PreparedDevice:
        return cls(tuple(doc["requestNames"]), str(doc["pool"]), str(doc["device"]), tuple(doc["cdiDeviceIDs"]),
                   str(doc.get("shareID") or ""))


class ClaimPreparer:
    """Prepare and unprepare claims: the decisions, no gRPC (tested directly and through it)."""

    def __init__(self, settings: DraSettings, cards: Mapping[int, CardInfo], store: Store, claims: ClaimSource,
                 policy: Callable[[], str], unhealthy: Callable[[], Mapping[int, str]] = dict,
                 device_exists: Callable[[str], bool] = os.path.exists,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        self.settings = settings
        self.cards = dict(cards)
        self.store = store
        self.claims = claims
        self.policy = policy
        self.unhealthy = unhealthy
        self.device_exists = device_exists
        self.clock_ns = clock_ns
        self._lock = threading.Lock()  # one claim at a time: a booking reads every other one
        for stale in cdi.remove_stale_temporaries(settings.cdi_dir):  # a writer killed mid-write
            log.warning("removed a CDI temporary file a killed write left: %s", stale)

    def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        where = f"ResourceClaim {namespace}/{name} (uid {uid})"
        if not uid:
            raise ClaimRefused(f"{where}: kubelet sent no claim UID")
        with self._lock:
            booked = self.store.prepared_claim(uid)
            path = cdi.spec_path(self.settings.cdi_dir, uid)
            if booked is not None and cdi.read_spec(path) is not None:
                return [PreparedDevice.of_json(d) for d in booked.devices]
            if booked is not None:
                log.warning("%s: booked but its CDI spec %s is missing or unreadable; preparing again", where, path)
            return self._prepare(namespace, uid, name, where, path)

    def _prepare(self, namespace: str, uid: str, name: str, where: str, path: Path) -> list[PreparedDevice]:
        try:
            claim = self.claims.resource_claim(namespace, name)
        except Exception as exc:  # noqa: BLE001 - the per-claim error names it; kubelet retries
            raise ClaimRefused(f"{where}: cannot read it: {exc}") from exc
        found = str((claim.get("metadata") or {}).get("uid") or "")
        if found != uid:
            raise ClaimRefused(f"{where}: the apiserver's claim of that name has UID {found!r}, not the one kubelet "
                               "asked for (deleted and created again?); not preparing it")
        try:
            shares = claim_shares(claim, self.settings.node)
            settings = claim_share_settings(claim, [s.request for s in shares])
        except DraClaimError as exc:
            raise ClaimRefused(str(exc)) from None
        # Online work books memory only, as the device plugin books it (the extender's core 0): the
        # 10 the webhook asks (the capacity's minimum step) would otherwise cap it at 1 % of the card.
        shares = [replace(s, core_milli=0) if settings[s.request].app_class == AppClass.ONLINE.value else s for s in shares]
        self._check_cards(where, shares)
        now = self.clock_ns()
        rows = self._share_rows(namespace, name, uid, shares, settings, now)
        devices = [PreparedDevice((s.request,), s.pool, s.device, (cdi.device_id(f"{uid}-{i}"),), s.share_id)
                   for i, s in enumerate(shares)]
        spec = cdi.spec(self._cdi_devices(uid, shares, dominant_class(settings[s.request].app_class for s in shares)))
        booked = PreparedClaim(uid, namespace, name, tuple(d.to_json() for d in devices), str(path), now,
                               reserved_pods(claim))
        self.store.book_claim(booked, rows, lambda others: self._refuse_over_booking(where, uid, rows, others))
        cdi.write_spec(path, spec)
        log.info("NodePrepareResources %s -> %s for pods %s", where,
                 [(s.device, s.core_milli, s.memory_mib, settings[s.request].app_class) for s in shares],
                 [p.name for p in booked.pods])
        return devices

    def _check_cards(self, where: str, shares: Sequence[ClaimShare]) -> None:
        sick = self.unhealthy()
        for s in shares:
            if s.card_index not in self.cards:
                raise ClaimRefused(f"{where}: device {s.device} names card {s.card_index}, which this node does not "
                                   f"have (cards {sorted(self.cards)})")
            if s.card_index in sick:
                raise ClaimRefused(f"{where}: device {s.device} is unhealthy ({sick[s.card_index]})")

    def _share_rows(self, namespace: str, name: str, uid: str, shares: Sequence[ClaimShare],
                    settings: Mapping[str, ShareSettings], now: int) -> list[Share]:
        """One store row per result; the request name stands where a container's name would
        (`qgpu status` shows it), made unique when one request holds one card twice
        (``<request>[<i>]``, node/tenants.py reads the request back); the class is the request's
        opaque config's, as the device plugin records the pod's."""
        rows: list[Share] = []
        seen: set[tuple[str, int]] = set()
        for i, s in enumerate(shares):
            label = s.request if (s.request, s.card_index) not in seen else f"{s.request}[{i}]"
            seen.add((label, s.card_index))
            rows.append(Share(uid, namespace, name, label, s.card_index, self.cards[s.card_index].uuid, s.core_milli,
                              s.memory_mib, settings[s.request].app_class, now))
        return rows

    def _refuse_over_booking(self, where: str, uid: str, mine: Sequence[Share], others: Sequence[Share]) -> None:
        """The node is the last line of defence here too: whatever booked the cards before (the
        device plugin, another claim, a scheduler that lost count), a card is never over-booked."""
        held = [Commitment(f"{s.workload_id}/{s.container}", f"{s.namespace}/{s.workload}", 0,
                           (CardUse(s.card_index, s.core_milli, s.memory_mib, s.core_milli >= CORE_MILLI_PER_CARD),))
                for s in others]
        core: dict[int, int] = {}
        memory: dict[int, int] = {}
        for s in mine:
            core[s.card_index] = core.get(s.card_index, 0) + s.core_milli
            memory[s.card_index] = memory.get(s.card_index, 0) + s.memory_mib
        new = Commitment(f"claim/{uid}", where, 0, tuple(
            CardUse(i, core[i], memory[i], core[i] >= CORE_MILLI_PER_CARD) for i in sorted(core)))
        problems = over_commitment({i: c.memory_mib for i, c in self.cards.items()}, held, new)
        if problems:
            raise ClaimRefused(f"{where}: its allocation would over-book this node: {'; '.join(problems)} "
                               "(the store already holds these shares; the claim must be allocated again)")

    def _cdi_devices(self, uid: str, shares: Sequence[ClaimShare], klass: str) -> list[cdi.CdiDevice]:
        """Every device of a claim carries the claim's whole environment (all its cards, in result
        order, and one class: the isolation loop's for a tenant of mixed classes): a container
        given the claim gets all of them, and identical edits cannot conflict."""
        card_shares = [CardShare(s.card_index, self.cards[s.card_index].uuid, s.core_milli, s.memory_mib) for s in shares]
        env = {**card_envs(card_shares, klass, self.policy()), **t9k_share_envs(card_shares, self.cards)}
        return [cdi.CdiDevice(f"{uid}-{i}", env, self._device_nodes(s.card_index)) for i, s in enumerate(shares)]

    def _device_nodes(self, index: int) -> tuple[str, ...]:
        """The card's and the driver's device nodes, only those the host has: a runtime fails the
        container on a device node it cannot find (docs/dra.md)."""
        if not self.settings.pass_device_specs:
            return ()
        wanted = (f"/dev/nvidia{self.cards[index].minor}", *CONTROL_DEVICES)
        return tuple(p for p in wanted if self.device_exists(p))

    def unprepare(self, namespace: str, uid: str, name: str) -> None:
        with self._lock:
            cdi.remove_spec(cdi.spec_path(self.settings.cdi_dir, uid))
            if self.store.release_claim(uid):
                log.info("NodeUnprepareResources ResourceClaim %s/%s (uid %s): released", namespace, name, uid)


def reserved_pods(claim: Mapping[str, Any]) -> tuple[ReservedPod, ...]:
    """The pods of the claim's ``status.reservedFor`` (entries of other resources are skipped):
    whose containers the isolation loop treats as the claim's tenant (node/tenants.py)."""
    out = []
    for entry in (claim.get("status") or {}).get("reservedFor") or []:
        if isinstance(entry, dict) and entry.get("resource") == "pods" and not entry.get("apiGroup") and entry.get("uid"):
            out.append(ReservedPod(str(entry["uid"]), str(entry.get("name") or "")))
    return tuple(out)


def health_report(node: str, cards: Sequence[int], unhealthy: Mapping[int, str], now_s: int):
    """kubelet's ``NodeWatchResourcesResponse``: every card of the node, healthy or unhealthy with
    the reason as the message (kubelet truncates past 1024 characters)."""
    hl = protos.dra_health()
    return hl.pb2.NodeWatchResourcesResponse(devices=[hl.pb2.DeviceHealth(
        device=hl.pb2.DeviceIdentifier(pool_name=pool_name(node), device_name=device_name(i)),
        health=hl.pb2.UNHEALTHY if i in unhealthy else hl.pb2.HEALTHY, last_updated_time=now_s,
        health_check_timeout_seconds=HEALTH_TIMEOUT_S, message=unhealthy.get(i, "")[:1024]) for i in sorted(cards)])


def _health_servicer(settings: DraSettings, cards: Sequence[int], health: CardHealth, stopping: threading.Event,
                     resend_s: float):
    hl = protos.dra_health()

    class HealthServicer(hl.grpc.DRAResourceHealthServicer):
        streams = StreamSlots()  # each stream holds a worker: bounded, so NodePrepareResources always has one

        def NodeWatchResources(self, request, context):
            with self.streams.slot(context, "NodeWatchResources"):
                context.add_callback(health.wake)  # kubelet gone or server stopped: the wait below ends
                seen = None
                while context.is_active() and not stopping.is_set():
                    version, sick, closed = health.wait_change(-1 if seen is None else seen, resend_s)
                    if closed or stopping.is_set() or not context.is_active():
                        break
                    if seen is not None and version != seen:
                        log.info("DRA health: unhealthy cards now %s", sick)
                    seen = version
                    yield health_report(settings.node, cards, sick, int(time.time()))

    return HealthServicer()


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
        health_servicer = _health_servicer(self.settings, sorted(self.preparer.cards), self.health, self._stopping,
                                           self.health_resend_s)

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
               health: CardHealth) -> DraKubeletPlugin:
    """The plugin for the node manager's ``config`` (ManagerConfig with ``dra`` set)."""
    settings = DraSettings(config.node, config.kubelet_plugins_dir, config.plugins_registry_dir, config.cdi_dir,
                           config.pass_device_specs)
    return DraKubeletPlugin(settings, ClaimPreparer(settings, cards, store, claims, policy, health.unhealthy), health)
