"""Polling until a probe answers, for tests that watch another process or the API."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def poll(probe: Callable[[], T | None], timeout: float = 20.0, interval: float = 0.05, what: str = "the condition") -> T:
    """The probe's first truthy answer; AssertionError naming ``what`` and the last answer after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")
