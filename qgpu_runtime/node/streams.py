"""How the node's gRPC servers share their worker threads between watch streams and unary calls.

grpc-python runs every RPC on one thread of the server's pool, and a server-streaming RPC
(``ListAndWatch`` of a device plugin, ``NodeWatchResources`` of the DRA plugin) keeps its thread
for as long as the client watches. With 8 workers and no other rule, 8 open streams left nothing
for ``Allocate``: kubelet's admission of a pod timed out while the streams idled (issue 21 §5).

So each server has ``MAX_STREAMS`` stream slots and ``UNARY_WORKERS`` more threads than that: a
stream past its slots is refused at once with RESOURCE_EXHAUSTED (its thread freed in
microseconds), and unary calls always find a worker. kubelet opens one stream per registration;
a second may overlap while a restarted kubelet's old one winds down, so 4 slots leave room for
that and for a `qgpu` diagnostic watch.
"""

from __future__ import annotations

import threading
from concurrent import futures
from contextlib import contextmanager
from typing import Any, Iterator

import grpc

MAX_STREAMS = 4
UNARY_WORKERS = 4


class StreamSlots:
    """At most ``limit`` streams at once; thread-safe."""

    def __init__(self, limit: int = MAX_STREAMS) -> None:
        if limit < 1:
            raise ValueError(f"limit={limit}: must be >= 1")
        self.limit = limit
        self._open = 0
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        with self._lock:
            return self._open

    @contextmanager
    def slot(self, context: Any, what: str) -> Iterator[None]:
        """Hold one slot for the body, or abort the RPC with RESOURCE_EXHAUSTED when none is free.
        ``context.abort`` raises, so the body never runs without a slot."""
        with self._lock:
            taken = self._open < self.limit
            if taken:
                self._open += 1
        if not taken:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{what}: {self.limit} streams already open on this socket; close one first")
        try:
            yield
        finally:
            with self._lock:
                self._open -= 1


def server_pool(prefix: str, streams: int = MAX_STREAMS) -> futures.ThreadPoolExecutor:
    """The worker pool of a server whose streams are bounded by ``streams`` slots."""
    return futures.ThreadPoolExecutor(max_workers=streams + UNARY_WORKERS, thread_name_prefix=prefix)
