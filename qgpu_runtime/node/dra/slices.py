"""The node's ResourceSlice: qgpu's cards as DRA devices, kept published while the manager runs.

One slice per node (``contract.dra.slice_name``), alone in its pool (``pool_name``, count 1), one
shareable device per card (``slice_device``) with ``nodeName`` set and the Node as its owner, so the
slice goes when the node object goes. An unhealthy card keeps its device with the
``UNHEALTHY_TAINT`` (NoSchedule): kube-scheduler gives it to no new claim, and claims already on it
stay valid, the way kubelet treats an unhealthy device-plugin device. With the effect NoExecute
(``--dra-unhealthy-effect``, the operator's choice) kube-controller-manager's device taint eviction
controller also deletes the pods whose claims use it, unless a claim tolerates the taint.

Writes happen only when the content changed: the slice carries a digest of the spec qgpu wrote
(``SLICE_CONTENT``), and every change raises the pool generation. The slice must come back when
someone deletes it — kubelet itself deletes all of its node's slices when it starts
(reference/real-node.md, pitfall 8) — so ``serve`` watches the one slice by name and syncs again
on every event; a watch costs the apiserver nothing while nothing happens, where polling would cost
one GET per node per interval.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any, Callable, Mapping, Protocol

from qgpu_runtime.contract.dra import (
    API_VERSION,
    DRIVER,
    SLICE_CONTENT,
    UNHEALTHY_EFFECTS,
    UNHEALTHY_TAINT,
    pool_name,
    slice_device,
    slice_name,
)
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.isolation.policy import Policy
from qgpu_runtime.model.requests import DEFAULT_LIMITS, CardLimits
from qgpu_runtime.node.health import CardHealth
from qgpu_runtime.node.nodeinfo import label_value
from qgpu_runtime.node.pods import PodSourceError

log = logging.getLogger("qgpu_runtime.node.draslices")  # the name from before node/ became two doors: the logger keeps it


def check_unhealthy_effect(effect: str) -> str:
    """``effect`` if it is one of :data:`UNHEALTHY_EFFECTS`; raises ValueError naming the flag otherwise."""
    if effect not in UNHEALTHY_EFFECTS:
        raise ValueError(f"--dra-unhealthy-effect: {effect!r} is not allowed: must be one of {', '.join(UNHEALTHY_EFFECTS)}")
    return effect


WATCH_TIMEOUT_S = 300.0  # the apiserver ends each watch after this long; the next one starts at once
RETRY_MIN_S = 1.0


class SliceApi(Protocol):
    """The API calls the publisher makes (node/kube_client.py ``KubeSlices``; a fake in the tests).
    Failures raise PodSourceError; ``transient`` says whether a later try can help."""

    def node_uid(self, node: str) -> str: ...

    def read_slice(self, name: str) -> dict[str, Any] | None:
        """The slice, or None when there is none."""

    def create_slice(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def replace_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Replace with optimistic concurrency: ``body`` carries the resourceVersion it was read at."""

    def watch_slice(self, name: str, resource_version: str, timeout_s: float, stop: threading.Event) -> str | None:
        """Block until the slice changes after ``resource_version``; the event type (ADDED, MODIFIED,
        DELETED, or EXPIRED when the version is too old), None on timeout or stop."""

    def close(self) -> None:
        """Cut a watch in progress (the manager is stopping)."""


def slice_devices(cards: Mapping[int, CardInfo], unhealthy: Mapping[int, str], policy: Policy,
                  limits: CardLimits = DEFAULT_LIMITS, unhealthy_effect: str = "NoSchedule") -> list[dict[str, Any]]:
    """The slice's devices, in card order; unhealthy cards carry the taint, of ``unhealthy_effect``."""
    check_unhealthy_effect(unhealthy_effect)
    devices = []
    for index in sorted(cards):
        device = slice_device(cards[index], policy.value, limits)
        if index in unhealthy:
            device["taints"] = [{"key": UNHEALTHY_TAINT, "value": label_value(unhealthy[index]) or "unhealthy",
                                 "effect": unhealthy_effect}]
        devices.append(device)
    return devices


def content_digest(node: str, devices: list[dict[str, Any]]) -> str:
    text = json.dumps({"driver": DRIVER, "nodeName": node, "pool": pool_name(node), "devices": devices},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def resource_slice(node: str, node_uid: str, devices: list[dict[str, Any]], generation: int) -> dict[str, Any]:
    """The ResourceSlice object (API JSON) of ``node`` holding ``devices`` at pool ``generation``."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {
            "name": slice_name(node),
            "labels": {"app.kubernetes.io/managed-by": "qgpu-manager"},
            "annotations": {SLICE_CONTENT: content_digest(node, devices)},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}],
        },
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": pool_name(node), "generation": int(generation), "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def _generation(existing: Mapping[str, Any]) -> int:
    return int(((existing.get("spec") or {}).get("pool") or {}).get("generation") or 0)


def _is_current(existing: Mapping[str, Any], node: str, digest: str, devices: list[dict[str, Any]]) -> bool:
    """The digest says what qgpu wrote; the device names and taints catch an edit that kept it."""
    meta = existing.get("metadata") or {}
    spec = existing.get("spec") or {}
    seen = [(d.get("name"), [t.get("key") for t in d.get("taints") or []]) for d in spec.get("devices") or []]
    wanted = [(d["name"], [t["key"] for t in d.get("taints") or []]) for d in devices]
    return ((meta.get("annotations") or {}).get(SLICE_CONTENT) == digest and seen == wanted
            and spec.get("nodeName") == node and (spec.get("pool") or {}).get("resourceSliceCount") == 1
            and any(o.get("kind") == "Node" and o.get("name") == node for o in meta.get("ownerReferences") or []))


class SlicePublisher:
    """Keeps ``node``'s ResourceSlice equal to its cards and their health."""

    def __init__(self, api: SliceApi, node: str, cards: Mapping[int, CardInfo], health: CardHealth,
                 policy: Callable[[], Policy], limits: CardLimits = DEFAULT_LIMITS, retry_max_s: float = 30.0,
                 unhealthy_effect: str = "NoSchedule") -> None:
        self.unhealthy_effect = check_unhealthy_effect(unhealthy_effect)
        self.api = api
        self.node = node
        self.name = slice_name(node)
        self.cards = cards
        self.health = health
        self.policy = policy
        self.limits = limits
        self.retry_max_s = retry_max_s
        self.generation = 0  # the last pool generation written or seen: a re-created slice continues from it
        self.resource_version = ""  # of the slice as last written or read; where the watch starts
        self._lock = threading.Lock()

    def sync(self) -> str:
        """Create or update the slice when it differs from the cards: "created", "updated" or
        "unchanged". Raises PodSourceError when the API refuses or cannot be reached."""
        with self._lock:
            devices = slice_devices(self.cards, self.health.unhealthy(), self.policy(), self.limits, self.unhealthy_effect)
            digest = content_digest(self.node, devices)
            existing = self.api.read_slice(self.name)
            if existing is None:
                # The owner's UID is read on every create: a Node deleted and registered again has a
                # new one, and a slice owned by the old UID would be collected at once.
                self.generation += 1
                body = resource_slice(self.node, self.api.node_uid(self.node), devices, self.generation)
                self._written(self.api.create_slice(body))
                log.info("ResourceSlice %s: created with %d device(s), pool generation %d",
                         self.name, len(devices), self.generation)
                return "created"
            self.generation = max(self.generation, _generation(existing))
            if _is_current(existing, self.node, digest, devices):
                self.resource_version = str((existing.get("metadata") or {}).get("resourceVersion") or "")
                return "unchanged"
            owner = next((o for o in existing["metadata"].get("ownerReferences") or []
                          if o.get("kind") == "Node" and o.get("name") == self.node), None)
            uid = owner["uid"] if owner else self.api.node_uid(self.node)
            self.generation += 1
            body = resource_slice(self.node, uid, devices, self.generation)
            body["metadata"]["resourceVersion"] = existing["metadata"].get("resourceVersion")
            self._written(self.api.replace_slice(self.name, body))
            log.info("ResourceSlice %s: updated (%d device(s), %d tainted unhealthy), pool generation %d",
                     self.name, len(devices), sum(1 for d in devices if d.get("taints")), self.generation)
            return "updated"

    def _written(self, slice_: Mapping[str, Any]) -> None:
        self.resource_version = str((slice_.get("metadata") or {}).get("resourceVersion") or "")
        self.generation = max(self.generation, _generation(slice_))

    def publish(self) -> bool:
        """``sync`` that logs instead of raising (the health loop calls it); False when it failed, and
        the watch loop tries again."""
        try:
            self.sync()
            return True
        except PodSourceError as exc:
            log.warning("ResourceSlice %s: %s; retrying", self.name, exc)
            return False

    def close(self) -> None:
        self.api.close()

    def serve(self, stop: threading.Event) -> None:
        """Sync, then watch the slice and sync again after every change by anyone, until ``stop``.
        Failures wait 1, 2, 4 … ``retry_max_s`` seconds and try again; nothing ends the loop but ``stop``."""
        delay = RETRY_MIN_S
        while not stop.is_set():
            try:
                self.sync()
                event = self.api.watch_slice(self.name, self.resource_version, WATCH_TIMEOUT_S, stop)
                if event is not None:
                    log.debug("ResourceSlice %s: %s", self.name, event)
                delay = RETRY_MIN_S
                continue
            except PodSourceError as exc:
                log.warning("ResourceSlice %s: %s; retrying in %.0f s", self.name, exc, delay)
            except Exception:  # a bug must not end publishing for the life of the process
                log.exception("ResourceSlice %s: sync failed; retrying in %.0f s", self.name, delay)
            if stop.wait(delay):
                return
            delay = min(delay * 2, self.retry_max_s)
