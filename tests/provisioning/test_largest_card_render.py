"""One largest card for every component (--largest-card-memory-mib): the webhook admits a pod, the
extender and the node manager parse it again, so all three must be rendered with the same value,
from the one inventory-wide variable ``qgpu_largest_card_memory_mib``. An inventory that set only
the webhook's older ``qgpu_webhook_largest_card_memory_mib`` keeps it, now on every component; two
different values are refused before anything is rendered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_tools import Run, ansible_playbook

POOLS = {"qgpu_pool_training": {"hosts": {"gpu-1": None}},
         "qgpu_pool_dra": {"hosts": {"gpu-dra-1": None}, "vars": {"qgpu_pool_mode": "dra"}}}
MANIFESTS = ("qgpu-webhook.yaml", "qgpu-scheduler.yaml", "qgpu-manager.yaml")


def render(tmp_path: Path, inventory_vars: dict[str, Any]) -> tuple[Run, dict[str, list[dict[str, Any]]]]:
    """The three roles' manifests, rendered without applying from one inventory whose ``all`` vars
    are ``inventory_vars`` (as inventories/example/group_vars/all.yml sets them)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"vars": inventory_vars, "children": {
        "qgpu_kube_api": {"hosts": {"localhost": {"ansible_connection": "local"}}},
        "qgpu_gpu_nodes": {"children": POOLS}}}}))
    root = tmp_path / "root"
    playbook = tmp_path / "render.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Render the webhook, the extender and the node manager", "hosts": "qgpu_kube_api", "gather_facts": False,
        "vars": {"ansible_python_interpreter": "{{ ansible_playbook_python }}", "qgpu_root_prefix": str(root)},
        "tasks": [
            {"name": "Render the webhook", "ansible.builtin.include_role": {"name": "qgpu_webhook"},
             "vars": {"qgpu_webhook_apply": False}},
            {"name": "Render the extender", "ansible.builtin.include_role": {"name": "qgpu_scheduler"},
             "vars": {"qgpu_scheduler_apply": False, "qgpu_scheduler_insecure_plain_http": True}},
            {"name": "Render the node manager", "ansible.builtin.include_role": {"name": "qgpu_manager"},
             "vars": {"qgpu_manager_apply": False}}]}]))
    run = ansible_playbook("-i", str(inventory), str(playbook))
    docs = {name: [d for d in yaml.safe_load_all((root / "etc/qgpu/manifests" / name).read_text()) if d]
            for name in MANIFESTS if run.returncode == 0}
    return run, docs


def largest_card_args(docs: dict[str, list[dict[str, Any]]]) -> dict[str, list[str]]:
    """Every rendered container's --largest-card-memory-mib, by workload (webhook, extender, each
    node manager DaemonSet of each policy and mode)."""
    found: dict[str, list[str]] = {}
    for manifest in docs.values():
        for doc in manifest:
            if doc["kind"] in ("Deployment", "DaemonSet"):
                for container in doc["spec"]["template"]["spec"]["containers"]:
                    found[f"{doc['metadata']['name']}/{container['name']}"] = [
                        a for a in container.get("args", []) if a.startswith("--largest-card-memory-mib")]
    return found


@pytest.mark.parametrize("inventory_vars", [{"qgpu_largest_card_memory_mib": 143771},
                                            {"qgpu_webhook_largest_card_memory_mib": 143771}],
                         ids=["the-one-variable", "the-webhooks-older-variable"])
def test_every_component_is_rendered_with_the_same_largest_card(tmp_path: Path, inventory_vars: dict[str, Any]):
    run, docs = render(tmp_path, inventory_vars)
    assert run.returncode == 0, run.output[-4000:]
    found = largest_card_args(docs)
    assert {"qgpu-webhook/webhook", "qgpu-scheduler/extender"} <= set(found)
    assert any(name.startswith("qgpu-manager-dra-") for name in found)  # both doors of the node manager
    assert any(name.startswith("qgpu-manager-") and not name.startswith("qgpu-manager-dra-") for name in found)
    assert {name: args for name, args in found.items() if args != ["--largest-card-memory-mib=143771"]} == {}


def test_two_different_values_are_refused_before_anything_is_rendered(tmp_path: Path):
    run, _ = render(tmp_path, {"qgpu_largest_card_memory_mib": 143771, "qgpu_webhook_largest_card_memory_mib": 81920})
    assert run.returncode != 0
    assert "equal to qgpu_largest_card_memory_mib (143771)" in run.output
    assert not (tmp_path / "root/etc/qgpu/manifests/qgpu-webhook.yaml").exists()


def test_a_value_out_of_bounds_is_refused_naming_the_variable(tmp_path: Path):
    run, _ = render(tmp_path, {"qgpu_largest_card_memory_mib": 100})
    assert run.returncode != 0
    assert "qgpu_webhook_largest_card_memory_mib=100: must be the memory (MiB) of the largest card, within 1024..1048576" in run.output
