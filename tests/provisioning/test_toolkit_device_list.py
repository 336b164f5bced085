"""The nvidia_container_toolkit role makes the toolkit build a container's GPU list from mounts only.

With nvidia as containerd's default runtime and the toolkit's shipped config, any unprivileged
container that sets NVIDIA_VISIBLE_DEVICES=all got every card of the node. The role sets the two
top-level keys of /etc/nvidia-container-runtime/config.toml that close this: the environment
counts only for privileged containers, and mounts at /var/run/nvidia-container-devices/<card>
(put there by qgpu's Allocate answer or CDI spec, never by a pod spec without hostPath) name the
cards. The role runs against a sandboxed GPU node (qgpu_root_prefix, no packages, no services).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from ansible_tools import BIN, REPO, Run, run_tool

PLAYBOOK = REPO / "tests/provisioning/playbooks/nvidia-containerd.yml"
# The toolkit config tasks alone: a --check run of the whole role stops at its repository step
# on a sandbox whose etc/yum.repos.d does not exist yet.
TASKS_ONLY = REPO / "tests/provisioning/playbooks/nvidia-toolkit-config.yml"
CONFIG = Path("etc/nvidia-container-runtime/config.toml")
ENVVAR = "accept-nvidia-visible-devices-envvar-when-unprivileged"
MOUNTS = "accept-nvidia-visible-devices-as-volume-mounts"

# What the toolkit package installs: both keys commented out above the tables.
SHIPPED = """\
#accept-nvidia-visible-devices-as-volume-mounts = false
#accept-nvidia-visible-devices-envvar-when-unprivileged = true
disable-require = false
supported-driver-capabilities = "compat32,compute,display,graphics,ngx,utility,video"
#swarm-resource = "DOCKER_RESOURCE_GPU"

[nvidia-container-cli]
environment = []
ldconfig = "@/sbin/ldconfig"
load-kmods = true
#no-cgroups = false

[nvidia-container-runtime]
log-level = "info"
mode = "auto"
runtimes = ["docker-runc", "runc", "crun"]

[nvidia-container-runtime-hook]
path = "nvidia-container-runtime-hook"
skip-mode-detection = false
"""


def gpu_node(root: Path, toolkit_config: str | None) -> Path:
    """A node with one T4 on the fixture PCI bus, containerd's config and (unless None) the
    toolkit's; returns the toolkit config's path in the sandbox."""
    pci = Path(f"{root}-probe/sys/bus/pci/devices/0000:3b:00.0")
    pci.mkdir(parents=True)
    for name, value in {"vendor": "0x10de", "class": "0x030200", "device": "0x1eb8"}.items():
        (pci / name).write_text(value + "\n")
    (root / "etc/containerd").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_text("version = 2\n")
    path = root / CONFIG
    if toolkit_config is not None:
        path.parent.mkdir(parents=True)
        path.write_text(toolkit_config)
    return path


def run_role(root: Path, *flags: str, playbook: Path = PLAYBOOK, **extra: Any) -> Run:
    run = run_tool([str(BIN / "ansible-playbook"), "-i", "localhost,", str(playbook), *flags,
                    "-e", json.dumps({"qgpu_root_prefix": str(root), **extra})])
    assert run.returncode == 0, run.output[-5000:]
    return run


def test_the_shipped_config_gets_both_keys_in_place_of_its_comments_and_keeps_the_rest(tmp_path: Path) -> None:
    config = gpu_node(tmp_path / "root", SHIPPED)
    run_role(tmp_path / "root")
    text = config.read_text()
    assert text.splitlines()[:2] == [f"{MOUNTS} = true", f"{ENVVAR} = false"]
    parsed = tomllib.loads(text)
    assert (parsed[ENVVAR], parsed[MOUNTS]) == (False, True)
    assert {k: v for k, v in parsed.items() if k not in (ENVVAR, MOUNTS)} == tomllib.loads(SHIPPED)


def test_keys_missing_from_a_config_go_to_the_top_level_before_its_first_table(tmp_path: Path) -> None:
    """Below a [table] header a key would belong to that table, and the hook would never read it."""
    written_by_another_tool = '[nvidia-container-cli]\nload-kmods = true\n\n[nvidia-container-runtime]\nmode = "auto"\n'
    config = gpu_node(tmp_path / "root", written_by_another_tool)
    run_role(tmp_path / "root")
    parsed = tomllib.loads(config.read_text())
    assert (parsed[ENVVAR], parsed[MOUNTS]) == (False, True)
    assert parsed["nvidia-container-cli"] == {"load-kmods": True}
    assert parsed["nvidia-container-runtime"] == {"mode": "auto"}


def test_a_node_without_a_toolkit_config_gets_one_with_both_keys(tmp_path: Path) -> None:
    config = gpu_node(tmp_path / "root", None)
    run_role(tmp_path / "root")
    assert tomllib.loads(config.read_text()) == {ENVVAR: False, MOUNTS: True}


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    gpu_node(tmp_path / "root", SHIPPED)
    run_role(tmp_path / "root")
    second = run_role(tmp_path / "root")
    assert second.recap_changed() == 0, second.output[-3000:]


def test_check_mode_reports_the_change_and_writes_nothing(tmp_path: Path) -> None:
    config = gpu_node(tmp_path / "root", SHIPPED)
    run = run_role(tmp_path / "root", "--check", playbook=TASKS_ONLY)
    assert config.read_text() == SHIPPED
    keys_task = run.output.split("Set the toolkit's device-list keys")[1].split("TASK [")[0]
    assert "changed:" in keys_task, keys_task


def test_turned_off_the_toolkit_config_is_left_as_it_is(tmp_path: Path) -> None:
    config = gpu_node(tmp_path / "root", SHIPPED)
    run_role(tmp_path / "root", nvidia_container_toolkit_device_list_from_mounts=False)
    assert config.read_text() == SHIPPED


def test_a_pool_served_by_nvidias_device_plugin_keeps_the_variable_and_is_told_why(tmp_path: Path) -> None:
    """NVIDIA's device plugin (default envvar strategy) passes cards only by NVIDIA_VISIBLE_DEVICES:
    switched to mounts, every pod it serves lost its GPUs."""
    config = gpu_node(tmp_path / "root", SHIPPED)
    run = run_role(tmp_path / "root", qgpu_manager_nvidia_device_plugin=True)
    assert config.read_text() == SHIPPED
    assert "DEVICE_LIST_STRATEGY=volume-mounts" in run.output
    # told it lists by mounts, the pool is switched like any other
    run_role(tmp_path / "root", qgpu_manager_nvidia_device_plugin=True, qgpu_manager_nvidia_device_plugin_lists_by_mounts=True)
    assert tomllib.loads(config.read_text())[ENVVAR] is False
