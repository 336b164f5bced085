"""The nominated pod keeps its cards (issue 25 §2): what the preempt verb's victims free is held for
the preemptor while they terminate.

kube-scheduler deletes the victims on the node it picks among the preempt verb's answer and writes
that node into the preemptor's ``status.nominatedNodeName``; its own plugins then count the
preemptor on that node for every other pod, but an extender's filter knows nothing of it. Without
a hold, the card a victim frees would go to the first pod filtered after the victim's deletion,
which kube-scheduler may well try before the preemptor, and the preemption would have been for
nothing.

So each node the preempt verb answers is an *offer*: (preemptor, node, the victims whose cards
qgpu chose). When a victim of an offer leaves (deleted or finished), its booking is kept under a
surrogate key ``nominated:<preemptor>|<victim>`` instead of being freed; once every victim of the
offer has left, the surrogates are released and the preemptor's own placement on that node is
booked in their place, all under the cache's lock, so no filter sees the cards free in between.
Both the surrogates and that booking are filter *holds* (holds.py): the preemptor's next filter
releases its own hold and sees the cards free (and sets its own surrogates aside while it decides),
records that arrive win over them, and they expire with the other holds, the assume timeout
after the preempt call.

An offer ends when the preemptor is bound, deleted or finished, when its ``nominatedNodeName``
names another node (kube-scheduler picked that one) or is cleared after naming this one (the
nomination was dropped), when the preempt verb is called again for
it (the new answer replaces the old), or at the assume timeout. A departing victim named by
several offers keeps its booking for the oldest.

Not thread-safe on its own: the cache's lock guards it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from qgpu_runtime.extender.bookings import Bookings
from qgpu_runtime.extender.podstate import PodStates
from qgpu_runtime.model.requests import PodRequest
from qgpu_runtime.placement import engine
from qgpu_runtime.placement.state import ClusterState, Placement, StateError

NOMINATED = "nominated:"  # never a pod key: a namespace holds no ':'


def surrogate_key(preemptor: str, victim: str) -> str:
    return f"{NOMINATED}{preemptor}|{victim}"


@dataclass
class Offer:
    """One node of a preempt answer: the victims qgpu chose there, and what their leaving kept."""

    preemptor: str
    uid: str
    node: str
    request: PodRequest
    since_ns: int
    waiting: set[str]  # victim keys that have not left yet
    kept: list[str] = field(default_factory=list)  # surrogate keys booked for victims that left
    confirmed: bool = False  # the preemptor's nominatedNodeName named this node


class Nominations:
    """Offers by preemptor key and node, and which offers wait for which victim."""

    def __init__(self, pods: PodStates, bookings: Bookings, policy: Any, report: Callable[[str], None]) -> None:
        self._pods = pods
        self._bookings = bookings
        self._policy = policy
        self._report = report
        self._offers: dict[str, dict[str, Offer]] = {}  # preemptor key -> node -> offer
        self._waiting_for: dict[str, set[tuple[str, str]]] = {}  # victim key -> (preemptor, node)

    def __len__(self) -> int:
        return len(self._offers)

    def has(self, preemptor: str) -> bool:
        return preemptor in self._offers

    def offers(self, preemptor: str) -> dict[str, Offer]:
        return dict(self._offers.get(preemptor, {}))

    def offer(self, state: ClusterState, preemptor: str, uid: str, node: str, request: PodRequest,
              victims: Iterable[str], now_ns: int) -> None:
        """Hold for ``preemptor`` on ``node`` what ``victims`` free once they leave (replacing an
        earlier offer of that node)."""
        self._drop(state, preemptor, node)
        offer = Offer(preemptor, uid, node, request, now_ns, set(victims))
        self._offers.setdefault(preemptor, {})[node] = offer
        for victim in offer.waiting:
            self._waiting_for.setdefault(victim, set()).add((preemptor, node))

    def nominated(self, state: ClusterState, preemptor: str, node: str) -> None:
        """The preemptor's ``status.nominatedNodeName`` as the watch has it: naming an offered node
        keeps that offer alone; cleared or moved after it named one, the nomination was dropped
        (kube-scheduler gave the room to a pod of higher priority) and so are the offers."""
        offers = self._offers.get(preemptor, {})
        if node in offers:
            offers[node].confirmed = True
            self.clear(state, preemptor, keep=node)
        elif any(o.confirmed for o in offers.values()):
            self.clear(state, preemptor)

    def clear(self, state: ClusterState, preemptor: str, keep: str | None = None) -> None:
        """End the preemptor's offers (all, or all but the one on node ``keep``)."""
        for node in list(self._offers.get(preemptor, {})):
            if node != keep:
                self._drop(state, preemptor, node)

    def _drop(self, state: ClusterState, preemptor: str, node: str) -> None:
        offers = self._offers.get(preemptor)
        offer = offers.pop(node, None) if offers else None
        if offer is None:
            return
        if not offers:
            del self._offers[preemptor]
        for victim in offer.waiting:
            waiting = self._waiting_for.get(victim)
            if waiting is not None:
                waiting.discard((preemptor, node))
                if not waiting:
                    del self._waiting_for[victim]
        for key in offer.kept:
            self._bookings.release(state, key)

    def waits_for(self, victim: str) -> bool:
        return victim in self._waiting_for

    def victim_left(self, state: ClusterState, victim: str, placement: Placement | None) -> None:
        """``victim`` is gone and its booking (``placement``, taken before the release) freed: keep
        it for the oldest offer waiting for it; book each preemptor whose victims are all gone."""
        waiting = self._waiting_for.pop(victim, set())
        offers = sorted((self._offers[p][n] for p, n in waiting if n in self._offers.get(p, {})),
                        key=lambda o: (o.since_ns, o.preemptor))
        for i, offer in enumerate(offers):
            offer.waiting.discard(victim)
            if i == 0 and placement is not None and placement.node == offer.node:
                key = surrogate_key(offer.preemptor, victim)
                try:
                    self._bookings.commit(state, key, placement)
                    self._pods.hold(key, offer.since_ns)
                    offer.kept.append(key)
                except StateError as exc:
                    self._report(f"pod {offer.preemptor}: cannot hold the cards of victim {victim}: {exc}")
            if not offer.waiting:
                self._complete(state, offer)

    def _complete(self, state: ClusterState, offer: Offer) -> None:
        """Every victim left: the preemptor's own placement replaces the surrogates."""
        self._drop(state, offer.preemptor, offer.node)
        key = offer.preemptor
        if self._pods.pinned(key) is not None or (key in state.bookings and not self._pods.held(key)):
            return  # a bind of it is in flight, or a record books it: nothing to hold
        self._bookings.release(state, key)
        if offer.node not in state.index:
            return
        mask = np.zeros(state.node_count, dtype=bool)
        mask[state.index[offer.node]] = True
        try:
            placement = engine.place(state, offer.request, self._policy, mask)
            self._bookings.commit(state, key, placement)
        except (engine.Unschedulable, StateError) as exc:
            self._report(f"pod {key}: its victims on {offer.node} left, but it does not fit there: {exc}")
            return
        self._pods.hold(key, offer.since_ns, offer.request)

    def set_aside(self, state: ClusterState, preemptor: str) -> list[tuple[str, Placement]]:
        """Release the preemptor's surrogates for one decision of its own (its filter)."""
        out = []
        for offer in self._offers.get(preemptor, {}).values():
            for key in offer.kept:
                placement = state.release(key)
                if placement is not None:
                    out.append((key, placement))
        return out

    def restore(self, state: ClusterState, preemptor: str, aside: list[tuple[str, Placement]]) -> None:
        """Book again what :meth:`set_aside` released, except what the preemptor's own hold now uses."""
        for key, placement in aside:
            try:
                state.commit(key, placement)
            except StateError:
                self._bookings.release(state, key)  # the preemptor's hold took those cards
                for offer in self._offers.get(preemptor, {}).values():
                    if key in offer.kept:
                        offer.kept.remove(key)

    def expire(self, state: ClusterState, now_ns: int, ttl_ns: int) -> None:
        for preemptor, offers in list(self._offers.items()):
            for node, offer in list(offers.items()):
                if now_ns - offer.since_ns >= ttl_ns:
                    self._drop(state, preemptor, node)
