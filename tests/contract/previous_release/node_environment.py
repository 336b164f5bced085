"""FROZEN COPY, for version-skew tests only: the container environment of the release before issue 24
(commit 0ec0e40, node/response.py card_envs, t9k_envs, t9k_share_envs and node/matching.py
container_quantity), verbatim apart from this docstring and its imports. Then the device plugin
read the T9k mode from the pod spec; now it reads the record's dialect. Never import this from
qgpu_runtime; never "fix" it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from qgpu_runtime.contract.record import CardShare
from qgpu_runtime.gpu.types import CardInfo
from qgpu_runtime.model import requests as rq
from qgpu_runtime.model.requests import parse_quantity

MAX_PLAIN_DIGITS = 18


def container_quantity(container: Mapping[str, Any], resource: str) -> int | None:
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        values = resources.get(section) or {}
        if resource in values:
            raw = values[resource]
            if isinstance(raw, int) and not isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= MAX_PLAIN_DIGITS:
                return int(raw)  # the usual case; skips the general parser on kubelet's hot path
            try:
                q = parse_quantity(raw)
            except ValueError:
                return None
            return int(q) if q == q.to_integral_value() else None
    return None



def card_envs(shares: Sequence[CardShare], klass: str, policy: str) -> dict[str, str]:
    """The variables the isolation engine and the container read, for both front doors (device
    plugin Allocate and DRA NodePrepareResources): cards and their shares in one order."""
    return {
        "NVIDIA_VISIBLE_DEVICES": ",".join(s.uuid for s in shares),
        "QGPU_CORE_MILLI": ",".join(str(s.core_milli) for s in shares),
        "QGPU_MEMORY_MIB": ",".join(str(s.memory_mib) for s in shares),
        "QGPU_CLASS": klass,
        "QGPU_POLICY": policy,
    }


T9K_MODES = ((rq.T9K_GPU, "xgn"), (rq.T9K_GPU_PERCENT, "sgn"), (rq.T9K_GPU_NODE, "node"))


def t9k_envs(spec_container: Mapping[str, Any], shares: Sequence[CardShare]) -> dict[str, str]:
    """The T9k variables for a container that asks in the T9k dialect, none otherwise. Every mode
    gets the same names, so a T9k image reads its mode and cards without guessing the request.

    ``T9K_GPU_MODE`` xgn | sgn | node; ``T9K_GPU_COUNT`` cards granted; for sgn also
    ``T9K_GPU_PERCENT`` (percent of the card's memory asked) and ``T9K_GPU_MEMORY`` (MiB per card)."""
    for resource, mode in T9K_MODES:
        asked = container_quantity(spec_container, resource)
        if asked is None:
            continue
        envs = {"T9K_GPU_MODE": mode, "T9K_GPU_COUNT": str(len(shares))}
        if resource == rq.T9K_GPU_PERCENT:
            envs["T9K_GPU_PERCENT"] = str(asked)
            envs["T9K_GPU_MEMORY"] = ",".join(str(s.memory_mib) for s in shares)
        return envs
    return {}


def t9k_share_envs(shares: Sequence[CardShare], cards: Mapping[int, CardInfo]) -> dict[str, str]:
    """The T9k variables for shares that come without a T9k request (a DRA claim): all cards at
    full core read as ``xgn``, anything less as ``sgn`` with the memory percent of the first card, so a T9k
    image finds the same names whichever door its cards came through."""
    if not shares:
        return {}
    envs = {"T9K_GPU_COUNT": str(len(shares))}
    if all(s.core_milli >= rq.CORE_MILLI_PER_CARD for s in shares):
        return {"T9K_GPU_MODE": "xgn", **envs}
    first = shares[0]
    percent = max(1, min(100, round(100 * first.memory_mib / cards[first.index].memory_mib)))
    return {"T9K_GPU_MODE": "sgn", **envs, "T9K_GPU_PERCENT": str(percent),
            "T9K_GPU_MEMORY": ",".join(str(s.memory_mib) for s in shares)}
