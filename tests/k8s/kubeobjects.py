"""Fake GPU nodes and GPU pods, created through the real API (there is no kubelet)."""

from __future__ import annotations

import copy
import json
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from qgpu_runtime.contract.dra import device_classes
from qgpu_runtime.contract.inventory import CARDS, cards_annotation
from qgpu_runtime.contract.record import ALLOCATION, AllocationRecord, parse_record
from qgpu_runtime.model.requests import GPU_RESOURCES
from qgpu_runtime.placement.state import CardSpec
from tests.polling import poll

T = TypeVar("T")
PAUSE = "registry.k8s.io/pause:3.10"
MANAGED_RESOURCES = tuple(sorted(GPU_RESOURCES))
REPO = Path(__file__).resolve().parents[2]


def pool_xgn_taint() -> dict[str, str]:
    """The taint roles/qgpu_node_pool puts on xgn nodes, read from the role's defaults."""
    defaults = yaml.safe_load((REPO / "roles/qgpu_node_pool/defaults/main.yml").read_text())
    return dict(defaults["qgpu_node_pool_xgn_taint"])


def tolerates(tolerations: Sequence[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    """Kubernetes' rule (core/v1 Toleration.ToleratesTaint): same effect (or none), and the key with
    Exists or the key and value with Equal (the default); an empty key with Exists tolerates all."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        operator = t.get("operator") or "Equal"
        if not t.get("key"):
            if operator == "Exists":
                return True
            continue
        if t["key"] == taint["key"] and (operator == "Exists" or t.get("value", "") == taint.get("value", "")):
            return True
    return False


def patched(doc: Mapping[str, Any], ops: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``doc`` with JSON-patch (RFC 6902) ``add`` operations applied, the only kind qgpu's mutating
    webhook emits, as the apiserver applies them."""
    out = copy.deepcopy(dict(doc))
    for op in ops:
        assert op["op"] == "add", op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target: Any = out
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), op["value"])
        else:
            target[last] = op["value"]
    return out


def cards(n: int, model: str = "V100", memory_mib: int = 32768, node: str = "n") -> list[CardSpec]:
    return [CardSpec(i, f"GPU-{node}-{i:02d}", model, memory_mib) for i in range(n)]


def ready_node(api: client.CoreV1Api, name: str, resources: Mapping[str, str], labels: Mapping[str, str] | None = None,
               annotations: Mapping[str, str] | None = None) -> None:
    """Create a Ready node with its capacity and allocatable ``resources`` and its status in one
    call, as kubelet registers itself: a node created bare and patched after is seen by
    kube-scheduler's informer for a moment with no allocatable pods, and a pod scheduled then fails
    with "Too many pods" instead of the reason the test looks for."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    metadata: dict[str, Any] = {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}
    if annotations:
        metadata["annotations"] = dict(annotations)
    api.create_node({
        "apiVersion": "v1", "kind": "Node", "metadata": metadata,
        "status": {"capacity": dict(resources), "allocatable": dict(resources),
                   "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fake node",
                                   "lastHeartbeatTime": now, "lastTransitionTime": now}]},
    })


def gpu_node(api: client.CoreV1Api, name: str, inventory: list[CardSpec], labels: Mapping[str, str] | None = None,
             cpu: str = "64", memory: str = "512Gi", extended: Mapping[str, str] | None = None) -> None:
    """A Ready node with a card inventory (``extended``: more resources for its capacity, as a
    device plugin or the manager would advertise), created whole (:func:`ready_node`)."""
    ready_node(api, name, {"cpu": cpu, "memory": memory, "pods": "250", **(extended or {})}, labels,
               {CARDS: cards_annotation(inventory)})


def gpu_pod(name: str, limits: Mapping[str, Any], *, selector: Mapping[str, str] | None = None,
            annotations: Mapping[str, str] | None = None, containers: int = 1,
            scheduler_name: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": f"c{i}", "image": PAUSE,
                        "resources": {"limits": {k: str(v) for k, v in limits.items()}}} for i in range(containers)],
        "terminationGracePeriodSeconds": 0,
    }
    if selector:
        spec["nodeSelector"] = dict(selector)
    if scheduler_name:
        spec["schedulerName"] = scheduler_name
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": dict(annotations or {})}, "spec": spec}


def read_pod(api: client.CoreV1Api, namespace: str, name: str) -> dict[str, Any]:
    return json.loads(api.read_namespaced_pod(name, namespace, _preload_content=False).data)


def list_pods(api: client.CoreV1Api, namespace: str) -> list[dict[str, Any]]:
    return json.loads(api.list_namespaced_pod(namespace, _preload_content=False).data)["items"]


def record(pod: Mapping[str, Any]) -> AllocationRecord | None:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(ALLOCATION)
    return parse_record(raw) if raw else None


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.2) -> T:
    """:func:`tests.polling.poll` with the API's pace: the description first, a minute by default."""
    return poll(probe, timeout, interval, what)


def bound(api: client.CoreV1Api, namespace: str, name: str, timeout: float = 60.0) -> dict[str, Any]:
    return wait_for(f"pod {namespace}/{name} bound", lambda: (p := read_pod(api, namespace, name))["spec"].get("nodeName") and p,
                    timeout)


def events_for(api: client.CoreV1Api, namespace: str, name: str) -> list[dict[str, Any]]:
    doc = json.loads(api.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}",
                                               _preload_content=False).data)
    return doc["items"]


def card_usage(pods: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int], dict[str, int]]:
    """(node, card index) → summed core_milli, memory_mib and container count, from the records."""
    usage: dict[tuple[str, int], dict[str, int]] = {}
    for pod in pods:
        rec = record(pod)
        if rec is None:
            continue
        for container in rec.containers:
            for share in container.shares:
                u = usage.setdefault((rec.node, share.index), {"core_milli": 0, "memory_mib": 0, "containers": 0, "exclusive": 0})
                u["core_milli"] += share.core_milli
                u["memory_mib"] += share.memory_mib
                u["containers"] += 1
                u["exclusive"] += int(container.exclusive)
    return usage


def xgn_taint_policy_active(api: client.CoreV1Api) -> bool:
    """Whether the apiserver runs qgpu's MutatingAdmissionPolicy qgpu-xgn-taint now: a probe Node
    labelled xgn is created and deleted. The apiserver loads and unloads policies asynchronously, so
    whoever installs or deletes it waits on this, and no later test meets a taint it did not ask for."""
    name = f"xgn-probe-{uuid.uuid4().hex[:8]}"
    gpu_node(api, name, cards(1, node=name), {"sched.tensorstack.dev/node-alloc-mode": "xgn"})
    try:
        return any(t.key == "sched.tensorstack.dev/xgn-mode" for t in api.read_node(name).spec.taints or [])
    finally:
        api.delete_node(name)


def scheduling_failure(api: client.CoreV1Api, namespace: str, name: str, containing: str,
                       timeout: float = 60.0) -> dict[str, Any]:
    """The pod's FailedScheduling Event whose message contains ``containing``. An earlier one may
    say something else (a node the pod was created with can reach kube-scheduler's cache after the
    pod's first attempt, which then fails on the node selector); kube-scheduler retries the pod when
    the node arrives. On timeout the assertion lists every FailedScheduling message seen."""
    seen: list[str] = []

    def probe() -> dict[str, Any] | None:
        events = [e for e in events_for(api, namespace, name) if e.get("reason") == "FailedScheduling"]
        seen[:] = [e.get("message") or "" for e in events]
        return next((e for e in events if containing in (e.get("message") or "")), None)

    try:
        return wait_for(f"a FailedScheduling event of {namespace}/{name} saying {containing!r}", probe, timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; FailedScheduling messages: {seen}") from None


@contextmanager
def qgpu_device_classes(resource: client.ResourceV1Api) -> Iterator[list[str]]:
    """qgpu's DeviceClasses for the length of the block: those this block created are deleted at
    its end (the whole-card class maps nvidia.com/gpu, which a later module's device-plugin pods
    ask for; kube-scheduler would hold them for a DRA device that no node publishes)."""
    created: list[str] = []
    try:
        for doc in device_classes():
            try:
                resource.create_device_class(doc, _preload_content=False)
                created.append(doc["metadata"]["name"])
            except ApiException as exc:
                if exc.status != 409:
                    raise
        yield created
    finally:
        for name in created:
            try:
                resource.delete_device_class(name, _preload_content=False)
            except ApiException as exc:
                if exc.status != 404:
                    raise
