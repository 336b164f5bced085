"""The DRA door's device health: kubelet's ``v1.DRAResourceHealth.NodeWatchResources`` stream.

Each stream sends the health of every card of the node (pool = node, device ``gpu-<index>``) at
once, again whenever ``CardHealth`` changes (an XID marks a card unhealthy), and again every
``HEALTH_RESEND_S`` so kubelet's timeout never turns them unknown; it waits on CardHealth's version
and ends when the manager stops (``CardHealth.close``), the server stops or kubelet goes away.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Mapping, Sequence

from qgpu_runtime import protos
from qgpu_runtime.contract.dra import device_name, pool_name
from qgpu_runtime.node.health import CardHealth
from qgpu_runtime.node.streams import StreamSlots

log = logging.getLogger("qgpu_runtime.node.draplugin")  # the DRA plugin's logger before the split

# kubelet reads a device's health as unknown once its last report is older than the device's
# health_check_timeout_seconds (30 s when unset): the full list is sent again every
# HEALTH_RESEND_S even when nothing changed, well inside HEALTH_TIMEOUT_S.
HEALTH_RESEND_S = 10.0
HEALTH_TIMEOUT_S = 60


def health_report(node: str, cards: Sequence[int], unhealthy: Mapping[int, str], now_s: int):
    """kubelet's ``NodeWatchResourcesResponse``: every card of the node, healthy or unhealthy with
    the reason as the message (kubelet truncates past 1024 characters)."""
    hl = protos.dra_health()
    return hl.pb2.NodeWatchResourcesResponse(devices=[hl.pb2.DeviceHealth(
        device=hl.pb2.DeviceIdentifier(pool_name=pool_name(node), device_name=device_name(i)),
        health=hl.pb2.UNHEALTHY if i in unhealthy else hl.pb2.HEALTHY, last_updated_time=now_s,
        health_check_timeout_seconds=HEALTH_TIMEOUT_S, message=unhealthy.get(i, "")[:1024]) for i in sorted(cards)])


def health_servicer(node: str, cards: Sequence[int], health: CardHealth, stopping: threading.Event,
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
                    yield health_report(node, cards, sick, int(time.time()))

    return HealthServicer()
