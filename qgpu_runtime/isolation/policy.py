"""Node isolation policies and how a node names them.

The policy is a property of the node (all tenants of a card must live under one rule, or the
rules contradict each other), so it comes from a node label in a cluster and from a config option
on a standalone host. The names and aliases follow Tencent qGPU so existing labels keep working.
"""

from __future__ import annotations

import enum
from typing import Mapping

from qgpu_runtime.contract.names import ISOLATION_POLICY_LABEL

POLICY_LABEL = ISOLATION_POLICY_LABEL


class Policy(str, enum.Enum):
    """How compute is shared among the tenants of one card.

    best-effort: no cap; contention splits the card by time slices (about 1/N each).
    fixed-share: a tenant never exceeds its core share, even on an otherwise idle card.
    burst-share: a tenant is guaranteed its share and may borrow idle capacity, which it gives
    back within a bounded time once the owner claims it.
    """

    BEST_EFFORT = "best-effort"
    FIXED_SHARE = "fixed-share"
    BURST_SHARE = "burst-share"


_ALIASES: dict[str, Policy] = {
    "best-effort": Policy.BEST_EFFORT,
    "be": Policy.BEST_EFFORT,
    "fixed-share": Policy.FIXED_SHARE,
    "fs": Policy.FIXED_SHARE,
    "burst-share": Policy.BURST_SHARE,
    "bs": Policy.BURST_SHARE,
}

DEFAULT_POLICY = Policy.BEST_EFFORT


def parse_policy(value: str, field: str = "policy") -> Policy:
    """Turn a label or config value (full name or qGPU alias, any case) into a Policy."""
    policy = _ALIASES.get(value.strip().lower()) if isinstance(value, str) else None
    if policy is None:
        allowed = ", ".join(sorted(_ALIASES))
        raise ValueError(f"{field}: {value!r} is not a known isolation policy: use one of {allowed}")
    return policy


def policy_of_node(labels: Mapping[str, str]) -> Policy:
    """The policy a node's labels ask for; best-effort when the label is absent."""
    raw = labels.get(POLICY_LABEL)
    if raw is None:
        return DEFAULT_POLICY
    return parse_policy(raw, field=f"node label {POLICY_LABEL}")
