"""playbooks/gpu-nodes.yml with the example inventory's preflight lists on a fresh GPU node (no
kernel headers, no driver yet): the platform checks pass, nvidia_driver (which installs the
headers) runs, and the kernel headers are checked only after it.

The node is the sandbox of the molecule scenarios: localhost, files under qgpu_root_prefix, probes
under a fixture tree (one T4, cgroup v2), a fake containerd 2.x first on PATH, no dnf, no services.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from ansible_tools import BIN, REPO, Run, run_tool

EXAMPLE_ALL = yaml.safe_load((REPO / "inventories/example/group_vars/all.yml").read_text())


def fresh_node(tmp_path: Path) -> Path:
    """An inventory with one fresh GPU node; returns the inventory directory."""
    root, probe = tmp_path / "root", tmp_path / "probe"
    pci = probe / "sys/bus/pci/devices/0000:3b:00.0"
    pci.mkdir(parents=True)
    for name, value in {"vendor": "0x10de", "class": "0x030200", "device": "0x1eb8"}.items():
        (pci / name).write_text(value + "\n")
    (probe / "sys/fs/cgroup").mkdir(parents=True)
    (probe / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    fake = tmp_path / "bin/containerd"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'containerd github.com/containerd/containerd/v2 v2.1.4 75cb2b7'\n")
    fake.chmod(0o755)

    inventory = tmp_path / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {
        "qgpu_gpu_nodes": {"hosts": {"localhost": None}}, "qgpu_standalone": {"hosts": {}},
        "qgpu_kube_api": {"hosts": {}}, "kube_control_plane": {"hosts": {}}}}}))
    platform = {"distribution": "TencentOS", "major_version": "3", "architecture": "x86_64"}
    (inventory / "group_vars/all.yml").write_text(yaml.safe_dump({
        # The example's preflight: mode, planned kubelet, the checks before and after installing.
        **{k: EXAMPLE_ALL[k] for k in ("gpu_preflight_mode", "qgpu_kubelet_version", "qgpu_preflight_checks",
                                         "qgpu_preflight_post_checks")},
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "qgpu_root_prefix": str(root),
        "gpu_preflight_probe_root": str(probe),
        # This machine is not TencentOS: the sandbox host declares its own OS supported (once facts exist).
        "gpu_preflight_supported_os": "{{ {ansible_facts.distribution | default('unknown'):"
                                      " [ansible_facts.distribution_major_version | default('unknown')]} }}",
        "nvidia_driver_probe_root": str(probe), "nvidia_driver_platform": platform,
        "nvidia_driver_manage_packages": False, "nvidia_driver_manage_services": False,
        "cuda_toolkit_probe_root": str(probe), "cuda_toolkit_platform": platform, "cuda_toolkit_manage_packages": False,
        "nvidia_container_toolkit_probe_root": str(probe),
        "nvidia_container_toolkit_platform": {"distribution": "TencentOS", "major_version": "3"},
        "nvidia_container_toolkit_manage_packages": False, "nvidia_container_toolkit_manage_services": False,
    }))
    return inventory


def run_gpu_nodes(tmp_path: Path) -> Run:
    inventory = fresh_node(tmp_path)
    return run_tool([str(BIN / "ansible-playbook"), "-i", str(inventory), "playbooks/gpu-nodes.yml"],
                    PATH=f"{BIN}{os.pathsep}{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")


def test_a_fresh_node_passes_the_platform_checks_and_gets_the_headers_checked_after_the_driver(tmp_path: Path) -> None:
    run = run_gpu_nodes(tmp_path)
    output = run.output
    assert "TASK [nvidia_driver :" in output, f"the platform checks stopped the play before nvidia_driver:\n{output[-3000:]}"
    platform_checks = output.index("TASK [Check the platform before installing]")
    driver = output.index("TASK [nvidia_driver :")
    post_checks = output.index("TASK [Check the installed software]")
    assert platform_checks < driver < post_checks
    # Nothing about kernel headers before the driver role; the platform checks all passed.
    assert "kernel_headers" not in output[platform_checks:driver]
    assert "FAIL " not in output[platform_checks:driver]
    # The sandbox installs no packages, so the headers are still missing when checked after it.
    assert "kernel_headers: no headers for the running kernel" in output[post_checks:]
