"""The node's pods, kept by one watch: what Allocate, the reconciler and the samplers read.

Why: kubelet admits one pod at a time, and a LIST of the node's pods per Allocate (four per GPU
pod: two resources, GetPreferredAllocation and Allocate) costs time in proportion to the pods on
the node (issue 23). One LIST at start, then one watch (field selector ``spec.nodeName=<node>``)
keeps a copy; a door's ``derive`` runs once per version of a pod (the device plugin parses and
verifies the allocation record there), so a call reads work already done.

Trust and bounds: the pods are the apiserver's answer for this node only; what a tenant wrote in
them is checked by ``derive`` as before, once per version instead of once per call. Finished pods
(Succeeded, Failed) are not kept: every reader treats them as gone (nothing is granted to them,
their shares are released, they are isolated no more), and a tenant may park any number of them
on a node (a pod's owner sets ``spec.nodeName``; quota counts only pods not finished). At most
``max_pods`` pods are kept: past it the cache stops answering (``snapshot`` None, logged) and the
callers read with a LIST, as before the cache; the next relist that fits makes it answer again.

Staleness: the watch may lag. Kubelet calls Allocate only for a pod bound to this node, which its
own watch delivered, so a pod missing here is late, never absent: a caller that finds no answer
in the snapshot reads once with a LIST (``fresh``) and decides on that. Watch events arrive in
the apiserver's order, so a pod in the snapshot comes with every pod bound before it.

Expiry: a watch the apiserver ends is resumed from the last version seen (bookmarks move it);
``410 Gone`` (:class:`WatchExpired`) or any error relists, with backoff while the apiserver is away.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Mapping, Protocol, TypeVar

from qgpu_runtime.contract.names import finished
from qgpu_runtime.kube.podslim import kept

log = logging.getLogger("qgpu_runtime.node.manager")  # the log lines operators grep for keep their logger

D = TypeVar("D")
DEFAULT_MAX_PODS = 2048  # kubelet's --max-pods is 110 by default; a node far past this is not believed
WATCH_TIMEOUT_S = 300.0


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): relist."""


def watch_event(line: bytes | str) -> tuple[str, dict[str, Any]]:
    """One line of a watch stream as (type, object); an ERROR event ends the watch as WatchExpired
    (410) or as a ValueError naming the status the apiserver sent."""
    event = json.loads(line)
    if not isinstance(event, dict):
        raise ValueError(f"watch event is {type(event).__name__}, not an object")
    kind = str(event.get("type") or "")
    obj = event.get("object")
    if not isinstance(obj, dict):
        raise ValueError(f"watch event {kind!r} carries no object")
    if kind == "ERROR":
        if obj.get("code") == 410:
            raise WatchExpired(str(obj.get("message") or "410 Gone"))
        raise ValueError(f"watch ended with status {obj.get('code')!r}: {obj.get('message')!r}")
    return kind, obj


class PodWatchSource(Protocol):
    def list_pods_on_node(self, node: str) -> tuple[list[dict[str, Any]], str]: ...

    def watch_pods_on_node(self, node: str, resource_version: str, timeout_s: float,
                           stop: threading.Event) -> Iterator[tuple[str, dict[str, Any]]]: ...


@dataclass(frozen=True)
class NodePods(Generic[D]):
    """One consistent view: the node's pods and, per pod, what ``derive`` made of it (None left out)."""

    pods: tuple[dict[str, Any], ...]
    derived: tuple[D, ...]
    generation: int  # moves with every change; equal generations are equal views
    listed: bool  # True: read by a LIST just now, False: from the watch


def _uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


def _version(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("resourceVersion") or "")


class NodePodCache(Generic[D]):
    def __init__(self, source: PodWatchSource, node: str, derive: Callable[[dict[str, Any]], D | None], *,
                 max_pods: int = DEFAULT_MAX_PODS, watch_timeout_s: float = WATCH_TIMEOUT_S,
                 retry_max_s: float = 30.0) -> None:
        if max_pods < 1:
            raise ValueError(f"max_pods={max_pods!r}: must be >= 1")
        self.source = source
        self.node = node
        self.derive = derive
        self.max_pods = max_pods
        self.watch_timeout_s = watch_timeout_s
        self.retry_max_s = retry_max_s
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[dict[str, Any], D | None]] = {}
        self._version = ""
        self._synced = False
        self._overflow = False
        self._generation = 0
        self.lists = 0  # LISTs made, for the manager's metrics and the benchmark
        self.relists = 0

    # ---- reading ------------------------------------------------------------------------------
    def snapshot(self) -> NodePods[D] | None:
        """The watched view, or None while it is not synced (or holds more than ``max_pods``)."""
        with self._lock:
            if not self._synced or self._overflow:
                return None
            return self._view(self._entries, self._generation, listed=False)

    def fresh(self) -> NodePods[D]:
        """One LIST, for a caller the snapshot could not answer. ``derive`` is reused for pods
        whose version the cache already holds; the cache itself only learns through its watch."""
        pods = [p for p in self._list()[0] if not finished(p)]
        if len(pods) > self.max_pods:
            raise ValueError(f"node {self.node} has {len(pods)} pods: more than max_pods={self.max_pods}, "
                             "refusing to read them")
        with self._lock:
            known = dict(self._entries)
        return self._view(self._entries_of(pods, known), -1, listed=True)

    @staticmethod
    def _view(entries: Mapping[str, tuple[dict[str, Any], D | None]], generation: int, listed: bool) -> NodePods[D]:
        values = list(entries.values())
        return NodePods(tuple(p for p, _ in values), tuple(d for _, d in values if d is not None), generation, listed)

    def _entries_of(self, pods: list[dict[str, Any]], known: Mapping[str, tuple[dict[str, Any], D | None]]
                    ) -> dict[str, tuple[dict[str, Any], D | None]]:
        """Entries for listed pods; ``derive`` runs only for a pod whose version is not ``known``."""
        entries: dict[str, tuple[dict[str, Any], D | None]] = {}
        for pod in pods:
            old = known.get(_uid(pod))
            same = old is not None and bool(_version(pod)) and _version(old[0]) == _version(pod)
            if same and old is not None:
                entries[_uid(pod)] = old
            else:
                slim = kept(pod)
                entries[_uid(pod)] = (slim, self.derive(slim))
        return entries

    def _list(self) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        return self.source.list_pods_on_node(self.node)

    # ---- keeping it ---------------------------------------------------------------------------
    def relist(self) -> None:
        """Replace the copy with a LIST; the watch resumes from its version."""
        listed, version = self._list()
        pods = [p for p in listed if not finished(p)]
        overflow = len(pods) > self.max_pods
        if overflow:
            log.warning("node %s: %d pods listed, more than the cache keeps (%d); Allocate reads by LIST until "
                        "they fit", self.node, len(pods), self.max_pods)
        with self._lock:
            old = self._entries
        entries = self._entries_of(pods[: self.max_pods], old)
        with self._lock:
            self._entries = entries
            self._version = version
            self._overflow = overflow
            self._synced = True
            self._generation += 1
            self.relists += 1

    def apply(self, kind: str, pod: dict[str, Any]) -> None:
        """One watch event."""
        if kind == "BOOKMARK":
            with self._lock:
                self._version = _version(pod) or self._version
            return
        uid = _uid(pod)
        if kind not in ("ADDED", "MODIFIED", "DELETED") or not uid:
            return
        gone = kind == "DELETED" or (pod.get("spec") or {}).get("nodeName") != self.node or finished(pod)
        pod = kept(pod)  # derived from what is kept, as a relist's pods are: nothing holds the whole pod
        derived = None if gone else self.derive(pod)
        with self._lock:
            self._version = _version(pod) or self._version
            if gone:
                self._entries.pop(uid, None)
            elif uid in self._entries or len(self._entries) < self.max_pods:
                self._entries[uid] = (pod, derived)
            else:
                if not self._overflow:
                    log.warning("node %s: more than %d pods; Allocate reads by LIST until they fit", self.node,
                                self.max_pods)
                self._overflow = True
            self._generation += 1

    def watch_once(self, stop: threading.Event) -> None:
        """One watch from the version held, applied until it ends; WatchExpired when it is too old."""
        with self._lock:
            version = self._version
        for kind, pod in self.source.watch_pods_on_node(self.node, version, self.watch_timeout_s, stop):
            if stop.is_set():
                return
            self.apply(kind, pod)

    def serve(self, stop: threading.Event) -> None:
        """List, then watch until ``stop``; relist after an expiry, an error or an overflow."""
        delay = 0.5
        need_list = True
        while not stop.is_set():
            try:
                if need_list or self._overflow:
                    self.relist()
                    need_list = False
                self.watch_once(stop)
                delay = 0.5
            except WatchExpired as exc:
                log.info("node %s: pod watch expired (%s); listing again", self.node, exc)
                need_list = True
            except Exception as exc:  # noqa: BLE001 - apiserver away or a bad stream: relist after a wait
                if stop.is_set():
                    return
                log.warning("node %s: pod watch failed (%s); listing again in %.1f s", self.node, exc, delay)
                need_list = True
                if stop.wait(delay):
                    return
                delay = min(delay * 2, self.retry_max_s)

    def wait_synced(self, timeout_s: float) -> bool:
        stop = threading.Event()
        deadline = timeout_s
        step = 0.02
        while deadline > 0:
            if self.snapshot() is not None:
                return True
            stop.wait(step)
            deadline -= step
        return self.snapshot() is not None


class ListedPods(Generic[D]):
    """The same reads without a watch (``--pods-file``, whose source has none): every read lists."""

    def __init__(self, list_pods: Callable[[str], list[dict[str, Any]]], node: str,
                 derive: Callable[[dict[str, Any]], D | None]) -> None:
        self.list_pods = list_pods
        self.node = node
        self.derive = derive
        self.lists = 0

    def snapshot(self) -> NodePods[D] | None:
        return None

    def fresh(self) -> NodePods[D]:
        self.lists += 1
        pods = self.list_pods(self.node)
        derived = (self.derive(p) for p in pods)
        return NodePods(tuple(pods), tuple(d for d in derived if d is not None), -1, listed=True)

    def serve(self, stop: threading.Event) -> None:
        stop.wait()


def node_pods(source: Any, node: str, derive: Callable[[dict[str, Any]], D | None], *,
              max_pods: int = DEFAULT_MAX_PODS, retry_max_s: float = 30.0) -> NodePodCache[D] | ListedPods[D]:
    """The watch-fed cache where ``source`` can watch (the Kubernetes API), listing reads otherwise."""
    if hasattr(source, "watch_pods_on_node") and hasattr(source, "list_pods_on_node"):
        return NodePodCache(source, node, derive, max_pods=max_pods, retry_max_s=retry_max_s)
    return ListedPods(source.pods_on_node, node, derive)
