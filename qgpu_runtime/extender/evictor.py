"""Opt-in eviction of pods whose cards failed, on device-plugin pools (issue 26 §4).

On a DRA pool a failed card's device carries a taint and kube-controller-manager evicts the pods
of a ``NoExecute`` one. Device-plugin pools have no such controller: the node manager marks the
card ``healthy: false`` in the node's inventory annotation and gives each pod on it an Event, and
the pods keep running. With ``--evict-on-unhealthy-card`` the extender evicts them (the Eviction
API: PodDisruptionBudgets are honoured, their controllers re-create them, and the scheduler places
the new pods on healthy cards).

What it believes, and who can write it:

- **which card failed**: the node's own inventory annotation (written by that node's manager; the
  admission policy ``qgpu-manager-own-node`` keeps it to its own Node). A compromised node can claim
  only its own cards failed, so it can evict only pods bound to itself, which it runs anyway.
- **which pods hold it**: the allocation record the extender signed (contract/signature.py), on a
  pod bound to that node, naming that card's index and UUID. A tenant cannot write a record the
  extender believes, so no tenant can point the evictor at another pod. The pod is read again from
  the API before its eviction, record verified, node, UID and card checked again, and the Eviction
  carries the UID as a precondition (a pod re-created under the name is not evicted).
- **whether to wait**: the pod's own tolerations, as for a ``NoExecute`` taint: a toleration of
  ``gpu.qgpu.io/unhealthy`` with ``operator: Exists`` (or an empty key with ``Exists``, which tolerates
  every taint) and no effect or ``NoExecute`` keeps the pod; with ``tolerationSeconds`` it is evicted
  that long after this extender first saw the card unhealthy. A pod can only spare itself.

Two extenders evicting the same pod is harmless (the second Eviction finds it terminating or
gone). Evictions refused (a budget, the apiserver) are retried with a growing delay.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from qgpu_runtime.contract.dra import UNHEALTHY_TAINT
from qgpu_runtime.contract.record import RecordError, parse_record
from qgpu_runtime.contract.signature import RecordVerifier, UntrustedRecord, trusted_record
from qgpu_runtime.kube.client import REQUEST_TIMEOUT, raw_json
from qgpu_runtime.kube.errors import brief as short

log = logging.getLogger(__name__)

MAX_EVICTIONS_PER_SCAN = 64
"""Pods one scan reads (and evicts) at most; the rest wait for the next scan (one burst of failed
cards does not turn into thousands of API calls at once)."""

RECHECK_TOLERATING_S = 60.0
"""A pod that tolerates a failed card for ever is read again only this often (a pod update may
add tolerations, never remove one), not at every scan; nor is a pod just evicted, until the watch
shows it terminating."""

RETRY_FIRST_S, RETRY_MAX_S = 5.0, 300.0
FORGET_AFTER = 16384  # pods remembered for their retry delays, oldest forgotten first


@dataclass(frozen=True)
class FailedCard:
    """An unhealthy card as its node's inventory names it."""

    index: int
    uuid: str
    reason: str


@dataclass(frozen=True)
class Target:
    """A pod the cache books on a failed card: its key, UID, node and the failed cards it holds."""

    key: str
    uid: str
    node: str
    cards: tuple[FailedCard, ...]


def targets(failed: Mapping[str, Mapping[int, FailedCard]], entries: Iterable[Any],
            dra_nodes: Iterable[str] = ()) -> list[Target]:
    """Pods with a (verified) record on a node of ``failed`` naming one of its failed cards, by
    index and UUID; nodes of DRA pools are left to their device taints. ``entries``: the cache's
    PodEntry objects (a record is there only when its signature held)."""
    skip = set(dra_nodes)
    out = []
    for entry in entries:
        cards = failed.get(entry.node_name)
        if not cards or entry.node_name in skip or entry.record_raw is None or entry.terminal or entry.deleting:
            continue
        try:
            record = parse_record(entry.record_raw)
        except RecordError:
            continue
        if record.node != entry.node_name:
            continue
        hit = _failed_cards_of(record, cards)
        if hit:
            out.append(Target(entry.key, entry.uid, entry.node_name, hit))
    return sorted(out, key=lambda t: t.key)


def _failed_cards_of(record: Any, cards: Mapping[int, FailedCard]) -> tuple[FailedCard, ...]:
    hit = {}
    for container in record.containers:
        for share in container.shares:
            card = cards.get(share.index)
            if card is not None and (not share.uuid or share.uuid == card.uuid):
                hit[card.index] = card
    return tuple(hit[i] for i in sorted(hit))


def tolerated_for(pod: Mapping[str, Any]) -> float | None:
    """How long the pod tolerates a failed card: None for ever, 0 not at all, else seconds (the
    shortest of its matching tolerations' ``tolerationSeconds``, as kubelet's taint manager reads
    them; a negative value counts as 0)."""
    tolerations = (pod.get("spec") or {}).get("tolerations") or []
    longest_forever = False
    seconds: list[float] = []
    for t in tolerations if isinstance(tolerations, list) else []:
        if not isinstance(t, Mapping):
            continue
        key, operator, effect = t.get("key") or "", t.get("operator") or "Equal", t.get("effect") or ""
        if operator != "Exists" or key not in ("", UNHEALTHY_TAINT) or effect not in ("", "NoExecute"):
            continue
        value = t.get("tolerationSeconds")
        if value is None:
            longest_forever = True
        elif isinstance(value, int) and not isinstance(value, bool):
            seconds.append(float(max(0, value)))
    if seconds:
        return min(seconds)
    return None if longest_forever else 0.0


class UnhealthyCardEvictor:
    """Evicts the pods of failed cards on device-plugin pools; :meth:`scan` once, :meth:`run` a loop."""

    def __init__(self, api: Any, failed: Callable[[], tuple[dict[str, dict[int, FailedCard]], list[Target]]],
                 verifier: RecordVerifier, monotonic: Callable[[], float] = time.monotonic,
                 on_result: Callable[[str], None] = lambda result: None) -> None:
        self.api = api  # kubernetes.client.CoreV1Api
        self.failed = failed  # the cache's failed cards and the pods it books on them
        self.verifier = verifier
        self.monotonic = monotonic
        self.on_result = on_result  # "evicted" or "refused", for the extender's metrics
        self._first_seen: dict[tuple[str, str], float] = {}  # (node, card UUID) -> when first seen failed
        self._retry: dict[str, tuple[float, float]] = {}  # pod UID -> (next try, delay)
        self._not_before: dict[str, float] = {}  # pod UID -> when its toleration may have run out
        self.evicted = 0

    def scan(self) -> list[str]:
        """One pass: the keys of the pods evicted."""
        cards, found = self.failed()
        now = self.monotonic()
        current = {(node, c.uuid) for node, by_index in cards.items() for c in by_index.values()}
        self._first_seen = {k: self._first_seen.get(k, now) for k in current}  # a card back healthy is forgotten
        done: list[str] = []
        reads = 0
        for target in found:
            if reads >= MAX_EVICTIONS_PER_SCAN:
                break
            retry = self._retry.get(target.uid)
            if (retry is not None and now < retry[0]) or now < self._not_before.get(target.uid, now):
                continue
            reads += 1
            since = min(self._first_seen.get((target.node, c.uuid), now) for c in target.cards)
            if self._evict(target, since, now):
                done.append(target.key)
        live = {t.uid for t in found}
        self._retry = {uid: r for uid, r in self._retry.items() if uid in live}
        self._not_before = {uid: t for uid, t in self._not_before.items() if uid in live}
        while len(self._retry) > FORGET_AFTER:
            self._retry.pop(next(iter(self._retry)))
        return done

    def _evict(self, target: Target, failed_since: float, now: float) -> bool:
        namespace, name = target.key.split("/", 1)
        try:
            pod = raw_json(self.api.read_namespaced_pod(name, namespace, _preload_content=False,
                                                        _request_timeout=REQUEST_TIMEOUT))
        except Exception as exc:  # noqa: BLE001 - gone (404) or unreadable: the next scan decides again
            if getattr(exc, "status", None) != 404:
                self._later(target.uid, now, f"cannot read pod {target.key}: {short(exc)}")
            return False
        if not self._still_on(pod, target):
            return False
        wait = tolerated_for(pod)
        if wait is None or now - failed_since < wait:
            self._not_before[target.uid] = now + RECHECK_TOLERATING_S if wait is None else failed_since + wait
            return False
        cards = ", ".join(f"card {c.index} ({c.uuid}: {c.reason or 'unhealthy'})" for c in target.cards)
        body = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": name, "namespace": namespace},
                "deleteOptions": {"preconditions": {"uid": target.uid}}}
        try:
            self.api.create_namespaced_pod_eviction(name, namespace, body, _preload_content=False,
                                                    _request_timeout=REQUEST_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - each kind of refusal is retried later or ends the matter
            status = getattr(exc, "status", None)
            if status in (404, 409):
                return False  # gone, or another pod under the name now
            why = "a PodDisruptionBudget allows no disruption now" if status == 429 else short(exc)
            self.on_result("refused")
            self._later(target.uid, now, f"pod {target.key} on {target.node} holds failed {cards}; eviction refused: {why}")
            return False
        self._retry.pop(target.uid, None)
        self._not_before[target.uid] = now + RECHECK_TOLERATING_S  # until the watch shows it terminating
        self.evicted += 1
        self.on_result("evicted")
        log.warning("evicted pod %s from node %s: it holds failed %s", target.key, target.node, cards)
        return True

    def _still_on(self, pod: Mapping[str, Any], target: Target) -> bool:
        meta = pod.get("metadata") or {}
        if meta.get("uid") != target.uid or meta.get("deletionTimestamp") \
                or (pod.get("spec") or {}).get("nodeName") != target.node:
            return False
        try:
            record = trusted_record(pod, self.verifier)
        except (RecordError, UntrustedRecord):
            return False
        return record is not None and bool(_failed_cards_of(record, {c.index: c for c in target.cards}))

    def _later(self, uid: str, now: float, message: str) -> None:
        _, delay = self._retry.get(uid, (0.0, RETRY_FIRST_S / 2))
        delay = min(RETRY_MAX_S, delay * 2)
        self._retry[uid] = (now + delay, delay)
        log.warning("%s; trying again in %g s", message, delay)

    def run(self, stop: threading.Event, period_s: float) -> None:
        while not stop.wait(period_s):
            try:
                self.scan()
            except Exception as exc:  # noqa: BLE001 - the next period tries again
                log.warning("unhealthy-card eviction scan failed: %s", short(exc))

