"""qgpu_node_pool and T9k's node modes (issue 22 §2): a pool left at the role's defaults is a shared
pool that serves T9k's sharing request (nvidia-gpu-percent) beside every other dialect, unless its
operator opts out; xgn pools are tainted. The labels the role plans are fed to the placement engine,
so what is checked is that the pod lands, not only which label is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ansible_tools import BIN, REPO, run_tool

from qgpu_runtime.model.requests import parse_pod
from qgpu_runtime.placement import CardSpec, ClusterState, NodeSpec, Unschedulable, make_policy, place

PLAYBOOK = REPO / "tests/provisioning/playbooks/node-pool-cdi.yml"  # plan mode, device-plugin pools leave containerd alone
ALLOC_MODE = "sched.tensorstack.dev/node-alloc-mode"
XGN_TAINT = {"key": "sched.tensorstack.dev/xgn-mode", "value": "true", "effect": "NoSchedule"}


def planned(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    root = tmp_path / "root"
    (root / "etc/containerd").mkdir(parents=True)
    run = run_tool([str(BIN / "ansible-playbook"), "-i", "localhost,", str(PLAYBOOK),
                    "-e", json.dumps({"qgpu_root_prefix": str(root), "qgpu_node_pool_containerd_version": "2.1.4", **extra})])
    assert run.returncode == 0, run.output[-4000:]
    return json.loads((root / "var/lib/qgpu/provisioning/node-pool/gpu-dra-1.json").read_text())


def t9k_pod(limits: dict[str, str]) -> dict[str, Any]:
    """As T9k's guide writes it: its scheduler's name and a group label, nothing qgpu-specific."""
    return {"metadata": {"name": "t9k", "namespace": "ns", "labels": {"scheduler.tensorstack.dev/group-name": "g"}},
            "spec": {"schedulerName": "t9k-scheduler", "containers": [{"name": "c", "resources": {"limits": limits}}]}}


def node_with(labels: dict[str, str | None]) -> ClusterState:
    present = {k: v for k, v in labels.items() if v is not None}
    cards = tuple(CardSpec(i, f"GPU-{i}", "Tesla V100", 32768) for i in range(2))
    return ClusterState([NodeSpec("gpu-dra-1", 32000, 64 * 1024, cards, present)])


def test_a_pool_at_the_defaults_serves_t9k_percent(tmp_path: Path) -> None:
    plan = planned(tmp_path)
    assert plan["metadata"]["labels"][ALLOC_MODE] == "sgn"
    assert plan["spec"]["taints"] == []
    placed = place(node_with(plan["metadata"]["labels"]), parse_pod(t9k_pod({"tensorstack.dev/nvidia-gpu-percent": "25"})),
                   make_policy("binpack"))
    assert placed.node == "gpu-dra-1" and placed.containers[0].shares[0].memory_mib == 8192


def test_an_operator_opts_a_pool_out_of_t9k_requests(tmp_path: Path) -> None:
    plan = planned(tmp_path, qgpu_node_pool_alloc_mode="")
    assert plan["metadata"]["labels"][ALLOC_MODE] is None  # the merge patch removes the label
    state = node_with(plan["metadata"]["labels"])
    with pytest.raises(Unschedulable, match="node allocation mode does not match the T9k request"):
        place(state, parse_pod(t9k_pod({"tensorstack.dev/nvidia-gpu-percent": "25"})), make_policy("binpack"))
    # the other dialects never look at the label
    assert place(state, parse_pod(t9k_pod({"nvidia.com/gpu": "1"})), make_policy("binpack")).node == "gpu-dra-1"


def test_an_xgn_pool_is_tainted_and_takes_the_whole_node_request(tmp_path: Path) -> None:
    plan = planned(tmp_path, qgpu_node_pool_alloc_mode="xgn")
    assert plan["metadata"]["labels"][ALLOC_MODE] == "xgn" and plan["spec"]["taints"] == [XGN_TAINT]
    placed = place(node_with(plan["metadata"]["labels"]), parse_pod(t9k_pod({"tensorstack.dev/nvidia-gpu-node": "1"})),
                   make_policy("binpack"))
    assert [s.index for s in placed.containers[0].shares] == [0, 1]
