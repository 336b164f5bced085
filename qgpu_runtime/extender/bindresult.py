"""What a bind comes to: done (:class:`BindOutcome`), refused with a reason (:class:`BindError`),
or found done already (:class:`AlreadyBound`), and an apiserver error as one line of such a reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class BindError(RuntimeError):
    """The bind did not happen; nothing of it is left behind. The message says why."""


@dataclass(frozen=True)
class BindOutcome:
    node: str
    record: str | None  # None for pods that asked for no GPU


class AlreadyBound(Exception):
    def __init__(self, pod: dict[str, Any]):
        self.pod = pod


