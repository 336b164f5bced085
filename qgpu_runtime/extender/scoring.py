"""Filter's verdicts and prioritize's scores on the cache's state: the extender's hot path.

Names become state rows in one pass and the engine scores them in one numpy pass (no per-node
Python). Filter sorts the nodes that fail into *failed* and *unresolvable* (preemption cannot help:
unknown nodes, nodes this shape could not fit even empty, nodes whose data qgpu refused, DRA-pool
nodes for a dialect other than nvidia.com/gpu); prioritize scores the pod as if it held nothing
yet, reusing filter's scores while nothing changed (memo.py).

Not thread-safe on its own: the cache's lock guards it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import compress
from typing import Any

import numpy as np

from qgpu_runtime.extender.bookings import Bookings
from qgpu_runtime.extender.memo import FilterMemo, NeverFits
from qgpu_runtime.extender.nodes import DRA_POOL_REASON
from qgpu_runtime.extender.nodeview import NodeView
from qgpu_runtime.extender.podstate import PodStates
from qgpu_runtime.model.requests import Dialect, PodRequest
from qgpu_runtime.placement import engine
from qgpu_runtime.placement.state import ClusterState


@dataclass(frozen=True)
class Verdict:
    """Filter's answer before its hold: ``ok`` by position in the names, the reasons of the rest."""

    scored: engine.Scored
    ok: np.ndarray
    failed: dict[str, str]
    unresolvable: dict[str, str]


class Scorer:
    """Scores a request on the given nodes, and remembers what the next call can reuse."""

    def __init__(self, policy: Any, nodes: NodeView, bookings: Bookings, pods: PodStates) -> None:
        self.policy = policy
        self.memo: FilterMemo | None = None
        self.never = NeverFits()  # cleared whenever the state is rebuilt
        self._nodes = nodes
        self._bookings = bookings
        self._pods = pods

    def judge(self, state: ClusterState, request: PodRequest, names: list[str]) -> Verdict:
        """Which of ``names`` can take the request now, and why the others cannot."""
        scored = engine.score_rows(state, request, self.policy, state.rows_of(names))
        ok = scored.score >= 0
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        refused = None
        if self._nodes.dra_pool and any(c.dialect is not Dialect.NVIDIA for c in request.containers):
            # DRA pools map nvidia.com/gpu only; any other dialect would find no device plugin there
            dra = engine.at_rows(self._bookings.dra_rows, scored.rows, False)
            if dra.any():
                unresolvable.update(dict.fromkeys(compress(names, dra.tolist()), DRA_POOL_REASON))
                ok, refused = ok & ~dra, dra
                scored.score[dra] = -1  # so the hold never picks one
        if not ok.all():
            # Unknown nodes and nodes this shape could not fit even empty: preemption cannot help.
            never = self._never_fits(request)
            hopeless = ~ok & engine.at_rows(never, scored.rows, True)
            if refused is not None:
                hopeless &= ~refused
                ok_or_refused = ok | refused
            else:
                ok_or_refused = ok
            for into, pick in ((unresolvable, hopeless), (failed, ~ok_or_refused & ~hopeless)):
                if pick.any():
                    into.update(zip(compress(names, pick.tolist()),
                                    map(partial(engine.reason, state), scored.rows[pick].tolist(), scored.code[pick].tolist())))
            self._nodes.name_invalid(failed, unresolvable)
        return Verdict(scored, ok, failed, unresolvable)

    def _never_fits(self, request: PodRequest) -> np.ndarray:
        """By state row: nodes that could not take this shape of request even empty (memo.py)."""
        assert self._bookings.empty is not None
        return self.never.rows(self._bookings.empty, request, self.policy)

    def prioritize(self, state: ClusterState, key: str, request: PodRequest, names: list[str]) -> np.ndarray:
        """Scores aligned with ``names`` as if pod ``key`` held nothing yet (its own tentative hold
        is set aside); 0 for nodes that failed."""
        memo = self.memo
        if memo is not None and memo.state is state and names == memo.passed:
            rows = memo.passed_rows  # the list filter just answered, as kube-scheduler sends it back
        else:
            rows = state.rows_of(names)
        if memo is not None and memo.key == key and memo.version == self._bookings.version:
            node_score = memo.node_score  # nothing changed since this pod's filter
        else:
            held = state.bookings.get(key) if self._pods.held(key) else None
            if held is not None:
                state.release(key)
            try:
                node_score = engine.score_rows(state, request, self.policy, rows).node_score
            finally:
                if held is not None:
                    state.commit(key, held)
        return engine.at_rows(node_score, rows, 0).clip(0, engine.MAX_SCORE)
