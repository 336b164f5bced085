"""Admission review (admission.k8s.io/v1) for pods: validate GPU requests, and mutate them.

Pure: an AdmissionReview dict in, an AdmissionReview dict out. Validation is the request model's
own parser, so the webhook refuses exactly what the extender could not place, with the same words.
Mutation, for pods that ask for GPUs:
- copies GPU quantities between requests and limits when only one side is given (the apiserver
  insists on limits for extended resources and on requests == limits);
- sets ``schedulerName`` when the webhook is configured with one and the pod kept the default;
- gives the container a KAI-Scheduler pod's ``gpu-fraction`` or ``gpu-memory`` annotation names
  ``nvidia.com/gpu`` (its card count), the resource its share reaches the kubelet by;
- adds the toleration for ``sched.tensorstack.dev/xgn-mode=true:NoSchedule`` to pods with exclusive
  (whole-card) containers, which T9k users expect on xgn nodes.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Mapping

from qgpu_runtime.contract.names import XGN_TAINT_KEY
from qgpu_runtime.jsondoc import load_json
from qgpu_runtime.model.podshape import check_pod
from qgpu_runtime.model.quantity import show_value
from qgpu_runtime.model.requests import GPU_RESOURCES, NVIDIA_GPU, QGPU_PREFIX, CardLimits, Dialect, PodRequest, RequestError, parse_pod

REVIEW_VERSION = "admission.k8s.io/v1"
XGN_TOLERATION = {"key": XGN_TAINT_KEY, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
DEFAULT_SCHEDULER = "default-scheduler"


class ReviewError(ValueError):
    """The body is not an AdmissionReview we can answer (a 400, not a denial)."""


@dataclass(frozen=True)
class WebhookConfig:
    scheduler_name: str | None = None
    limits: CardLimits = CardLimits()


def _review(body: bytes | str) -> tuple[dict[str, Any], dict[str, Any]]:
    doc = load_json(body, dict, "AdmissionReview: body", ReviewError)
    if doc.get("apiVersion") != REVIEW_VERSION or doc.get("kind") != "AdmissionReview":
        raise ReviewError(f"AdmissionReview: apiVersion={doc.get('apiVersion')!r} kind={doc.get('kind')!r}: "
                          f"only {REVIEW_VERSION} AdmissionReview is served")
    request = doc.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str) or not request["uid"]:
        raise ReviewError("AdmissionReview.request: must be an object with a non-empty uid")
    if not isinstance(request.get("kind"), (dict, type(None))):
        raise ReviewError(f"AdmissionReview.request.kind={show_value(request['kind'])}: must be an object (group, version, kind)")
    for name in ("operation", "namespace"):
        if not isinstance(request.get(name), (str, type(None))):
            raise ReviewError(f"AdmissionReview.request.{name}={show_value(request[name])}: must be a string")
    return doc, request


_REASONS = {422: "Invalid", 500: "InternalError"}


def _answer(uid: str, allowed: bool, message: str = "", patch: list[dict[str, Any]] | None = None, code: int = 422) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        response["status"] = {"code": code, "reason": _REASONS.get(code, "Invalid"), "message": message}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview", "response": response}


def _pod(request: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = request.get("kind") or {}
    if request.get("operation") not in ("CREATE", "UPDATE") or kind.get("kind") != "Pod" or kind.get("group", "") != "":
        return None
    pod = dict(check_pod(request.get("object"), "AdmissionReview.request.object", ReviewError))
    meta = dict(pod.get("metadata") or {})
    meta.setdefault("namespace", request.get("namespace") or "default")
    pod["metadata"] = meta
    return pod


def validate(body: bytes | str, config: WebhookConfig) -> dict[str, Any]:
    """Deny pods whose GPU requests break a rule, listing every broken rule."""
    _, request = _review(body)
    pod = _pod(request)
    if pod is None:
        return _answer(request["uid"], True)
    try:
        parse_pod(pod, config.limits)
    except RequestError as exc:
        return _answer(request["uid"], False, f"qgpu: {exc}")
    return _answer(request["uid"], True)


def _ours(resource: str) -> bool:
    return resource in GPU_RESOURCES or resource.startswith(QGPU_PREFIX)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def mutation(pod: Mapping[str, Any], config: WebhookConfig) -> list[dict[str, Any]]:
    """The JSON patch for one pod (empty when nothing needs changing or the pod asks for no GPU)."""
    try:
        request = parse_pod(pod, config.limits)
    except RequestError:
        return []  # the validating webhook denies it with the reasons
    spec = pod.get("spec") or {}
    ops: list[dict[str, Any]] = []
    for section in ("containers", "initContainers"):
        for i, container in enumerate(spec.get(section) or []):
            resources = container.get("resources") or {}
            limits = resources.get("limits") or {}
            requests = resources.get("requests") or {}
            base = f"/spec/{section}/{i}/resources"
            if not any(_ours(k) for k in set(limits) | set(requests)):
                continue
            for have, missing_name in ((limits, "requests"), (requests, "limits")):
                other = resources.get(missing_name) or {}
                fill = {k: v for k, v in have.items() if _ours(k) and k not in other}
                if not fill:
                    continue
                if missing_name not in resources or resources.get(missing_name) is None:
                    ops.append({"op": "add", "path": f"{base}/{missing_name}", "value": fill})
                    resources = {**resources, missing_name: fill}
                else:
                    for k, v in fill.items():
                        ops.append({"op": "add", "path": f"{base}/{missing_name}/{_escape(k)}", "value": v})
    if not request.wants_gpu:
        return ops
    ops.extend(gpu_carrier(pod, request))
    if config.scheduler_name and spec.get("schedulerName", DEFAULT_SCHEDULER) in ("", DEFAULT_SCHEDULER):
        ops.append({"op": "add", "path": "/spec/schedulerName", "value": config.scheduler_name})
    if any(c.exclusive or c.whole_node for c in request.containers):
        tolerations = spec.get("tolerations")
        if not tolerations:
            ops.append({"op": "add", "path": "/spec/tolerations", "value": [XGN_TOLERATION]})
        elif not any(all(t.get(k) == v for k, v in XGN_TOLERATION.items()) for t in tolerations if isinstance(t, dict)):
            ops.append({"op": "add", "path": "/spec/tolerations/-", "value": XGN_TOLERATION})
    return ops


def gpu_carrier(pod: Mapping[str, Any], request: PodRequest) -> list[dict[str, Any]]:
    """Give ``nvidia.com/gpu``, one per card, to the containers whose dialect asks cards without it,
    so that the kubelet calls the device plugin for them (it serves ``nvidia.com/gpu``, never KAI's
    annotations or HAMi's ``gpumem``/``gpucores``), kube-scheduler sends the pod to the extender and
    the namespace quota counts it (docs/migration.md):

    - KAI-Scheduler's share comes by annotation, and such a pod asks no extended resource;
    - HAMi's ``nvidia.com/gpumem: 3000`` alone is one card (HAMi's ``defaultGPUNum``), as HAMi's own
      webhook writes it: without the resource the extender booked a share the container never got.
    """
    containers = (pod.get("spec") or {}).get("containers") or []
    index = {str(c.get("name") or ""): i for i, c in enumerate(containers)}
    ops: list[dict[str, Any]] = []
    for asked in request.containers:
        if asked.dialect not in (Dialect.KAI, Dialect.HAMI) or asked.name not in index:
            continue
        i = index[asked.name]
        resources = containers[i].get("resources") or {}
        sections = {section: resources.get(section) or {} for section in ("limits", "requests")}
        if any(NVIDIA_GPU in values for values in sections.values()):
            continue  # the other section gets it from the copy above
        # a section the copy above creates (the container names one of our resources) exists by now
        copied = any(_ours(k) for values in sections.values() for k in values)
        if containers[i].get("resources") is None:
            ops.append({"op": "add", "path": f"/spec/containers/{i}/resources", "value": {}})
        for section in ("limits", "requests"):
            if resources.get(section) is None and not copied:
                ops.append({"op": "add", "path": f"/spec/containers/{i}/resources/{section}", "value": {NVIDIA_GPU: str(asked.cards)}})
            else:
                ops.append({"op": "add", "path": f"/spec/containers/{i}/resources/{section}/{_escape(NVIDIA_GPU)}",
                            "value": str(asked.cards)})
    return ops


def mutate(body: bytes | str, config: WebhookConfig) -> dict[str, Any]:
    _, request = _review(body)
    pod = _pod(request)
    if pod is None:
        return _answer(request["uid"], True)
    return _answer(request["uid"], True, patch=mutation(pod, config))
