"""Claim preparation: NodePrepareResources and NodeUnprepareResources decided, without gRPC.

kubelet names a claim by namespace, name and UID only. The preparer reads the claim from the
apiserver, checks the UID, decodes the allocation with ``contract.draclaim.claim_shares`` and each
request's class from the claim's opaque ShareConfig (``contract.draclaim.claim_share_settings``), books
the shares in the node store with the pods of its ``status.reservedFor`` (node/dra/state.py), and
writes a CDI spec whose devices carry the container environment both doors build
(contract/environment.py, node/dra/cdi.py). Unprepare undoes both.

Order and crash safety: prepare books first and writes the spec second; a repeated prepare
answers from the store when the spec is in place, and goes the whole way again (replacing its own
booking) when it is not, which repairs a crash between the two writes. Unprepare removes the spec
first, then the booking; both steps accept what is already gone, so it can be repeated, run by a
restarted plugin, or run for a claim never prepared.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from qgpu_runtime.contract.dra import QGPU_CLASSES
from qgpu_runtime.contract.draclaim import ClaimShare, DraClaimError, claim_requests, claim_share_settings, claim_shares
from qgpu_runtime.contract.names import MIXED_LABEL
from qgpu_runtime.contract.record import CardShare, ContainerDialect
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model import AppClass
from qgpu_runtime.node.dra import cdi
from qgpu_runtime.node.dra.settings import DraSettings
from qgpu_runtime.node.dra.state import PreparedDevice, over_booked, reserved_pods, share_rows
from qgpu_runtime.node.store import PreparedClaim, Share, Store
from qgpu_runtime.node.tenants import dominant_class

log = logging.getLogger("qgpu_runtime.node.draplugin")  # the DRA plugin's logger before the split


class ClaimSource(Protocol):
    def resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The claim as API JSON; raises with a message naming the call and the reason."""
        ...


class ClaimRefused(RuntimeError):
    """This claim cannot be prepared; the message is the per-claim error kubelet reports."""


class ClaimPreparer:
    """Prepare and unprepare claims: the decisions, no gRPC (tested directly and through it)."""

    def __init__(self, settings: DraSettings, cards: Mapping[int, CardInfo], store: Store, claims: ClaimSource,
                 policy: Callable[[], str], unhealthy: Callable[[], Mapping[int, str]] = dict,
                 device_exists: Callable[[str], bool] = os.path.exists,
                 clock_ns: Callable[[], int] = time.time_ns,
                 node_labels: Callable[[], Mapping[str, str]] | None = None) -> None:
        self.settings = settings
        # The node's labels, read when a claim asks the online or offline class (only a node
        # labelled mixed-qgpu-enable=enable takes those); None: no API, such claims are refused.
        self.node_labels = node_labels
        self.cards = dict(cards)
        self.store = store
        self.claims = claims
        self.policy = policy
        self.unhealthy = unhealthy
        self.device_exists = device_exists
        self.clock_ns = clock_ns
        self._lock = threading.Lock()  # one claim at a time: a booking reads every other one
        for stale in cdi.remove_stale_temporaries(settings.cdi_dir):  # a writer killed mid-write
            log.warning("removed a CDI temporary file a killed write left: %s", stale)

    def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        where = f"ResourceClaim {namespace}/{name} (uid {uid})"
        if not uid:
            raise ClaimRefused(f"{where}: kubelet sent no claim UID")
        path = self._spec_path(where, uid)
        with self._lock:
            booked = self.store.prepared_claim(uid)
            if booked is not None and cdi.read_spec(path) is not None:
                return [PreparedDevice.of_json(d) for d in booked.devices]
            if booked is not None:
                log.warning("%s: booked but its CDI spec %s is missing or unreadable; preparing again", where, path)
            return self._prepare(namespace, uid, name, where, path)

    def _prepare(self, namespace: str, uid: str, name: str, where: str, path: Path) -> list[PreparedDevice]:
        try:
            claim = self.claims.resource_claim(namespace, name)
        except Exception as exc:  # noqa: BLE001 - the per-claim error names it; kubelet retries
            raise ClaimRefused(f"{where}: cannot read it: {exc}") from exc
        found = str((claim.get("metadata") or {}).get("uid") or "")
        if found != uid:
            raise ClaimRefused(f"{where}: the apiserver's claim of that name has UID {found!r}, not the one kubelet "
                               "asked for (deleted and created again?); not preparing it")
        try:
            shares = claim_shares(claim, self.settings.node)
            settings = claim_share_settings(claim, [s.request for s in shares])
            self._check_charged(where, claim, shares)
        except DraClaimError as exc:
            raise ClaimRefused(str(exc)) from None
        self._check_class(where, {settings[s.request].app_class for s in shares})
        # Online work books memory only, as the device plugin books it (the extender's core 0): the
        # 10 the webhook asks (the capacity's minimum step) would otherwise cap it at 1 % of the card.
        # A peer's memory-only share (HAMi without gpucores, KAI) likewise (ShareConfig memoryOnly).
        shares = [replace(s, core_milli=0) if settings[s.request].app_class == AppClass.ONLINE.value or settings[s.request].memory_only
                  else s for s in shares]
        self._check_cards(where, shares)
        now = self.clock_ns()
        rows = share_rows(namespace, name, uid, shares, settings, self.cards, now)
        devices = [PreparedDevice((s.request,), s.pool, s.device, (cdi.device_id(f"{uid}-{i}"),), s.share_id)
                   for i, s in enumerate(shares)]
        asked = next((settings[s.request].dialect for s in shares if settings[s.request].dialect is not None), None)
        spec = cdi.spec(self._cdi_devices(uid, shares, dominant_class(settings[s.request].app_class for s in shares), asked))
        booked = PreparedClaim(uid, namespace, name, tuple(d.to_json() for d in devices), str(path), now,
                               reserved_pods(claim))
        self.store.book_claim(booked, rows, lambda others: self._refuse_over_booking(where, uid, rows, others))
        cdi.write_spec(path, spec)
        log.info("NodePrepareResources %s -> %s for pods %s", where,
                 [(s.device, s.core_milli, s.memory_mib, settings[s.request].app_class) for s in shares],
                 [p.name for p in booked.pods])
        return devices

    @staticmethod
    def _check_charged(where: str, claim: Mapping[str, Any], shares: Sequence[ClaimShare]) -> None:
        """No request is given more cards than the namespace's quota was charged for it
        (webhook/claimquota.py): an ``allocationMode: All`` request is charged the most cards one
        pod may take, and kube-scheduler's allocator gives it every matching card of the node, so
        on a node of more cards it would get more than was paid for."""
        asks = {ask.name: ask for request in claim_requests(claim) for ask in request.alternatives}
        for name, given in sorted(Counter(s.request for s in shares).items()):
            ask = asks.get(name)
            if ask is None:
                # a DeviceClass other than qgpu's whose selector matches qgpu's cards: the quota
                # charges only qgpu's classes, so its request would be granted cards for nothing
                raise ClaimRefused(f"{where}: request {name!r} was allocated qgpu's devices but does not ask one of "
                                   f"qgpu's DeviceClasses ({', '.join(sorted(QGPU_CLASSES))}), which the namespace's "
                                   "GPU quota charges: not preparing it")
            if given <= ask.charged_cards:
                continue
            if ask.count is None:
                raise ClaimRefused(
                    f"{where}: request {name!r} (allocationMode All) was allocated {given} cards of this node, "
                    f"but a claim is charged at most {ask.charged_cards} (CardLimits.max_cards_per_node) for it: "
                    f"not preparing more cards than the namespace's quota paid for; keep DRA pools to nodes of "
                    f"at most {ask.charged_cards} cards")
            raise ClaimRefused(f"{where}: request {name!r} was allocated {given} devices, more than its count "
                               f"{ask.count}: not preparing more than the namespace's quota paid for")

    def _check_class(self, where: str, classes: set[str]) -> None:
        """Online and offline claims only on a node labelled ``mixed-qgpu-enable=enable``, as the
        extender places online and offline pods (placement/engine.py). The class is the tenant's
        own word (the claim's opaque ShareConfig, written by anyone who may create claims), and
        an online share books no core: it is never throttled, so on a fixed-share or burst-share
        card it would take the time other tenants' shares paid for. The webhook's node selector
        keeps converted pods to mixed nodes; a claim written by hand meets this check."""
        asked = sorted(classes & {AppClass.ONLINE.value, AppClass.OFFLINE.value})
        if not asked:
            return
        if self.node_labels is None:
            raise ClaimRefused(f"{where}: asks the {asked[0]} class, which only a node labelled {MIXED_LABEL}=enable "
                               "takes, and this plugin cannot read its node's labels")
        try:
            labels = self.node_labels()
        except Exception as exc:  # noqa: BLE001 - the per-claim error names it; kubelet retries
            raise ClaimRefused(f"{where}: asks the {asked[0]} class; cannot read node {self.settings.node}'s labels "
                               f"to check {MIXED_LABEL}=enable: {exc}") from exc
        if labels.get(MIXED_LABEL) != "enable":
            raise ClaimRefused(f"{where}: asks the {asked[0]} class (ShareConfig appClass), but node "
                               f"{self.settings.node} is not labelled {MIXED_LABEL}=enable: online and offline work "
                               "shares only the cards of mixed nodes (docs/placement.md); not preparing it")

    def _check_cards(self, where: str, shares: Sequence[ClaimShare]) -> None:
        sick = self.unhealthy()
        for s in shares:
            if s.card_index not in self.cards:
                raise ClaimRefused(f"{where}: device {s.device} names card {s.card_index}, which this node does not "
                                   f"have (cards {sorted(self.cards)})")
            if s.card_index in sick:
                raise ClaimRefused(f"{where}: device {s.device} is unhealthy ({sick[s.card_index]})")

    def _refuse_over_booking(self, where: str, uid: str, mine: Sequence[Share], others: Sequence[Share]) -> None:
        """The node is the last line of defence here too: whatever booked the cards before (the
        device plugin, another claim, a scheduler that lost count), a card is never over-booked."""
        problems = over_booked(self.cards, where, uid, mine, others)
        if problems:
            raise ClaimRefused(f"{where}: its allocation would over-book this node: {'; '.join(problems)} "
                               "(the store already holds these shares; the claim must be allocated again)")

    def _cdi_devices(self, uid: str, shares: Sequence[ClaimShare], klass: str,
                     asked: ContainerDialect | None) -> list[cdi.CdiDevice]:
        card_shares = [CardShare(s.card_index, self.cards[s.card_index].uuid, s.core_milli, s.memory_mib) for s in shares]
        return cdi.claim_devices(uid, card_shares, self.cards, klass, self.policy(), self._device_nodes, asked)

    def _device_nodes(self, index: int) -> tuple[str, ...]:
        if not self.settings.pass_device_specs:
            return ()
        return cdi.card_device_nodes(self.cards[index], self.device_exists)

    def _spec_path(self, where: str, uid: str) -> Path:
        try:
            return cdi.spec_path(self.settings.cdi_dir, uid)
        except ValueError as exc:
            raise ClaimRefused(f"{where}: {exc}") from None

    def unprepare(self, namespace: str, uid: str, name: str) -> None:
        path = self._spec_path(f"ResourceClaim {namespace}/{name} (uid {uid[:140]!r})", uid)
        with self._lock:
            cdi.remove_spec(path)
            if self.store.release_claim(uid):
                log.info("NodeUnprepareResources ResourceClaim %s/%s (uid %s): released", namespace, name, uid)
