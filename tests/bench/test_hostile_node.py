"""The hostile-node benchmark's arms, small, on this checkout: what docs/benchmarks.md's "after"
rows claim holds (the hostile node refused with its reason, no filter failing)."""

from __future__ import annotations

import pytest

from bench.hostile_node import run_arm


@pytest.mark.parametrize("arm, words", [
    ("hostile", "lists 20 cards: at most 16 per node"),
    ("overflow", "memory_mib=18446744073709551616"),
])
def test_each_arm_refuses_the_hostile_node_and_decides_the_others(arm: str, words: str) -> None:
    result = run_arm(arm, nodes=3, cards=20, filters=3)
    assert result["failed_filters"] == 0 and result["failed_pod_events"] == 0
    assert result["first_filter"].startswith("hostile node: qgpu refused this node's data") and words in result["first_filter"]
