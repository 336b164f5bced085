"""Which Python each host of the example inventory is driven with: masters get whatever Ansible
discovers on them (nothing installs a Python there), GPU nodes the one gpu_preflight installs."""

from __future__ import annotations

import json
import os

from ansible_tools import BIN, run_tool


def example_hostvars() -> dict[str, dict]:
    run = run_tool([str(BIN / "ansible-inventory"), "-i", "inventories/example", "--list"])
    assert run.returncode == 0, run.output
    inventory = json.loads(run.output)
    return {host: vars_ for host, vars_ in inventory["_meta"]["hostvars"].items()
            if host in inventory["kube_control_plane"]["hosts"] or host.startswith("gpu-")}


def test_masters_have_no_interpreter_forced_on_them() -> None:
    masters = {h: v for h, v in example_hostvars().items() if h.startswith("master-")}
    assert len(masters) == 3
    assert {h: v.get("ansible_python_interpreter") for h, v in masters.items()} == dict.fromkeys(masters)


def test_gpu_nodes_use_the_python_the_preflight_bootstrap_installs() -> None:
    nodes = {h: v for h, v in example_hostvars().items() if h.startswith("gpu-")}
    assert len(nodes) == 5
    for host, hostvars in nodes.items():
        assert hostvars["gpu_preflight_bootstrap_python"] is True, host
        assert hostvars["gpu_preflight_bootstrap_python_package"] == "python3.11", host
        assert hostvars["ansible_python_interpreter"] == "/usr/bin/python3.11", host
        assert hostvars["qgpu_runtime_python"] == "/usr/bin/python3.11", host


def test_a_master_is_driven_with_the_interpreter_ansible_discovers() -> None:
    """master-1 reached through a local connection: the ping runs on a discovered interpreter
    (Ansible reports discovered_interpreter_python only when it discovered one). PATH holds this
    venv and the system's bin directories only, so a version manager's shims cannot be discovered."""
    run = run_tool([str(BIN / "ansible"), "master-1", "-i", "inventories/example", "-m", "ansible.builtin.ping",
                    "-e", "ansible_connection=local"], PATH=f"{BIN}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert run.returncode == 0, run.output[-3000:]
    assert "discovered_interpreter_python" in run.output, run.output[-3000:]
