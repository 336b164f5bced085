"""Pod annotation writes off kubelet's admission path: a bounded queue and one worker.

Why: Allocate used to PATCH ``qgpu.io/assigned`` before answering kubelet, one API round trip per
container and resource on the path every GPU pod waits on (issue 23). The store is the authority
(the grant is durable there before kubelet hears back); the annotation is a copy for people and
tools. So Allocate hands the write here and answers at once.

Order and coalescing: writes to one pod are merged (a later value of a key replaces an earlier one,
so ``qgpu.io/assigned``, a whole list each time, lands as its newest value) and pods are written in
the order they first asked. Retry: a failed write goes back to the end of the queue after a backoff
that doubles up to ``retry_max_s``; after ``attempts`` failures it is dropped and logged.

Bounds: at most ``max_pending`` pods wait; past it the oldest is dropped (logged). Nothing is lost
for good: the reconciler re-derives every missing ``qgpu.io/assigned`` from the store — at start
(node/reconcile.py rule 4) and every release interval while running — so a write dropped by the
bound, by retries or by a crash or restart before it landed is issued again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping

log = logging.getLogger("qgpu_runtime.node.manager")  # the log lines operators grep for keep their logger

PodKey = tuple[str, str]  # (namespace, name)


@dataclass
class _Pending:
    values: dict[str, str]
    attempts: int = 0
    not_before: float = 0.0
    done: list[threading.Event] = field(default_factory=list)


class AnnotationWriter:
    def __init__(self, patch: Callable[[str, str, Mapping[str, str]], None], *, max_pending: int = 4096,
                 attempts: int = 8, retry_base_s: float = 0.5, retry_max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_pending < 1 or attempts < 1:
            raise ValueError(f"max_pending={max_pending!r}, attempts={attempts!r}: each must be >= 1")
        self._patch = patch
        self.max_pending = max_pending
        self.attempts = attempts
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self._clock = clock
        self._pending: OrderedDict[PodKey, _Pending] = OrderedDict()
        # last values landed (at most max_pending pods, oldest forgotten), so a re-issue that changes nothing is skipped
        self._written: OrderedDict[PodKey, dict[str, str]] = OrderedDict()
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = False
        self.written = 0
        self.failed = 0
        self.dropped = 0

    def submit(self, namespace: str, name: str, values: Mapping[str, str]) -> threading.Event:
        """Queue a merge of ``values`` into the pod's annotations; the event is set once it landed
        or was given up. Never blocks on the API."""
        key = (namespace, name)
        done = threading.Event()
        with self._cond:
            if key not in self._pending and self._written.get(key, {}) | dict(values) == self._written.get(key):
                done.set()  # the same values already landed: nothing to write
                return done
            entry = self._pending.get(key)
            if entry is None:
                if len(self._pending) >= self.max_pending:
                    (old, dropped) = self._pending.popitem(last=False)
                    self.dropped += 1
                    log.warning("pod %s/%s: annotation write dropped, %d writes already wait (the reconciler "
                                "issues it again)", old[0], old[1], self.max_pending)
                    for e in dropped.done:
                        e.set()
                entry = self._pending[key] = _Pending({})
            entry.values.update(values)
            entry.done.append(done)
            self._cond.notify_all()
        return done

    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + (1 if self._busy else 0)

    def forget(self, namespace: str, name: str) -> None:
        """The pod is gone: no write for it, and no memory of what landed."""
        with self._cond:
            self._written.pop((namespace, name), None)

    def _next(self) -> tuple[PodKey, _Pending] | None:
        """The first pod whose backoff has passed; waits for one. None once stopping and empty."""
        with self._cond:
            while True:
                now = self._clock()
                for key, entry in self._pending.items():
                    if entry.not_before <= now:
                        del self._pending[key]
                        self._busy = True
                        return key, entry
                if self._stopping:
                    return None
                wait = min((e.not_before for e in self._pending.values()), default=now + 1.0) - now
                self._cond.wait(timeout=max(0.01, min(wait, 1.0)))

    def run_once(self) -> bool:
        """Write one pod's values (or requeue them); False when stopping and nothing is left."""
        item = self._next()
        if item is None:
            return False
        key, entry = item
        try:
            self._patch(key[0], key[1], dict(entry.values))
        except Exception as exc:  # noqa: BLE001 - the API's reason is logged; the reconciler covers a drop
            self._failed(key, entry, exc)
            return True
        with self._cond:
            self._busy = False
            self.written += 1
            self._written[key] = {**self._written.pop(key, {}), **entry.values}
            while len(self._written) > self.max_pending:
                self._written.popitem(last=False)
            self._cond.notify_all()
        for e in entry.done:
            e.set()
        return True

    def _failed(self, key: PodKey, entry: _Pending, exc: Exception) -> None:
        entry.attempts += 1
        with self._cond:
            self._busy = False
            if entry.attempts >= self.attempts or self._stopping:
                self.failed += 1
                log.warning("pod %s/%s: could not write %s after %d attempt(s): %s (the reconciler issues it again)",
                            key[0], key[1], sorted(entry.values), entry.attempts, exc)
                for e in entry.done:
                    e.set()
                self._cond.notify_all()
                return
            newer = self._pending.pop(key, None)  # values queued meanwhile are newer: they win
            if newer is not None:
                entry.values.update(newer.values)
                entry.done.extend(newer.done)
            entry.not_before = self._clock() + min(self.retry_base_s * 2 ** (entry.attempts - 1), self.retry_max_s)
            self._pending[key] = entry
            self._cond.notify_all()

    def serve(self, stop: threading.Event) -> None:
        """The worker: writes until ``stop``, then what is due within ``drain_s`` of ``close``."""
        watcher = threading.Thread(target=lambda: (stop.wait(), self.close()), name="annotations-stop", daemon=True)
        watcher.start()
        while self.run_once():
            pass

    def close(self) -> None:
        """Stop taking retries; the worker writes what is queued once more and ends."""
        with self._cond:
            self._stopping = True
            for entry in self._pending.values():
                entry.not_before = 0.0
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or being written; False when ``timeout_s`` passed first."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while self._pending or self._busy:
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._cond.wait(timeout=min(left, 0.1))
        return True
