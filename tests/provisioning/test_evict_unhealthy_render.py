"""Opt-in eviction of a failed card's pods (issue 26 §4), as qgpu_scheduler deploys it: with
qgpu_scheduler_evict_unhealthy_cards the extender runs with --evict-on-unhealthy-card and its
ClusterRole gains exactly create on pods/eviction; without it the manifest is what it was (no
eviction right). The extender's behaviour is tested in tests/extender/test_evictor.py and on the
real node in tests/realnode/test_e2e_card_failure.py."""

from __future__ import annotations

import json
from pathlib import Path

from test_dra_prioritize_roles import DEVICE_PLUGIN_POOL, by_kind, extender_args, render_scheduler

EVICT_RULE = {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]}


def test_the_option_adds_exactly_the_flag_and_the_eviction_right(tmp_path: Path) -> None:
    off = render_scheduler(tmp_path / "off", DEVICE_PLUGIN_POOL)
    on = render_scheduler(tmp_path / "on", DEVICE_PLUGIN_POOL, qgpu_scheduler_evict_unhealthy_cards=True)
    assert "--evict-on-unhealthy-card" in extender_args(on)
    assert EVICT_RULE in by_kind(on, "ClusterRole")["rules"]
    assert not any("pods/eviction" in rule["resources"] for rule in by_kind(off, "ClusterRole")["rules"])
    stripped = json.loads(json.dumps(on))
    by_kind(stripped, "ClusterRole")["rules"].remove(EVICT_RULE)
    extender_args(stripped).remove("--evict-on-unhealthy-card")
    assert stripped == off
