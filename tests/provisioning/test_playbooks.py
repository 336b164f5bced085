"""Playbooks, inventories and lint: everything parses against both inventories, the example
inventory says what it promises, and ansible-lint's production profile passes."""

from __future__ import annotations

import json

import pytest
from ansible_tools import BIN, run_tool

PLAYBOOKS = ["site.yml", "playbooks/site.yml", "playbooks/gpu-nodes.yml", "playbooks/node-pools.yml", "playbooks/standalone.yml",
             "playbooks/apiserver-admission.yml", "playbooks/cluster.yml", "playbooks/control-plane.yml", "playbooks/node-pool-rollout.yml",
             "playbooks/reapply-scheduler-extender.yml", "playbooks/teardown.yml"]


@pytest.mark.parametrize("inventory", ["inventories/local", "inventories/example", "inventories/local-cluster"])
def test_every_playbook_parses_against_the_inventory(inventory: str) -> None:
    run = run_tool([str(BIN / "ansible-playbook"), "--syntax-check", "-i", inventory, *PLAYBOOKS])
    assert run.returncode == 0, run.output[-4000:]


def test_example_inventory_has_two_policies_and_a_mixed_pool() -> None:
    run = run_tool([str(BIN / "ansible-inventory"), "-i", "inventories/example", "--list"])
    assert run.returncode == 0, run.output
    inventory = json.loads(run.output)
    hostvars = inventory["_meta"]["hostvars"]
    pools = inventory["qgpu_gpu_nodes"]["children"]
    policies = {pool: {hostvars[h]["qgpu_node_pool_isolation_policy"] for h in inventory[pool]["hosts"]} for pool in pools}
    mixed = {pool: {hostvars[h].get("qgpu_node_pool_mixed", False) for h in inventory[pool]["hosts"]} for pool in pools}
    assert policies == {"qgpu_pool_training": {"fixed-share"}, "qgpu_pool_inference": {"burst-share"},
                        "qgpu_pool_mixed": {"best-effort"}}
    assert mixed == {"qgpu_pool_training": {False}, "qgpu_pool_inference": {False}, "qgpu_pool_mixed": {True}}
    assert len(inventory["kube_control_plane"]["hosts"]) == 3


def test_local_inventory_is_sandboxed_and_chooses_simulated_gpus() -> None:
    run = run_tool([str(BIN / "ansible-inventory"), "-i", "inventories/local", "--host", "localhost"])
    assert run.returncode == 0, run.output
    host = json.loads(run.output)
    assert host["ansible_connection"] == "local"
    assert "local-root" in host["qgpu_root_prefix"]
    assert host["qgpu_manager_gpu_backend"] == "simulated"
    assert host["qgpu_simulated_gpus"] == "2xV100-32G,1xT4-16G"
    assert host["gpu_preflight_mode"] == "report"


@pytest.mark.slow
def test_ansible_lint_production_profile_passes() -> None:
    run = run_tool([str(BIN / "ansible-lint"), "--nocolor"], timeout=600)
    assert run.returncode == 0, run.output[-6000:]
    assert "Profile 'production' was required, and it passed" in run.output
