"""The pod a scheduler call is about, as the apiserver has it — never as the request body says.

kube-scheduler sends the whole pod in filter and prioritize. Anyone who can reach the extender can
send any pod there, so the body only *names* the pod (namespace, name, UID). The extender takes the
pod itself from its watch cache of unbound pods, or, when the watch has not delivered it yet, reads
it from the apiserver, and checks that the body's pod asks for what the real one asks for. A body
whose requests differ is refused: otherwise a forged filter for a real pod would choose that pod's
cards (its allocation record) from requests it never made.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from qgpu_runtime.extender.cache import AllocationCache
from qgpu_runtime.kube.podslim import kept
from qgpu_runtime.model.requests import CardLimits, PodRequest, RequestError, parse_pod

ReadPod = Callable[[str, str], "dict[str, Any] | None"]  # (namespace, name) -> pod, None when absent


class UntrustedPod(ValueError):
    """The body's pod is not a pod the apiserver has, or asks for something else than it does."""


class PodUnavailable(UntrustedPod):
    """The apiserver could not be asked about the pod (unreachable, timed out, 5xx): the call is
    refused with that reason, as a decision in the extender's answer, never an HTTP 500."""


def _identity(pod: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = pod.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(meta.get("name") or ""), str(meta.get("uid") or "")


def _same_request_fields(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Cheap check first: what :func:`parse_pod` reads (spec, annotations, labels) is equal. Both
    as the cache keeps pods (:func:`~qgpu_runtime.kube.podslim.kept`): the body's pod is whole."""
    a, b = kept(a), kept(b)
    meta_a, meta_b = a.get("metadata") or {}, b.get("metadata") or {}
    return (a.get("spec") == b.get("spec") and meta_a.get("annotations") == meta_b.get("annotations")
            and meta_a.get("labels") == meta_b.get("labels"))


class TrustedPods:
    """Resolves a body's pod to the apiserver's pod. ``read_pod`` (an API GET) is the fallback
    when the watch cache does not have the pod yet; None where the extender runs without an API."""

    def __init__(self, cache: AllocationCache, limits: CardLimits, read_pod: ReadPod | None = None):
        self.cache = cache
        self.limits = limits
        self.read_pod = read_pod

    def _lookup(self, namespace: str, name: str, uid: str, *, fresh: bool) -> dict[str, Any]:
        pod = None if fresh else self.cache.unbound_pod(uid)
        if pod is None and self.read_pod is not None:
            pod = self.read_pod(namespace, name)
        if pod is None:
            raise UntrustedPod(f"pod {namespace}/{name} (uid {uid}) is not an unbound pod the apiserver has")
        real_uid = str((pod.get("metadata") or {}).get("uid") or "")
        if real_uid != uid:
            raise UntrustedPod(f"pod {namespace}/{name}: uid {uid!r} in the request is not the pod's uid {real_uid!r}")
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to:
            raise UntrustedPod(f"pod {namespace}/{name} is already bound to {bound_to}")
        return pod

    def resolve(self, body_pod: Mapping[str, Any]) -> dict[str, Any]:
        """The apiserver's pod for ``body_pod``; raises :class:`UntrustedPod` with the reason."""
        namespace, name, uid = _identity(body_pod)
        if not name or not uid:
            raise UntrustedPod("Pod.metadata.name and Pod.metadata.uid are required: the extender looks the pod up by them")
        pod = self._lookup(namespace, name, uid, fresh=False)
        if _same_request_fields(pod, body_pod) or self._same_request(pod, body_pod):
            return pod
        if self.read_pod is not None:  # our watch may lag behind the scheduler's: ask once more
            pod = self._lookup(namespace, name, uid, fresh=True)
            if self._same_request(pod, body_pod):
                return pod
        raise UntrustedPod(f"pod {namespace}/{name}: the request body's pod asks for other resources than the pod "
                           "in the apiserver; refused")

    def _same_request(self, real: Mapping[str, Any], body: Mapping[str, Any]) -> bool:
        try:
            claimed: PodRequest | None = parse_pod(body, self.limits)
        except RequestError:
            claimed = None
        try:  # the apiserver's pod, never the body, goes through the cache's memory of parsed pods
            actual: PodRequest | None = self.cache.requests.of(real, self.limits)
        except RequestError:
            actual = None
        if claimed is None or actual is None:
            return claimed is None and actual is None and _same_request_fields(real, body)
        return claimed == actual
