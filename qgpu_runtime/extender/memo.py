"""What the extender's hot path remembers between calls so it does not score twice.

- ``FilterMemo``: the last filter's answer. kube-scheduler sends prioritize the list filter
  passed, for the same pod, right after; while the state is unchanged nothing needs mapping to
  rows or scoring again.
- ``NeverFits``: per request shape, the nodes that could not take it even empty (preemption
  cannot help: filter reports them unresolvable). It depends only on the shape and the node
  specs, so a burst of identical pods pays once; the cache clears it when the node set changes.
- ``ParsedRequests``: a pod's parsed GPU request by (UID, resourceVersion), so filter, prioritize
  and bind parse each version of a pod once, not three times.

The first two hold no lock: the cache's lock guards both. ``ParsedRequests`` has its own, since the
verbs parse outside the cache's lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from qgpu_runtime.model.requests import CardLimits, PodRequest, parse_pod
from qgpu_runtime.placement import engine
from qgpu_runtime.placement.state import ClusterState

NEVER_FITS_SHAPES = 256
PARSED_PODS = 4096


@dataclass(frozen=True)
class FilterMemo:
    key: str
    version: int
    node_score: np.ndarray
    state: ClusterState
    passed: list[str]
    passed_rows: np.ndarray


def shape_of(request: PodRequest) -> tuple:
    return (request.klass, request.models, request.model_patterns, request.alloc_mode, request.cpu_milli, request.memory_mib,
            tuple((c.dialect, c.cards, c.core_milli, c.memory_mib, c.memory_pct, c.exclusive, c.whole_node)
                  for c in request.containers))


class NeverFits:
    """By state row: nodes that could not take a request of this shape even empty."""

    def __init__(self) -> None:
        self._by_shape: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def clear(self) -> None:
        self._by_shape.clear()

    def rows(self, empty: ClusterState, request: PodRequest, policy: Any) -> np.ndarray:
        shape = shape_of(request)
        never = self._by_shape.get(shape)
        if never is None:
            never = engine.score_rows(empty, request, policy, np.arange(empty.node_count)).score < 0
            self._by_shape[shape] = never
            while len(self._by_shape) > NEVER_FITS_SHAPES:
                self._by_shape.popitem(last=False)
        return never


class ParsedRequests:
    """A pod's :func:`parse_pod` by (UID, resourceVersion, limits): the most recent ``PARSED_PODS``.

    For pods **as the apiserver has them** only (the watch's, or a GET's): the apiserver gives every
    change of a pod a new resourceVersion, so two of its pods with the same UID and version are the
    same pod and parse the same. Never for a request body's pod, whose version says nothing of its
    content (extender/trust.py). A pod without a UID or a version is parsed every time; a pod that
    does not parse raises every time (nothing remembered); the result is immutable.
    """

    def __init__(self, size: int = PARSED_PODS) -> None:
        self._size = size
        self._parsed: OrderedDict[tuple[str, str, CardLimits], PodRequest] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._parsed)

    def of(self, pod: Mapping[str, Any], limits: CardLimits) -> PodRequest:
        meta = pod.get("metadata") or {}
        uid, version = meta.get("uid"), meta.get("resourceVersion")
        if not (isinstance(uid, str) and uid and isinstance(version, str) and version):
            return parse_pod(pod, limits)
        key = (uid, version, limits)
        with self._lock:
            known = self._parsed.get(key)
            if known is not None:
                self._parsed.move_to_end(key)
                return known
        request = parse_pod(pod, limits)
        with self._lock:
            self._parsed[key] = request
            self._parsed.move_to_end(key)
            while len(self._parsed) > self._size:
                self._parsed.popitem(last=False)
        return request
