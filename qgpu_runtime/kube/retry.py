"""Retries with exponential backoff for API calls that can fail transiently.

Only failures a retry can fix are retried (throttling, 5xx, dropped connections, timeouts: the
:class:`~qgpu_runtime.kube.errors.Transient` class); a 4xx says the request itself is wrong and is
raised at once.
"""

from __future__ import annotations

import random
import time
from typing import Callable, TypeVar

from kubernetes.client.exceptions import ApiException

from qgpu_runtime.kube.errors import UNREACHABLE, Transient, classify

T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    """A :class:`~qgpu_runtime.kube.errors.Transient` error, or what :func:`~qgpu_runtime.kube.errors.call`
    would map to one."""
    if isinstance(exc, ApiException):
        return isinstance(classify(exc), Transient)
    return isinstance(exc, (Transient, *UNREACHABLE))


def with_backoff(
    call: Callable[[], T],
    *,
    attempts: int = 5,
    base_s: float = 0.05,
    cap_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    retryable: Callable[[BaseException], bool] = is_transient,
) -> T:
    """Run ``call``; on a transient failure wait base·2^k (jittered, capped) and try again."""
    if attempts < 1:
        raise ValueError(f"attempts={attempts}: must be >= 1")
    for attempt in range(attempts):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - filtered by retryable
            if attempt == attempts - 1 or not retryable(exc):
                raise
            delay = min(cap_s, base_s * (2**attempt))
            sleep(delay * (0.5 + random.random() / 2))
    raise AssertionError("unreachable")
