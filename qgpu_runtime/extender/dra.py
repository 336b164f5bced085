"""The extender's view of qgpu's DRA devices, for prioritize-only scoring of DRA pods.

With DRA, kube-scheduler's own allocator picks the card: first fit within the node's pool, its
slices by name and each slice's devices in the order the slice lists them (contract/dra.py: one
pool per node, one device per card). qgpu cannot change that choice, and must not filter or bind
such pods, but it can still choose the node through prioritize. This view
answers "how would each node look after the allocator placed this pod's claims there" and scores
that with the extender's policy, so binpack fills one node before the next (the scheduler's own
plugins would spread).

What it mirrors, from watches (the I/O is in extender/watch.py):
- ResourceSlices of driver ``gpu.qgpu.io``: the cards of each node (core, memory and pods
  capacities, one column per device in first-fit order);
- ResourceClaims: the name of each, the capacity requests of those asking qgpu's DeviceClasses
  (a pod's demand) and the ``consumedCapacity`` of those allocated on qgpu's devices (the cards'
  usage);
- ResourceClaimTemplates: the name of each, and the demand of pods whose claims are made from one.
Only those few numbers are kept per object, never the objects.

A node's slices are written by that node's DRA plugin, so they get the inventory's bounds
(contract/inventory.py): a device whose index or memory is out of bounds is dropped, and a node
with more than ``MAX_CARDS`` devices or a repeated index is left out of the view (scored 0), so
one node's slice can never make the state fail to build for every DRA pod.

A claim pod may reach prioritize before the claims watch has delivered its claim (kube-scheduler's
informer and this watch are separate streams; the test created the claim and then the pod, and a
loaded extender read the claim later). ``demand`` then waits, up to ``wait`` seconds, for the
claim or template to be known: every claim and template is remembered by name, those asking
nothing of qgpu with no asks, so only one the watch has not delivered yet is waited for. The watch
delivers in resourceVersion order, so once the pod's claim is known, every allocation written
before that claim was created is counted too.

Blind spot: a claim kube-scheduler has allocated in its own memory but not written yet (the write
is in its binding cycle) is not counted until the watch delivers it; consecutive pods may then be
scored against a node that looks emptier than it is. Scores are a preference, the allocator still
checks capacity, so this costs packing quality, never an over-commit.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from qgpu_runtime.contract.dra import consumed_core, consumed_memory, pool_name, read_slice
from qgpu_runtime.contract.draclaim import DraClaimError, allocated_node, allocated_pools, describe, pool_shares, spec_requests
from qgpu_runtime.contract.inventory import MAX_CARDS, MAX_MEMORY_MIB
from qgpu_runtime.extender.pacing import PacedChanges
from qgpu_runtime.model.requests import CORE_MILLI_PER_CARD, DEFAULT_LIMITS, CardLimits, PodRequest
from qgpu_runtime.placement.engine import MAX_SCORE
from qgpu_runtime.placement.state import CardSpec, ClusterState, NodeSpec

log = logging.getLogger(__name__)

CLAIM_WAIT_S = 1.0
"""How long a prioritize call waits for a claim or template of its pod that the watch has not
delivered yet, before it answers with no opinion (0 everywhere). Only while both watches follow:
before their first LIST or while one relists, nothing is waited for (``DraView.demand``)."""
MAX_ASKS = 64
"""Devices one pod may ask through qgpu's classes before the view stops scoring it (a bound on the
per-call work, far above any card count a node has)."""
DEFAULT_NODE = NodeSpec("", 10**9, 10**9)
"""CPU and memory of a node the node cache does not know yet: large, so they never decide."""


@dataclass(frozen=True)
class Ask:
    """One device a claim asks: ``core`` thousandths and ``memory`` MiB, None for the device's
    default (the whole card's), as the allocator applies the slice's ``requestPolicy``."""

    core: int | None
    memory: int | None


@dataclass(frozen=True)
class Usage:
    """What one allocated claim consumes on one device."""

    node: str
    device: str
    core: int
    memory: int


class DemandError(ValueError):
    """A claim's request qgpu cannot read; the pod is scored 0 everywhere (no preference)."""


def claim_asks(spec: Mapping[str, Any], limits: CardLimits = DEFAULT_LIMITS, where: str = "spec") -> list[Ask]:
    """The devices a ResourceClaim spec asks of qgpu's classes (others' requests are skipped),
    decoded by contract/draclaim.py; ``where`` names the spec in the DemandError of one that does
    not decode.

    ``exactly`` requests and the first qgpu subrequest of a ``firstAvailable`` list (the allocator
    tries that first). A request without capacity asks the defaults: the whole card.
    """
    try:
        requests = spec_requests(spec, where)
    except DraClaimError as exc:
        raise DemandError(str(exc)) from None
    asks: list[Ask] = []
    for request in requests:
        first = request.alternatives[0]
        if first.count is None:
            raise DemandError(f"request {request.name!r}: allocationMode 'All' is not scored")
        core = None if first.core is None else consumed_core(first.core)
        # Above the largest card an ask fits nowhere whatever its size; the cap keeps it in int64.
        memory = None if first.memory is None else min(consumed_memory(first.memory, limits), MAX_MEMORY_MIB + 1)
        asks.extend([Ask(core, memory)] * first.count)
        if len(asks) > MAX_ASKS:
            raise DemandError(f"more than {MAX_ASKS} devices asked")
    return asks


def slice_cards(slice_: Mapping[str, Any]) -> tuple[str, list[tuple[str, CardSpec]]] | None:
    """(node, [(device name, card)]) of one of qgpu's ResourceSlices (contract.dra.read_slice);
    None for another driver's. A card's ``memory_mib`` is the slice's ``memory`` capacity (what
    claims can consume); devices out of the inventory's bounds are left out."""
    read = read_slice(slice_)
    if read is None:
        return None
    return read.node, [(c.device, CardSpec(c.index, c.uuid, c.model, c.memory_mib)) for c in read.cards]


def claim_usage(claim: Mapping[str, Any]) -> list[Usage]:
    """What an allocated claim consumes on qgpu's devices ([] when unallocated or not qgpu's);
    a pool whose results do not decode (contract.draclaim.claim_shares refuses them) counts as nothing,
    and so does one that is not the node kube-scheduler allocated the claim for (a node's slice can
    name any pool; booked by pool alone, a node's allocations would fill another node's cards)."""
    out: list[Usage] = []
    node = allocated_node(claim)
    for pool in allocated_pools(claim):  # a pool is a node
        if node is not None and pool != pool_name(node):
            continue
        try:
            shares = pool_shares(claim, pool)
        except DraClaimError:
            continue
        out.extend(Usage(pool, s.device, s.core_milli, s.memory_mib) for s in shares)
    return out


_UNKNOWN = object()
"""A claim or template the watch has not delivered (as opposed to one asking nothing of qgpu)."""


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


@dataclass(frozen=True)
class ReducedSlice:
    """What the view keeps of a ResourceSlice: its name and, for one of qgpu's, its node and cards."""

    name: str
    cards: "tuple[str, list[tuple[str, CardSpec]]] | None"


@dataclass(frozen=True)
class ReducedClaim:
    """What the view keeps of a ResourceClaim (or a template: no uid, no usage): its asks or why
    they cannot be read, and what it consumes. A LIST reduces each claim as its page is read, so
    a tenant's claims near etcd's object limit are never held whole together."""

    key: str
    uid: str
    asks: "list[Ask] | DemandError"
    usage: tuple[Usage, ...] = ()


class DraView:
    """Slices, claims and templates as the watches deliver them, and the scoring of DRA pods.

    ``node_specs``: the extender's node cache (CPU and memory of each node, for the policy's node
    terms), read when the card state is rebuilt (a slice changed); a node seen after its slice
    counts as large until then. Thread-safe: one lock, held for the event and for one scoring pass.
    """

    def __init__(self, limits: CardLimits = DEFAULT_LIMITS, node_specs: Callable[[], Mapping[str, NodeSpec]] | None = None):
        self.limits = limits
        self.node_specs = node_specs or dict
        self.lock = threading.RLock()
        self._delivered = threading.Condition(self.lock)  # notified when a claim or template is applied
        # whether each watch has listed and is following: only then is a claim it has not
        # delivered worth waiting for (before its first LIST, or while it relists after a break,
        # every claim pod would wait, and kube-scheduler's cycle is serial)
        self._following = {"claims": False, "templates": False}
        self._slices: dict[str, tuple[str, list[tuple[str, CardSpec]]]] = {}
        self._asks: dict[str, list[Ask] | DemandError] = {}  # claim ns/name -> asks
        self._template_asks: dict[str, list[Ask] | DemandError] = {}
        self._usage: dict[str, list[Usage]] = {}  # claim UID -> consumption
        self._state: ClusterState | None = None
        self._columns: dict[str, dict[str, int]] = {}  # node -> device name -> card slot
        # a slice change rebuilds the card state: paced per node as the nodes' specs are (extender/pacing.py)
        self.paced: PacedChanges[tuple[str, list[tuple[str, CardSpec]]]] = PacedChanges()  # slice name -> its latest cards, held back
        self._slice_nodes: set[str] = set()  # nodes whose slices were seen (one entry per node)

    # -- events --------------------------------------------------------------------------------

    @staticmethod
    def reduce_slice(obj: Mapping[str, Any]) -> ReducedSlice:
        """What the view keeps of a ResourceSlice, as a LIST reads its page (a node writes its own
        slices, each up to etcd's object limit)."""
        return ReducedSlice(str((obj.get("metadata") or {}).get("name") or ""), slice_cards(obj))

    def apply_slice(self, event: str, obj: "Mapping[str, Any] | ReducedSlice") -> None:
        reduced = obj if isinstance(obj, ReducedSlice) else self.reduce_slice(obj)
        name = reduced.name
        with self.lock:
            parsed = None if event == "DELETED" else reduced.cards
            if parsed is None:  # at once: a slice gone publishes nothing (counted: no free delete-and-create)
                gone = self._slices.pop(name, None)
                self.paced.removed(name, gone[0] if gone is not None else None)
                if gone is not None:
                    self._state = None
                return
            # a node's first slice applies at once; any later change, new slice names included, is paced
            known = parsed[0] in self._slice_nodes
            self._slice_nodes.add(parsed[0])
            if self._slices.get(name) == parsed:
                self.paced.settled(name)
                return
            quiet = bool(self.paced.waiting)  # one warning while slices wait, however many names a node makes
            if known and not self.paced.offer(name, parsed[0], parsed):
                if not quiet:
                    log.warning("ResourceSlice %s of node %s changes faster than %d times at once and once per %g s: "
                                "its latest devices apply when it may change again", name, parsed[0],
                                self.paced.pacer.burst, self.paced.pacer.interval_s)
                return
            self.paced.settled(name)
            self._slices[name] = parsed
            self._state = None

    def _take_due(self) -> None:
        """Apply the held-back slices whose nodes may change again (under the lock)."""
        for name, parsed in self.paced.take_due(len(self._slices)):
            self._slices[name] = parsed
            self._state = None

    def replace_slices(self, items: "Iterable[Mapping[str, Any] | ReducedSlice]") -> None:
        with self.lock:
            self._slices.clear()
            self.paced.clear()
            self._state = None
            for obj in items:
                self.apply_slice("ADDED", obj)

    def _asks_of(self, spec: Mapping[str, Any], where: str) -> "list[Ask] | DemandError":
        try:
            return claim_asks(spec, self.limits, where)
        except (DemandError, TypeError, ValueError) as exc:
            return DemandError(str(exc))

    def reduce_claim(self, obj: Mapping[str, Any]) -> ReducedClaim:
        asks = self._asks_of(obj.get("spec") or {}, f"{describe(obj)}: spec")
        return ReducedClaim(_key(obj), str((obj.get("metadata") or {}).get("uid") or ""), asks, tuple(claim_usage(obj)))

    def reduce_template(self, obj: Mapping[str, Any]) -> ReducedClaim:
        asks = self._asks_of((obj.get("spec") or {}).get("spec") or {}, f"{describe(obj, 'ResourceClaimTemplate')}: spec.spec")
        return ReducedClaim(_key(obj), "", asks)

    def apply_claim(self, event: str, obj: "Mapping[str, Any] | ReducedClaim") -> None:
        if event == "DELETED":
            key = obj.key if isinstance(obj, ReducedClaim) else _key(obj)
            uid = obj.uid if isinstance(obj, ReducedClaim) else str((obj.get("metadata") or {}).get("uid") or "")
            with self.lock:
                self._asks.pop(key, None)
                self._set_usage(uid, [])
            return
        reduced = obj if isinstance(obj, ReducedClaim) else self.reduce_claim(obj)
        with self.lock:
            self._asks[reduced.key] = reduced.asks  # [] for a claim asking nothing of qgpu: known
            self._set_usage(reduced.uid, list(reduced.usage))
            self._delivered.notify_all()

    def following(self, kind: str, yes: bool) -> None:
        """The ``claims`` or ``templates`` watch listed (True) or broke (False, set by its feeder)."""
        with self.lock:
            self._following[kind] = yes
            self._delivered.notify_all()

    def replace_claims(self, items: "Iterable[Mapping[str, Any] | ReducedClaim]") -> None:
        with self.lock:
            self._following["claims"] = True
            self._asks.clear()
            self._usage.clear()
            self._state = None
            for obj in items:
                self.apply_claim("ADDED", obj)

    def apply_template(self, event: str, obj: "Mapping[str, Any] | ReducedClaim") -> None:
        if event == "DELETED":
            with self.lock:
                self._template_asks.pop(obj.key if isinstance(obj, ReducedClaim) else _key(obj), None)
            return
        reduced = obj if isinstance(obj, ReducedClaim) else self.reduce_template(obj)
        with self.lock:
            self._template_asks[reduced.key] = reduced.asks
            self._delivered.notify_all()

    def replace_templates(self, items: "Iterable[Mapping[str, Any] | ReducedClaim]") -> None:
        with self.lock:
            self._following["templates"] = True
            self._template_asks.clear()
            for obj in items:
                self.apply_template("ADDED", obj)

    def _set_usage(self, uid: str, usage: list[Usage]) -> None:
        old = self._usage.pop(uid, [])
        if usage:
            self._usage[uid] = usage
        if self._state is not None and old != usage:
            self._book(old, -1)
            self._book(usage, +1)

    # -- state ---------------------------------------------------------------------------------

    def state(self) -> ClusterState:
        """The cards of every node with a qgpu slice, their columns in first-fit order (the node's
        slices by name, each one's devices as listed: the allocator's walk), minus what allocated
        claims consume."""
        with self.lock:
            self._take_due()
            if self._state is None:
                cards: dict[str, list[tuple[str, CardSpec]]] = {}
                for name in sorted(self._slices):  # the allocator walks a pool's slices by name
                    node, devices = self._slices[name]
                    cards.setdefault(node, []).extend(devices)
                known = self.node_specs()
                specs, self._columns = [], {}
                for node in sorted(cards):
                    ordered = cards[node]  # and each slice's devices in the order it lists them
                    indices = [c.index for _, c in ordered]
                    if len(ordered) > MAX_CARDS or len(set(indices)) != len(indices):
                        continue  # out of bounds: this node only is left out (scored 0)
                    base = known.get(node) or DEFAULT_NODE
                    specs.append(NodeSpec(node, base.cpu_milli, base.memory_mib, tuple(c for _, c in ordered)))
                    self._columns[node] = {name: j for j, (name, _) in enumerate(ordered)}
                self._state = ClusterState(specs, self.limits)
                for usage in self._usage.values():
                    self._book(usage, +1)
            return self._state

    def _book(self, usage: list[Usage], sign: int) -> None:
        state = self._state
        assert state is not None
        for u in usage:
            row = state.index.get(u.node)
            col = self._columns.get(u.node, {}).get(u.device)
            if row is None or col is None:
                continue  # its slice is not seen yet: booked when the state is rebuilt
            state.core_free[row, col] -= sign * u.core
            state.mem_free_card[row, col] -= sign * u.memory
            state.pods[row, col] += sign

    # -- pods ----------------------------------------------------------------------------------

    def demand(self, pod: Mapping[str, Any], wait: float = 0.0) -> list[Ask] | None:
        """The devices ``pod`` asks of qgpu through its claims; None when it asks none (or one of
        its claims is not readable, or not known after ``wait`` seconds: then qgpu has no opinion).
        A claim or template the watch has not delivered yet is waited for (module docstring)."""
        meta = pod.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        refs = (pod.get("spec") or {}).get("resourceClaims") or []
        # a template's claim, once the resourceclaim controller made it, is named in the pod's
        # status (kube-scheduler waits for it): that claim is what gets allocated, and it stays
        # readable when the template is deleted
        made = {str(s.get("name")): str(s.get("resourceClaimName"))
                for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
                if isinstance(s, dict) and s.get("resourceClaimName")}
        deadline = time.monotonic() + wait
        with self.lock:
            while True:
                asks = self._demand(namespace, refs, made)
                left = deadline - time.monotonic()
                if asks is not _UNKNOWN or left <= 0 or not all(self._following.values()):
                    break
                self._delivered.wait(left)
        return None if asks is _UNKNOWN else asks

    def _demand(self, namespace: str, refs: list[Any], made: Mapping[str, str]) -> "list[Ask] | None | object":
        asks: list[Ask] = []
        for ref in refs:
            if ref.get("resourceClaimName"):
                found = self._asks.get(f"{namespace}/{ref['resourceClaimName']}", _UNKNOWN)
            elif str(ref.get("name")) in made:
                found = self._asks.get(f"{namespace}/{made[str(ref.get('name'))]}", _UNKNOWN)
            elif ref.get("resourceClaimTemplateName"):
                found = self._template_asks.get(f"{namespace}/{ref['resourceClaimTemplateName']}", _UNKNOWN)
            else:
                found = []
            if found is _UNKNOWN:
                return _UNKNOWN
            if isinstance(found, DemandError):
                return None
            asks.extend(found)  # type: ignore[arg-type]
        return asks[:MAX_ASKS] or None

    def scores(self, asks: list[Ask], request: PodRequest, names: list[str], policy: Any) -> np.ndarray:
        """0..10 per name: the policy's ranking of the state each node would be left in after
        first-fit placed ``asks`` on its cards; 0 where they would not fit or the node has no slice.

        One numpy pass per asked device over all named nodes; no per-node Python."""
        with self.lock:
            state = self.state()
            rows = state.rows_of(names)
            known = rows >= 0
            r = rows[known]
            core = state.core_free[r].copy()
            mem = state.mem_free_card[r].copy()
            pods = state.pods[r].copy()
            cap = state.card_mem_cap[r]
            limit = state.pod_limit[r]
            ok = np.ones(len(r), dtype=bool)
            at = np.arange(len(r))
            for ask in asks:
                need_core = CORE_MILLI_PER_CARD if ask.core is None else ask.core
                need_mem = cap if ask.memory is None else np.minimum(ask.memory, cap)
                fit = state.card_valid[r] & (core >= need_core) & (mem >= need_mem) & (pods < limit)
                ok &= fit.any(axis=1)
                col = np.argmax(fit, axis=1)  # the first fitting card: the allocator's first fit
                take_mem = need_mem[at, col] if isinstance(need_mem, np.ndarray) else need_mem
                core[at, col] -= np.where(ok, need_core, 0)
                mem[at, col] -= np.where(ok, take_mem, 0)
                pods[at, col] += ok
            out = np.zeros(len(names), dtype=np.int64)
            if not ok.any():
                return out
            good = r[ok]
            cost = np.asarray(policy.state_cost(state, good, np.maximum(core[ok], 0), request), dtype=float)
        lo, hi = float(cost.min()), float(cost.max())
        node_scores = np.full(len(good), MAX_SCORE, dtype=np.int64) if hi == lo else \
            np.round(MAX_SCORE * (hi - cost) / (hi - lo)).astype(np.int64)
        scored = np.zeros(len(r), dtype=np.int64)
        scored[ok] = node_scores
        out[known] = scored
        return out
