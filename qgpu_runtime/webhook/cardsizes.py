"""The card sizes of the DRA pools, as their ResourceSlices publish them: what T9k percent requests need.

``tensorstack.dev/nvidia-gpu-percent: 50`` asks half of whatever card it lands on, so its claim has
one alternative per card size of the pools (``firstAvailable``, at most eight, smallest first), each
selecting the cards of that size by the ``memoryMiB`` attribute the node publishes
(contract/dra.py). The sizes come from the slices of driver ``gpu.qgpu.io`` themselves, not from a
list kept by hand: a pool that gains a new card model serves percent pods on it once its slice is
published (and this replica's cached view, at most ``refresh_s`` old, is refreshed).

Mixed sizes in a pool are normal (a V100 16 GiB node beside an A100 80 GiB one): each size is one
alternative, so a percent pod takes that percent of the card it gets. A slice is written by its
node, and a compromised node may publish any number of sizes; when the pools publish more than
eight, the eight that the most nodes publish are kept (ties: the smaller size) and the rest named in
the webhook's log, so one node cannot crowd the others' sizes out. A device whose ``memoryMiB`` is
missing or outside the inventory's bounds is left out, as a node's inventory is read.

:func:`published_sizes` is pure; :class:`SliceCardSizes` lists the slices (RBAC: list resourceslices).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from kubernetes import client

from qgpu_runtime.contract.dra import ATTR_MEMORY_MIB, DRIVER, read_slice
from qgpu_runtime.contract.inventory import MAX_MEMORY_MIB
from qgpu_runtime.kube.client import REQUEST_TIMEOUT
from qgpu_runtime.kube.errors import ApiError, Unreachable, call
from qgpu_runtime.kube.paging import PageTooLarge, pages
from qgpu_runtime.model.requests import MIB_PER_GIB
from qgpu_runtime.webhook.dra import MAX_CARD_SIZES, CardSizesUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishedSizes:
    """``sizes``: the card sizes (MiB) percent claims choose among, smallest first; ``left_out``:
    sizes published beyond the eight kept."""

    sizes: tuple[int, ...]
    left_out: tuple[int, ...] = ()


def _card_memory(device: Any) -> int | None:
    attrs = device.get("attributes") if isinstance(device, dict) else None
    value = attrs.get(ATTR_MEMORY_MIB) if isinstance(attrs, dict) else None
    memory = value.get("int") if isinstance(value, dict) else None
    if isinstance(memory, bool) or not isinstance(memory, int) or not MIB_PER_GIB <= memory <= MAX_MEMORY_MIB:
        return None
    return memory


def sizes_by_node(slices: Iterable[Any], nodes: dict[int, set[str]] | None = None) -> dict[int, set[str]]:
    """Each card size the slices publish, with the nodes publishing it (added to ``nodes``): what
    a page of the LIST is reduced to before the next is read."""
    nodes = defaultdict(set) if nodes is None else nodes
    for slice_ in slices:
        cards = read_slice(slice_)
        if cards is None:
            continue
        for device in slice_["spec"].get("devices") or []:
            memory = _card_memory(device)
            if memory is not None:
                nodes[memory].add(cards.node)
    return nodes


def ranked_sizes(nodes: dict[int, set[str]]) -> PublishedSizes:
    """At most ``MAX_CARD_SIZES`` sizes, those the most nodes publish; each node counts once per size."""
    ranked = sorted(nodes, key=lambda size: (-len(nodes[size]), size))
    return PublishedSizes(tuple(sorted(ranked[:MAX_CARD_SIZES])), tuple(sorted(ranked[MAX_CARD_SIZES:])))


def published_sizes(slices: Iterable[Any]) -> PublishedSizes:
    """The card sizes qgpu's ResourceSlices publish: each node counts once per size, and at most
    ``MAX_CARD_SIZES`` sizes are kept, those the most nodes publish."""
    return ranked_sizes(sizes_by_node(slices))


class SliceCardSizes:
    """``__call__() -> sizes``: the published sizes, listed at most once per ``refresh_s`` while
    some are published, and once per ``empty_refresh_s`` while none are (a pool still starting: its
    first percent pod waits at most that long for its node's slice). Every quota check of a
    namespace with a qgpu quota asks (webhook/quota.py ``unsized_memory``), so a tenant creating
    pods fast costs the apiserver at most one LIST per interval either way. Raises
    CardSizesUnavailable, naming the call, when the slices cannot be listed."""

    def __init__(self, api_client: client.ApiClient, refresh_s: float = 10.0, monotonic: Callable[[], float] = time.monotonic,
                 empty_refresh_s: float = 1.0):
        self.api = client.ResourceV1Api(api_client)
        self.refresh_s = refresh_s
        self.empty_refresh_s = empty_refresh_s
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._cached: tuple[float, tuple[int, ...]] | None = None

    def __call__(self) -> tuple[int, ...]:
        with self._lock:
            now = self.monotonic()
            if self._cached is not None and now - self._cached[0] < (self.refresh_s if self._cached[1] else self.empty_refresh_s):
                return self._cached[1]
            found = ranked_sizes(self._sizes())
            if found.left_out:
                log.warning("ResourceSlices of %s publish more than %d card sizes: percent claims choose among %s; left out %s",
                            DRIVER, MAX_CARD_SIZES, list(found.sizes), list(found.left_out))
            self._cached = (now, found.sizes)
            return found.sizes

    def _sizes(self) -> dict[int, set[str]]:
        """The sizes of every qgpu slice, the LIST read a page at a time (kube/paging.py): a
        compromised node may write many slices, each near etcd's object limit."""
        where = f"listing ResourceSlices of driver {DRIVER}"
        nodes: dict[int, set[str]] = defaultdict(set)

        def fetch(limit: int, token: str | None) -> Any:
            try:
                return call(self.api.list_resource_slice, field_selector=f"spec.driver={DRIVER}", limit=limit,
                            _continue=token, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
            except Unreachable as exc:
                raise CardSizesUnavailable(f"{where}: the apiserver could not be reached: {exc}") from None
            except ApiError as exc:
                raise CardSizesUnavailable(f"{where}: the apiserver answered {exc}") from None

        try:
            for page in pages(fetch):
                sizes_by_node(page, nodes)
                del page  # not held while the next page is read
        except PageTooLarge as exc:
            raise CardSizesUnavailable(f"{where}: {exc}") from None
        except ValueError as exc:
            raise CardSizesUnavailable(f"{where}: the apiserver's answer is not JSON: {exc}") from None
        return nodes
