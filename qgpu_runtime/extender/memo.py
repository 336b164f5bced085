"""What the extender's hot path remembers between calls so it does not score twice.

- ``FilterMemo``: the last filter's answer. kube-scheduler sends prioritize the list filter
  passed, for the same pod, right after; while the state is unchanged nothing needs mapping to
  rows or scoring again.
- ``NeverFits``: per request shape, the nodes that could not take it even empty (preemption
  cannot help: filter reports them unresolvable). It depends only on the shape and the node
  specs, so a burst of identical pods pays once; the cache clears it when the node set changes.
- ``ParsedRequests``: a pod's parsed GPU request by (UID, resourceVersion), so filter, prioritize
  and bind parse each version of a pod once, not three times. What it keeps is bounded by its own
  counts, not by what a pod carries: one version per UID, at most ``PARSED_PODS`` pods and
  ``PARSED_WEIGHT`` containers and model names together; ``forget`` drops a deleted pod's.

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
PARSED_WEIGHT = 4 * PARSED_PODS
"""Containers asking a GPU and GPU model names (``qgpu.io/gpu-model`` and HAMi's lists) that the
remembered requests hold together, each entry counting one more for itself. A pod of one GPU
container naming no model weighs 2, so ``PARSED_PODS`` of those fit twice over; what a tenant can
stuff into one pod (thousands of GPU containers: the apiserver bounds their number only by the
object's 1.5 MiB; 16 + 16 + 16 names of 96 characters, model/requests.py ``MAX_MODEL_NAMES``) makes
its entry heavier and the memo keep fewer, never more than this in all (a few MiB)."""


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


def weight_of(request: PodRequest) -> int:
    """What one remembered request counts against ``PARSED_WEIGHT``: itself, its GPU containers and
    the model names it carries (the only parts of a request whose number a pod chooses)."""
    patterns = request.model_patterns
    names = len(request.models or ()) + (len(patterns.use) + len(patterns.nouse) if patterns is not None else 0)
    return 1 + len(request.containers) + names


class ParsedRequests:
    """A pod's :func:`parse_pod` by (UID, resourceVersion, limits): the most recent ``PARSED_PODS``.

    For pods **as the apiserver has them** only (the watch's, or a GET's): the apiserver gives every
    change of a pod a new resourceVersion, so two of its pods with the same UID and version are the
    same pod and parse the same. Never for a request body's pod, whose version says nothing of its
    content (extender/trust.py). A pod without a UID or a version is parsed every time; a pod that
    does not parse raises every time (nothing remembered); the result is immutable.

    Bounded by what it holds, whatever pods carry: one entry per UID (a newer version replaces the
    older, which the verbs no longer ask about), at most ``size`` entries and ``weight`` in all
    (:func:`weight_of`; least recently used go first, and a request heavier than ``weight`` alone is
    not kept), and :meth:`forget` drops a pod that was deleted, so pods created and deleted over and
    over leave nothing behind.
    """

    def __init__(self, size: int = PARSED_PODS, weight: int = PARSED_WEIGHT) -> None:
        self._size = size
        self._weight = weight
        self._held = 0
        self._parsed: OrderedDict[tuple[str, str, CardLimits], tuple[PodRequest, int]] = OrderedDict()
        self._by_uid: dict[str, tuple[str, str, CardLimits]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._parsed)

    @property
    def weight(self) -> int:
        """What the remembered requests weigh together (:func:`weight_of`)."""
        return self._held

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
                return known[0]
        request = parse_pod(pod, limits)
        weight = weight_of(request)
        if weight > self._weight:
            return request  # heavier than the whole memo: parsed again when asked again
        with self._lock:
            self._drop(self._by_uid.get(uid))  # its older version, or this one stored meanwhile
            self._parsed[key] = (request, weight)
            self._by_uid[uid] = key
            self._held += weight
            while len(self._parsed) > self._size or self._held > self._weight:
                self._drop(next(iter(self._parsed)))
        return request

    def forget(self, uid: str) -> None:
        """Drop what is remembered of pod ``uid`` (deleted, or finished)."""
        with self._lock:
            self._drop(self._by_uid.get(uid))

    def _drop(self, key: tuple[str, str, CardLimits] | None) -> None:
        if key is None:
            return
        entry = self._parsed.pop(key, None)
        if entry is not None:
            self._held -= entry[1]
        if self._by_uid.get(key[0]) == key:
            del self._by_uid[key[0]]
