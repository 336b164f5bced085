"""Many watch streams held open against one of the node's gRPC servers, as a crowd of clients
would: each stream is read on its own thread, which records its fate."""

from __future__ import annotations

import threading
from typing import Callable, Iterator

import grpc

from tests.polling import poll

OPEN = "open"


class Streams:
    """``count`` streams made by ``start(channel)``, each on its own channel to ``target``."""

    def __init__(self, target: str, start: Callable[[grpc.Channel], Iterator[object]], count: int) -> None:
        self.fates: list[str | None] = [None] * count
        self.channels = [grpc.insecure_channel(target) for _ in range(count)]
        self._threads = [threading.Thread(target=self._read, args=(i, start), daemon=True) for i in range(count)]
        for t in self._threads:
            t.start()

    def _read(self, i: int, start: Callable[[grpc.Channel], Iterator[object]]) -> None:
        try:
            for _ in start(self.channels[i]):
                self.fates[i] = OPEN  # the server runs this stream: it holds a worker from now on
        except grpc.RpcError as exc:
            if self.fates[i] is None:
                self.fates[i] = exc.code().name

    def settled(self) -> list[str]:
        """Every stream's fate, once each one has either streamed or been refused."""
        return poll(lambda: list(self.fates) if all(self.fates) else None, timeout=15,
                    what="every stream to stream or be refused")  # type: ignore[return-value]

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        for t in self._threads:
            t.join(timeout=5)
