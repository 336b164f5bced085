"""What the extender's hot path remembers between calls so it does not score twice.

- ``FilterMemo``: the last filter's answer. kube-scheduler sends prioritize the list filter
  passed, for the same pod, right after; while the state is unchanged nothing needs mapping to
  rows or scoring again.
- ``NeverFits``: per request shape, the nodes that could not take it even empty (preemption
  cannot help: filter reports them unresolvable). It depends only on the shape and the node
  specs, so a burst of identical pods pays once; the cache clears it when the node set changes.

Neither holds a lock: the cache's lock guards both.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from qgpu_runtime.model.requests import PodRequest
from qgpu_runtime.placement import engine
from qgpu_runtime.placement.state import ClusterState

NEVER_FITS_SHAPES = 256


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
